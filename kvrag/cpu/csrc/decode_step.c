/* Decoded tokens through a whole llama-family decoder on CPU, in one call: kvrag.cpu.ckernel builds and loads this,
 * kvrag.cpu.decode calls it once a step, with one token or a token and its prompt-lookup drafts (up to
 * MAX_TOKENS consecutive tokens).
 *
 * A decode step is vector-matrix products over every weight, attention over the cache, and a little
 * elementwise work between them. Each product walks its weight rows in order, one row after the other, each
 * output row a dot product in 16-lane float32 vectors: the cores then read the weights as a single stream and
 * the memory bandwidth, not the arithmetic, sets the time. (Four rows side by side, the usual way to reuse the
 * input vector, read the weights at about half the bandwidth here: the hardware prefetcher follows one stream
 * a core, not four.) Rows are split across the threads in equal contiguous runs. With several tokens, each row
 * is read once for all of them, and each token's dot product runs as it would alone.
 *
 * Weights and cache are float32 or bfloat16 (the model's dtype). In bfloat16 every value is rounded to
 * bfloat16 where transformers' bfloat16 forward rounds it (each product's output, the residual sums, RMSNorm's
 * output before its weight and after it, the rotary embedding's products and sum, SiLU and its product), and
 * every sum runs in float32, so the step computes what kvrag's torch step computes up to the order of the sums.
 * A bfloat16 product runs on the CPU's bfloat16 dot product where it has one (AVX512-BF16), else it reads a row
 * as 32-bit words: the even element is a word's low half shifted up, the odd one its high half masked, each
 * multiplied by the input's even or odd elements (kept apart once an input).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "step_model.h"
#include "vectors.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

void decode_attention_f32_queries(const float *queries, const float *keys, const float *values, long stride, int hkv,
                                  int G, int D, long n, int K, float scale, float *outs, float *part, int threads);
void decode_attention_bf16_queries(const float *queries, const uint16_t *keys, const uint16_t *values, long stride,
                                   int hkv, int G, int D, long n, int K, float scale, float *outs, float *part,
                                   int threads);


static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's cast */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* v rounded to the model's dtype (float32: as it is) */
static inline float rnd(float v, int bf16) { return bf16 ? from_bf16(to_bf16(v)) : v; }

static inline float get(const void *p, long i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void put(void *p, long i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = to_bf16(v); else ((float *)p)[i] = v;
}

/* The products of a step of K tokens (1 to MAX_TOKENS): each weight row is read once, from memory, for all K
 * inputs, and each input's dot product with it runs exactly as it would alone (the same vector sums in the same
 * order, K only sets how many run side by side), so a step of K tokens computes, bit for bit, what K steps of
 * one token compute. The rows are split across the threads in equal contiguous runs. */
#define MAX_TOKENS 8
#ifndef AHEAD
#define AHEAD 2048
#endif

/* out[j][r] = rnd(sum_i w[r, i] x[j][i] + bias[r]), j < K, r < R; w [R, C] float32; x, out: rows of C and R */
#define PRODUCT_F32(K)                                                                                          \
    static void product_f32_##K(const float *w, const float *x, const float *split, const void *bias,          \
                                float *out, long R, long C, int bf16, int threads) {                            \
        long body = C - C % 32;                                                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long r = 0; r < R; r++) {                                                                          \
            const float *row = w + r * C;                                                                       \
            v16 a0[K], a1[K];                                                                                   \
            for (int j = 0; j < K; j++) a0[j] = a1[j] = (v16){0};                                               \
            for (long c = 0; c < body; c += 32) {                                                               \
                v16 w0 = load_f32(row + c), w1 = load_f32(row + c + 16);                                        \
                if (K > 1) __builtin_prefetch((const char *)(row + c) + AHEAD, 0, 3);                                 \
                const float *xc = split + c * K;                                                                \
                for (int j = 0; j < K; j++) {                                                                   \
                    a0[j] += w0 * load_f32(xc + 32 * j);                                                        \
                    a1[j] += w1 * load_f32(xc + 32 * j + 16);                                                   \
                }                                                                                               \
            }                                                                                                   \
            for (int j = 0; j < K; j++) {                                                                       \
                float s = lanes_sum(a0[j] + a1[j]);                                                             \
                for (long c = body; c < C; c++) s += row[c] * x[j * C + c];                                     \
                out[j * R + r] = rnd(bias ? s + get(bias, r, bf16) : s, bf16);                                  \
            }                                                                                                   \
        }                                                                                                       \
    }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_DOT 1
