/* A model's weights quantized for the C decode step (decode_quantized.c reads them), in one pass over the weights
 * with the threads: what kvrag.cpu.cstep's `int8_rows` and `int4_rows` compute in torch, bit for bit (their torch
 * code is the reference the tests hold this to), in a small part of their time: they convert a slice of rows to
 * float32 and make several passes over it, which on the 1.5B took 5.6 s of every process's start.
 *
 * int8: each group of INT8_GROUP columns of a row divided by its largest magnitude over 127, rounded to the nearest
 * integer (ties to even, as torch's round), its offset 128 times the scale times the group's sum of values.
 * int4: each group as the nearest of 16 levels from its least to its largest weight, the least and the step
 * rounded to float16 (nearest, ties to even, as torch's .half()), two values a byte (in each 128 columns, byte i
 * holds column i in its low half and column 64 + i in its high half).
 *
 * Compiled without -ffast-math's liberties (a division by a reciprocal would move a value across a rounding
 * boundary now and then): the same float32 operations as torch's, in the same order.
 */
#pragma GCC optimize("no-fast-math")

#include <math.h>
#include <stdint.h>
#include <string.h>

#define INT8_GROUP 64

/* float32 to float16 bits, to nearest with ties to even (IEEE, as torch's .half()), written out so that the file
 * needs no _Float16 (GCC 12 or Clang 15 on x86): past 65504 by half a step or more is infinity */
static inline uint16_t half_of(float value) {
    uint32_t x;
    memcpy(&x, &value, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000, magnitude = x & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) return (uint16_t)(sign | (magnitude > 0x7f800000u ? 0x7e00 : 0x7c00));
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* 65520 and beyond */
    if (magnitude < 0x38800000u) {                                  /* below 2^-14: a subnormal half, or zero */
        float a;
        memcpy(&a, &magnitude, sizeof a);
        return (uint16_t)(sign | (uint32_t)rintf(a * 16777216.0f)); /* in steps of 2^-24; 1024 is 2^-14 */
    }
    uint32_t r = magnitude - 0x38000000u; /* the exponent's bias, 127 -> 15 */
    r += 0xfffu + ((r >> 13) & 1);        /* ties to even; a carry moves into the exponent */
    return (uint16_t)(sign | (r >> 13));
}

/* float16 bits to float32 (exact) */
static inline float float_of(uint16_t half) {
    const uint32_t sign = (uint32_t)(half & 0x8000) << 16, exponent = (half >> 10) & 0x1f, mantissa = half & 0x3ff;
    if (exponent == 0) {
        const float f = (float)mantissa * 5.9604644775390625e-08f; /* 2^-24 */
        return sign ? -f : f;
    }
    const uint32_t x = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

/* the INT8_GROUP weights at `from` (bfloat16 where bf16 != 0, else float32) as float32, in x */
static inline void group_at(const void *from, int bf16, float *x) {
    if (bf16) {
        const uint16_t *h = (const uint16_t *)from;
        for (int i = 0; i < INT8_GROUP; i++) {
            uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(x + i, &bits, sizeof bits);
        }
    } else {
        memcpy(x, from, INT8_GROUP * sizeof(float));
    }
}

/* weights [R, C] (C a multiple of INT8_GROUP) -> values int8 [R, C], scales and offsets float32 [R, C / INT8_GROUP].
 * 0, or -2 for a C it does not take. */
int quantize_int8_rows(const void *weights, int bf16, long R, long C, int8_t *values, float *scales, float *offsets,
                       int threads) {
    if (C % INT8_GROUP || C <= 0) return -2;
    const long groups = C / INT8_GROUP;
    const size_t width = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < R; r++) {
        float x[INT8_GROUP];
        for (long g = 0; g < groups; g++) {
            group_at((const char *)weights + ((size_t)r * C + g * INT8_GROUP) * width, bf16, x);
            float top = 0.0f;
            for (int i = 0; i < INT8_GROUP; i++) {
                float a = x[i] < 0 ? -x[i] : x[i];
                top = a > top ? a : top;
            }
            float scale = top / 127.0f;
            if (!(scale > 0.0f)) scale = 1.0f;
            float total = 0.0f;
            int8_t *out = values + r * C + g * INT8_GROUP;
            for (int i = 0; i < INT8_GROUP; i++) {
                float q = __builtin_rintf(x[i] / scale);
                q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
                out[i] = (int8_t)q;
                total += q; /* integers: exact in any order */
            }
            scales[r * groups + g] = scale;
            offsets[r * groups + g] = 128.0f * scale * total;
        }
    }
    return 0;
}

/* weights [R, C] (C a multiple of 128) -> values uint8 [R, C / 2], scales and minimums float16 [R, C / INT8_GROUP].
 * 0, or -2 for a C it does not take. */
int quantize_int4_rows(const void *weights, int bf16, long R, long C, uint8_t *values, uint16_t *scales,
                       uint16_t *minimums, int threads) {
    if (C % (2 * INT8_GROUP) || C <= 0) return -2;
    const long groups = C / INT8_GROUP;
    const size_t width = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < R; r++) {
        float x[INT8_GROUP];
        uint8_t levels[2 * INT8_GROUP];
        for (long b = 0; b < C / (2 * INT8_GROUP); b++) {
            for (int h = 0; h < 2; h++) {
                const long g = 2 * b + h;
                group_at((const char *)weights + ((size_t)r * C + g * INT8_GROUP) * width, bf16, x);
                float low = x[0], high = x[0];
                for (int i = 1; i < INT8_GROUP; i++) {
                    low = x[i] < low ? x[i] : low;
                    high = x[i] > high ? x[i] : high;
                }
                const uint16_t least = half_of(low);
                uint16_t scale = half_of((high - float_of(least)) / 15.0f);
                if (!(float_of(scale) > 0.0f)) scale = 0x3c00; /* 1.0 */
                const float lf = float_of(least), sf = float_of(scale);
                for (int i = 0; i < INT8_GROUP; i++) {
                    float u = __builtin_rintf((x[i] - lf) / sf);
                    levels[h * INT8_GROUP + i] = (uint8_t)(u < 0.0f ? 0.0f : (u > 15.0f ? 15.0f : u));
                }
                scales[r * groups + g] = scale;
                minimums[r * groups + g] = least;
            }
            uint8_t *out = values + r * (C / 2) + b * INT8_GROUP;
            for (int i = 0; i < INT8_GROUP; i++) out[i] = (uint8_t)(levels[i] | (levels[INT8_GROUP + i] << 4));
        }
    }
    return 0;
}