/* The same over bfloat16 rows, on the CPU's bfloat16 dot product (vdpbf16ps: each float32 lane adds the
 * products of two adjacent bfloat16 pairs, exact, to its sum): the inputs are bfloat16 already (x holds values
 * in the model's dtype), so each 32 weights cost one instruction an input where a float32 product costs two,
 * and a step of several tokens stays near the memory's rate rather than the arithmetic's. split: the inputs'
 * bodies as bfloat16, 32 of one input then the same 32 of the next. Two sums a row (alternate 32s), so that
 * one input's chain of dot products does not wait on itself. */
#define PRODUCT_BF16(K)                                                                                         \
    static void product_bf16_##K(const uint16_t *w, const float *x, const uint16_t *split, const void *bias,    \
                                 float *out, long R, long C, int threads) {                                     \
        long body = C - C % 32, pairs = C - C % 64;                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long r = 0; r < R; r++) {                                                                          \
            const uint16_t *row = w + r * C;                                                                    \
            __m512 a0[K], a1[K];                                                                                \
            for (int j = 0; j < K; j++) a0[j] = a1[j] = _mm512_setzero_ps();                                    \
            for (long c = 0; c < pairs; c += 64) {                                                              \
                __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + c);                                            \
                __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + c + 32);                                       \
                if (K > 1) __builtin_prefetch((const char *)(row + c) + AHEAD, 0, 3);                                 \
                const uint16_t *xc = split + c * K;                                                             \
                for (int j = 0; j < K; j++) {                                                                   \
                    a0[j] = _mm512_dpbf16_ps(a0[j], w0, (__m512bh)_mm512_loadu_si512(xc + 32 * j));             \
                    a1[j] = _mm512_dpbf16_ps(a1[j], w1, (__m512bh)_mm512_loadu_si512(xc + 32 * (K + j)));       \
                }                                                                                               \
            }                                                                                                   \
            if (pairs < body) {                                                                                 \
                __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + pairs);                                        \
                const uint16_t *xc = split + pairs * K;                                                         \
                for (int j = 0; j < K; j++)                                                                     \
                    a0[j] = _mm512_dpbf16_ps(a0[j], w0, (__m512bh)_mm512_loadu_si512(xc + 32 * j));             \
            }                                                                                                   \
            for (int j = 0; j < K; j++) {                                                                       \
                v16 s0, s1; memcpy(&s0, &a0[j], sizeof s0); memcpy(&s1, &a1[j], sizeof s1);                     \
                float s = lanes_sum(s0 + s1);                                                                   \
                for (long c = body; c < C; c++) s += from_bf16(row[c]) * x[j * C + c];                          \
                out[j * R + r] = rnd(bias ? s + from_bf16(((const uint16_t *)bias)[r]) : s, 1);                 \
            }                                                                                                   \
        }                                                                                                       \
    }
#else
#define BF16_DOT 0
/* The same over bfloat16 rows, where the CPU has no bfloat16 dot product: a row is read as 32-bit words (the
 * even element a word's low half shifted up, the odd one its high half masked); split: each 32 elements of an
 * input as its 16 even then its 16 odd ones, 32 of one input then the same 32 of the next. */
#define PRODUCT_BF16(K)                                                                                         \
    static void product_bf16_##K(const uint16_t *w, const float *x, const float *split, const void *bias,       \
                                 float *out, long R, long C, int threads) {                                     \
        long body = C - C % 32;                                                                                 \
        const u32x16 high = (u32x16){0} + 0xffff0000u;                                                          \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long r = 0; r < R; r++) {                                                                          \
            const uint16_t *row = w + r * C;                                                                    \
            v16 a0[K], a1[K];                                                                                   \
            for (int j = 0; j < K; j++) a0[j] = a1[j] = (v16){0};                                               \
            for (long c = 0; c < body; c += 32) {                                                               \
                u32x16 u; memcpy(&u, row + c, sizeof u);                                                        \
                if (K > 1) __builtin_prefetch((const char *)(row + c) + AHEAD, 0, 3);                                 \
                u32x16 even = u << 16, odd = u & high;                                                          \
                v16 fe, fo; memcpy(&fe, &even, sizeof fe); memcpy(&fo, &odd, sizeof fo);                        \
                const float *xc = split + c * K;                                                                \
                for (int j = 0; j < K; j++) {                                                                   \
                    a0[j] += fe * load_f32(xc + 32 * j);                                                        \
                    a1[j] += fo * load_f32(xc + 32 * j + 16);                                                   \
                }                                                                                               \
            }                                                                                                   \
            for (int j = 0; j < K; j++) {                                                                       \
                float s = lanes_sum(a0[j] + a1[j]);                                                             \
                for (long c = body; c < C; c++) s += from_bf16(row[c]) * x[j * C + c];                          \
                out[j * R + r] = rnd(bias ? s + from_bf16(((const uint16_t *)bias)[r]) : s, 1);                 \
            }                                                                                                   \
        }                                                                                                       \
    }
#endif

PRODUCT_F32(1) PRODUCT_F32(2) PRODUCT_F32(3) PRODUCT_F32(4) PRODUCT_F32(5) PRODUCT_F32(6) PRODUCT_F32(7)
PRODUCT_F32(8)
PRODUCT_BF16(1) PRODUCT_BF16(2) PRODUCT_BF16(3) PRODUCT_BF16(4) PRODUCT_BF16(5) PRODUCT_BF16(6) PRODUCT_BF16(7)
PRODUCT_BF16(8)

/* out[j] = rnd(w x[j] + bias) for j < K; x: K rows of C float32 (their values already in the model's dtype),
 * out: K rows of R; split: K * C floats of scratch, where the inputs' bodies (up to C - C % 32) are laid out
 * for the products: each 32 elements of one input then the same 32 of the next, so the K inputs' vectors for a
 * stretch of a weight row are read as one stream (K streams beside the weights' halve the rate the memory
 * delivers the weights at; measured). A bfloat16 product reads each 32 as the 16 even elements then the 16
 * odd ones, as it splits its weights. */
static void product(const void *w, const float *x, const void *bias, float *out, long R, long C, int K, int bf16,
                    float *split, int threads) {
#define PRODUCT_CASE(N)                                                                                         \
    case N:                                                                                                     \
        if (bf16) product_bf16_##N(w, x, (void *)split, bias, out, R, C, threads);                              \
        else product_f32_##N(w, x, split, bias, out, R, C, 0, threads);                                         \
        break;
    long body = C - C % 32;
    for (long c = 0; c < body; c += 32)
        for (int j = 0; j < K; j++) {
            const float *from = x + j * C + c;
            if (bf16 && BF16_DOT) { /* x's values are bfloat16 already: their top halves, exact */
                uint16_t *to = (uint16_t *)split + c * K + 32 * j;
                for (int e = 0; e < 32; e++) to[e] = to_bf16(from[e]);
            } else if (bf16) {
                float *to = split + c * K + 32 * j;
                for (int e = 0; e < 16; e++) { to[e] = from[2 * e]; to[16 + e] = from[2 * e + 1]; }
            } else {
                memcpy(split + c * K + 32 * j, from, sizeof(float) * 32);
            }
        }
    switch (K) {
        PRODUCT_CASE(1) PRODUCT_CASE(2) PRODUCT_CASE(3) PRODUCT_CASE(4)
        PRODUCT_CASE(5) PRODUCT_CASE(6) PRODUCT_CASE(7) PRODUCT_CASE(8)
    }
#undef PRODUCT_CASE
}

/* transformers' RMSNorm: x * rsqrt(mean(x^2) + eps) in float32, rounded, then times the weight, rounded */
static void rms_norm(const float *x, const void *weight, float *out, long n, double eps, int bf16) {
    float sum = 0;
    for (long i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)n + (float)eps);
    for (long i = 0; i < n; i++) out[i] = rnd(get(weight, i, bf16) * rnd(x[i] * inv, bf16), bf16);
}

/* rotate-half RoPE on one head [d]: x * cos + cat(-x2, x1) * sin, each product and the sum rounded */
static void rope(float *x, const void *cos, const void *sin, long d, int bf16) {
    float tmp[512];
    long half = d / 2;
    for (long i = 0; i < d; i++) {
        float rotated = i < half ? -x[i + half] : x[i - half];
        tmp[i] = rnd(rnd(x[i] * get(cos, i, bf16), bf16) + rnd(rotated * get(sin, i, bf16), bf16), bf16);
    }
    memcpy(x, tmp, sizeof(float) * d);
}

int product_int8(const void *w, const void *scales, const void *offsets, const float *x, float *sums, long R, long C,
                 int K, float *scratch, int threads);
int product_int4(const void *w, const void *scales, const void *mins, const float *x, float *sums, long R, long C,
                 int K, float *scratch, int threads);

/* out[j] = rnd(w x[j] + bias) for j < K, through the quantized weights where the model has them
 * (decode_quantized.c: `bits` 8 or 4), else the model's own */
static void weights_product(const void *w, const struct int8_rows *q, int bits, const float *x, const void *bias,
                            float *out, long R, long C, int K, int bf16, float *split, int threads) {
    if (!q) {
        product(w, x, bias, out, R, C, K, bf16, split, threads);
        return;
    }
    if (bits == 4)
        product_int4(q->values, q->scales, q->offsets, x, out, R, C, K, split, threads);
    else
        product_int8(q->values, q->scales, q->offsets, x, out, R, C, K, split, threads);
    for (long j = 0; j < K; j++)
        for (long r = 0; r < R; r++) {
            float sum = out[j * R + r];
            out[j * R + r] = rnd(bias ? sum + get(bias, r, bf16) : sum, bf16);
        }
}

/* The logits [K][V] (float32) of tokens[0..K-1] (1 <= K <= MAX_TOKENS), one pass over the weights for all of them.
 * Token j reads and writes the cache whose layers' keys and values are keys[j][l], values[j][l] ([kv_heads,
 * capacity[j], head_dim], the model's dtype, contiguous): its key and value go to slot slots[j], and it attends to
 * slots 0..slots[j]; its rotary rows are cos[j], sin[j] ([K][head_dim], model dtype). Tokens of one cache at
 * consecutive slots (a token and its drafts) share one attention pass over that cache (a later token's key,
 * written first, is not read by the earlier ones); tokens of different caches (answers decoded side by side) each
 * attend to their own. Each token's logits are, bit for bit, those of a step of that token alone. 0, -1 where
 * scratch memory ran out, -2 for a K out of range. */
int decode_rows(const struct step_model *m, void *const *const *keys, void *const *const *values,
                const long *capacity, const long *tokens, long K, const void *cos, const void *sin, const long *slots,
                float *logits, int threads) {
    if (K < 1 || K > MAX_TOKENS) return -2;
    const int bf16 = (int)m->bf16;
    const long D = m->dim, F = m->ffn, H = m->heads, Hkv = m->kv_heads, d = m->head_dim, G = H / Hkv;
    const long qkv_rows = (H + 2 * Hkv) * d, widest = F > H * d ? (F > D ? F : D) : (H * d > D ? H * d : D);
    long last = 0;
    for (long j = 0; j < K; j++) last = slots[j] > last ? slots[j] : last;
    const long blocks = (last + K + 255) / 256;
    size_t floats = K * (D + D + qkv_rows + H * d + H * d + 2 * F + F + widest + Hkv * blocks * G * (d + 2));
    float *x = malloc(sizeof(float) * floats);
    if (!x) return -1;
    float *h = x + K * D, *qkv = h + K * D, *q32 = qkv + K * qkv_rows, *att = q32 + K * H * d;
    float *gu = att + K * H * d, *act = gu + K * 2 * F, *split = act + K * F, *part = split + K * widest;
    const long rot = d * (bf16 ? 2 : 4); /* bytes of one rotary row */
    const struct layer_int8 *q8 = m->int8_layer;
    const int bits = (int)m->int_bits;
    for (long j = 0; j < K; j++)
        for (long i = 0; i < D; i++) x[j * D + i] = get(m->embed, tokens[j] * D + i, bf16);
    for (long l = 0; l < m->layers; l++) {
        const struct layer_weights *w = &m->layer[l];
        for (long j = 0; j < K; j++) rms_norm(x + j * D, w->norm_in, h + j * D, D, m->eps, bf16);
        weights_product(w->qkv, q8 ? &q8[l].qkv : NULL, bits, h, w->qkv_bias, qkv, qkv_rows, D, K, bf16, split,
                        threads);
        for (long j = 0; j < K; j++) {
            float *q = qkv + j * qkv_rows, *k = q + H * d, *v = k + Hkv * d;
            const void *cj = (const char *)cos + j * rot, *sj = (const char *)sin + j * rot;
            if (w->q_norm) {
                for (long i = 0; i < H; i++) rms_norm(q + i * d, w->q_norm, q + i * d, d, m->eps, bf16);
                for (long i = 0; i < Hkv; i++) rms_norm(k + i * d, w->k_norm, k + i * d, d, m->eps, bf16);
            }
            for (long i = 0; i < H; i++) rope(q + i * d, cj, sj, d, bf16);
            for (long i = 0; i < Hkv; i++) {
                rope(k + i * d, cj, sj, d, bf16);
                for (long e = 0; e < d; e++) {
                    put(keys[j][l], (i * capacity[j] + slots[j]) * d + e, k[i * d + e], bf16);
                    put(values[j][l], (i * capacity[j] + slots[j]) * d + e, v[i * d + e], bf16);
                }
            }
            memcpy(q32 + j * H * d, q, sizeof(float) * H * d); /* the kernel scales the scores */
        }
        for (long j = 0, run; j < K; j += run) { /* runs of one cache's consecutive slots: one attention pass */
            for (run = 1; j + run < K && keys[j + run] == keys[j] && slots[j + run] == slots[j] + run; run++) {}
            const float *qj = q32 + j * H * d;
            if (bf16)
                decode_attention_bf16_queries(qj, keys[j][l], values[j][l], capacity[j], Hkv, G, d, slots[j] + 1,
                                              (int)run, (float)m->scale, att + j * H * d, part, threads);
            else
                decode_attention_f32_queries(qj, keys[j][l], values[j][l], capacity[j], Hkv, G, d, slots[j] + 1,
                                             (int)run, (float)m->scale, att + j * H * d, part, threads);
        }
        for (long i = 0; i < K * H * d; i++) att[i] = rnd(att[i], bf16);
        weights_product(w->o, q8 ? &q8[l].o : NULL, bits, att, NULL, h, D, H * d, K, bf16, split, threads);
        for (long i = 0; i < K * D; i++) x[i] = rnd(x[i] + h[i], bf16);
        for (long j = 0; j < K; j++) rms_norm(x + j * D, w->norm_post, h + j * D, D, m->eps, bf16);
        weights_product(w->gate_up, q8 ? &q8[l].gate_up : NULL, bits, h, NULL, gu, 2 * F, D, K, bf16, split, threads);
        for (long j = 0; j < K; j++)
            for (long i = 0; i < F; i++) {
                float g = gu[j * 2 * F + i];
                act[j * F + i] = rnd(rnd(g / (1.0f + expf(-g)), bf16) * gu[j * 2 * F + F + i], bf16);
            }
        weights_product(w->down, q8 ? &q8[l].down : NULL, bits, act, NULL, h, D, F, K, bf16, split, threads);
        for (long i = 0; i < K * D; i++) x[i] = rnd(x[i] + h[i], bf16);
    }
    for (long j = 0; j < K; j++) rms_norm(x + j * D, m->norm, h + j * D, D, m->eps, bf16);
    weights_product(m->lm_head, q8 ? &m->int8_head : NULL, bits, h, NULL, logits, m->vocab, D, K, bf16, split, threads);
    free(x);
    return 0;
}

/* decode_rows for K consecutive tokens of one cache (a token and its drafts) from slot `slot` */
int decode_steps(const struct step_model *m, void *const *keys, void *const *values, long capacity,
                 const long *tokens, long K, const void *cos, const void *sin, long slot, float *logits, int threads) {
    if (K < 1 || K > MAX_TOKENS) return -2;
    void *const *k[MAX_TOKENS], *const *v[MAX_TOKENS];
    long capacities[MAX_TOKENS], slots[MAX_TOKENS];
    for (long j = 0; j < K; j++) k[j] = keys, v[j] = values, capacities[j] = capacity, slots[j] = slot + j;
    return decode_rows(m, k, v, capacities, tokens, K, cos, sin, slots, logits, threads);
}
