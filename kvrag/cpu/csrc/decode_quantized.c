/* A decode step's products over int8 or int4 weights (kvrag.cpu.cstep quantizes them; decode_step.c calls these).
 *
 * int8 (`product_int8`): each
 * weight row holds int8 values in groups of INT8_GROUP, each group with its own float32 scale (symmetric: the
 * group's largest magnitude is 127), so a step streams a byte a weight (and 8 bytes each 64) where bfloat16
 * streams two. A decode step is bound by how fast the weights are read, so the step's time falls with its bytes,
 * provided the arithmetic keeps up: widening int8 weights to float32 takes three vector instructions each 16
 * weights and left a 0.5B model's step bound by them (38 ms against 50 in bfloat16, where the bytes alone would
 * give 26). So the inputs are quantized too, per group of INT8_GROUP (their largest magnitude 127, as llama.cpp's
 * Q8 activations), and a group's 64 products are one integer dot product (AVX512-VNNI's vpdpbusd: unsigned
 * bytes times signed bytes, summed exactly in 32-bit lanes): the input is shifted by 128 to be unsigned, and the
 * shift's share, 128 times the group's weight sum times the scales, is subtracted once a row (`offsets`).
 *
 * int4 (`product_int4`): each group of 64 weights of a row holds 4-bit values u (0 to 15) with a float16 scale s
 * and minimum m (asymmetric: w = s u + m, u rounded to the nearest of 16 levels from the group's least to its
 * largest weight), two to a byte (a 128-weight stretch's byte i holds weights i and 64 + i), so a step streams
 * 0.56 bytes a weight. The inputs are quantized as for int8, but signed (no shift), and a group's sum is
 * s (xs sum u xq) + m (xs sum xq): the unsigned 4-bit values times the signed inputs are again one vpdpbusd, and
 * the minimum's share is the input group's sum, taken once an input.
 *
 * Each input's sums run as they would alone (K only sets how many share a pass over the weights), so a step of K
 * tokens gives, bit for bit, what K steps of one give. Built where the CPU has AVX512-VNNI and AVX512-BW. Where it
 * has AVX2 alone (with FMA and F16C), int4 is built on AVX2's byte products instead: vpmaddubsw multiplies the
 * unsigned 4-bit values by the signed inputs and adds pairs into 16 bits (at most 2 x 15 x 127, never saturated)
 * and vpmaddwd adds those pairs into 32-bit lanes, the sums of four that vpdpbusd gives. int8's shifted inputs
 * (up to 255 x 127 a product) would saturate vpmaddubsw, so there int8 takes its inputs signed, as llama.cpp's AVX2
 * path does: the inputs' magnitudes (unsigned, at most 127) times the weights with the inputs' signs, at most
 * 2 x 127 x 127 a pair, never saturated, and no shift to take back (`offsets` unread). Elsewhere both are 0 and the
 * step reads the model's own weights.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vectors.h"

#define INT8_GROUP 64
#ifndef AHEAD
#define AHEAD 2048
#endif

/* K rows of C inputs quantized per group of INT8_GROUP: xq = round(x / s) + shift (s the group's largest magnitude
 * over 127; stored as bytes, the shift 128 making them unsigned for vpdpbusd's first operand), xs[j][g] = s, and
 * where xsum is given, xsum[j][g] = s times the group's sum of the unshifted values */
static __attribute__((unused)) void quantize_inputs(const float *x, long K, long C, int shift, int8_t *xq, float *xs,
                                                   float *xsum) {
    const long groups = C / INT8_GROUP;
    for (long j = 0; j < K; j++)
        for (long g = 0; g < groups; g++) {
            const float *from = x + j * C + g * INT8_GROUP;
            float top = 0;
            for (int i = 0; i < INT8_GROUP; i++) top = fmaxf(top, fabsf(from[i]));
            float s = top > 0 ? top / 127.0f : 1.0f, inv = 1.0f / s;
            long total = 0;
            for (int i = 0; i < INT8_GROUP; i++) {
                long q = lrintf(from[i] * inv);
                xq[j * C + g * INT8_GROUP + i] = (int8_t)(uint8_t)(q + shift);
                total += q;
            }
            xs[j * groups + g] = s;
            if (xsum) xsum[j * groups + g] = s * (float)total;
        }
}

#define MAX_GROUPS 512 /* a row of up to 32,768 weights */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#define INPUT_SHIFT 128 /* int8's inputs made unsigned for vpdpbusd's first operand */

/* One group's dot product for input j (its 64 bytes at xq), as float32 lanes times the two scales, added to acc */
#define GROUP_DOT(K, acc, wv, xq, g, wscale)                                                                    \
    for (int j = 0; j < K; j++) {                                                                               \
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(xq + j * C + (g) * 64), wv);  \
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps((wscale) * xs[j * groups + (g)]), acc[j]); \
    }

/* sums[j][r] = sum_g scale[r, g] xs[j, g] (sum_{i in g} w[r, i] (xq[j, i] - 128)); offsets[r, g] = 128 scale[r, g]
 * times the group's weight sum */
#define PRODUCT_I8(K)                                                                                           \
    static void product_i8_##K(const int8_t *w, const float *scales, const float *offsets, const int8_t *xq,    \
                               const float *xs, float *sums, long R, long C, int threads) {                     \
        const long groups = C / INT8_GROUP;                                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long r = 0; r < R; r++) {                                                                          \
            const int8_t *row = w + r * C;                                                                      \
            const float *scale = scales + r * groups, *offset = offsets + r * groups;                           \
            __m512 a0[K], a1[K];                                                                                \
            for (int j = 0; j < K; j++) a0[j] = a1[j] = _mm512_setzero_ps();                                    \
            long g = 0;                                                                                         \
            for (; g + 1 < groups; g += 2) {                                                                    \
                const int8_t *p = row + g * INT8_GROUP;                                                         \
                __builtin_prefetch(p + AHEAD, 0, 3);                                                            \
                __m512i w0 = _mm512_loadu_si512(p), w1 = _mm512_loadu_si512(p + INT8_GROUP);                    \
                GROUP_DOT(K, a0, w0, xq, g, scale[g])                                                           \
                GROUP_DOT(K, a1, w1, xq, g + 1, scale[g + 1])                                                   \
            }                                                                                                   \
            if (g < groups) {                                                                                   \
                __m512i w0 = _mm512_loadu_si512(row + g * INT8_GROUP);                                          \
                GROUP_DOT(K, a0, w0, xq, g, scale[g])                                                           \
            }                                                                                                   \
            for (int j = 0; j < K; j++) {                                                                       \
                float shift = 0;                                                                                \
                for (long h = 0; h < groups; h++) shift += offset[h] * xs[j * groups + h];                      \
                sums[j * R + r] = lanes_sum((v16)_mm512_add_ps(a0[j], a1[j])) - shift;                          \
            }                                                                                                   \
        }                                                                                                       \
    }

PRODUCT_I8(1) PRODUCT_I8(2) PRODUCT_I8(3) PRODUCT_I8(4) PRODUCT_I8(5) PRODUCT_I8(6) PRODUCT_I8(7) PRODUCT_I8(8)

/* One 128-weight stretch for input j: its low nibbles (weights 0..63) and high nibbles (64..127), each 64 a
 * group with its own combined scale */
#define STRETCH_DOT(K, lo, hi, b)                                                                               \
    for (int j = 0; j < K; j++) {                                                                               \
        const int8_t *xj = xq + j * C + (b) * 128;                                                              \
        __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xj));                   \
        __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(xj + 64));              \
        const float *xsj = xs + j * groups + 2 * (b);                                                           \
        a0[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_set1_ps(scale[2 * (b)] * xsj[0]), a0[j]);         \
        a1[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_set1_ps(scale[2 * (b) + 1] * xsj[1]), a1[j]);     \
    }

/* sums[j][r] = sum_g s[r, g] xs[j, g] (sum_{i in g} u[r, i] xq[j, i]) + m[r, g] xsum[j, g] */
#define PRODUCT_I4(K)                                                                                           \
    static void product_i4_##K(const uint8_t *w, const uint16_t *scales16, const uint16_t *mins16,             \
                               const int8_t *xq, const float *xs, const float *xsum, float *sums, long R,       \
                               long C, int threads) {                                                           \
        const long groups = C / INT8_GROUP, stretches = C / 128;                                                \
        const __m512i low = _mm512_set1_epi8(0x0f);                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long r = 0; r < R; r++) {                                                                          \
            const uint8_t *row = w + r * (C / 2);                                                               \
            float scale[MAX_GROUPS], least[MAX_GROUPS];                                                         \
            halves_to_floats(scales16 + r * groups, scale, groups);                                             \
            halves_to_floats(mins16 + r * groups, least, groups);                                               \
            __m512 a0[K], a1[K];                                                                                \
            for (int j = 0; j < K; j++) a0[j] = a1[j] = _mm512_setzero_ps();                                    \
            for (long b = 0; b < stretches; b++) {                                                              \
                __builtin_prefetch(row + b * 64 + AHEAD, 0, 3);                                                 \
                __m512i v = _mm512_loadu_si512(row + b * 64);                                                   \
                __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);     \
                STRETCH_DOT(K, lo, hi, b)                                                                       \
            }                                                                                                   \
            for (int j = 0; j < K; j++) {                                                                       \
                float shift = 0;                                                                                \
                for (long g = 0; g < groups; g++) shift += least[g] * xsum[j * groups + g];                     \
                sums[j * R + r] = lanes_sum((v16)_mm512_add_ps(a0[j], a1[j])) + shift;                          \
            }                                                                                                   \
        }                                                                                                       \
    }

static inline void halves_to_floats(const uint16_t *from, float *to, long n) {
    long i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(to + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(from + i))));
    if (i < n) {
        __mmask16 live = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(to + i, live, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, from + i)));
    }
}

PRODUCT_I4(1) PRODUCT_I4(2) PRODUCT_I4(3) PRODUCT_I4(4) PRODUCT_I4(5) PRODUCT_I4(6) PRODUCT_I4(7) PRODUCT_I4(8)

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define INPUT_SHIFT 0 /* int8's inputs stay signed: their magnitudes times the weights with their signs */

static inline void halves_to_floats(const uint16_t *from, float *to, long n) {
    long i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(from + i))));
    for (; i < n; i++) to[i] = _cvtsh_ss(from[i]);
}

/* an 8-lane vector's lanes summed as a fixed tree (as lanes_sum does for 16) */
static inline float lanes_sum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

/* 32 signed weights times 32 signed inputs, summed four at a time into 8 exact 32-bit lanes: |x| times w with x's
 * sign (vpsignb), each pair at most 2 x 127 x 127 in 16 bits */
static inline __m256i signed_dot4(__m256i w, __m256i x, __m256i ones) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x)), ones);
}

/* One group's 64 products for input j, as float32 lanes times the two scales, added to acc */
#define GROUP_DOT2(K, acc, w0, w1, g, wscale)                                                                   \
    for (int j = 0; j < K; j++) {                                                                               \
        const int8_t *xj = xq + j * C + (g) * INT8_GROUP;                                                       \
        __m256i d = _mm256_add_epi32(signed_dot4(w0, _mm256_loadu_si256((const __m256i *)xj), ones),            \
                                     signed_dot4(w1, _mm256_loadu_si256((const __m256i *)(xj + 32)), ones));    \
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps((wscale) * xs[j * groups + (g)]), acc[j]); \
    }

/* sums[j][r] = sum_g scale[r, g] xs[j, g] (sum_{i in g} w[r, i] xq[j, i]), the inputs signed (offsets unread) */
#define PRODUCT_I8(K)                                                                                           \
    static void product_i8_##K(const int8_t *w, const float *scales, const float *offsets, const int8_t *xq,    \
                               const float *xs, float *sums, long R, long C, int threads) {                     \
        const long groups = C / INT8_GROUP;                                                                     \
        (void)offsets;                                                                                          \
        const __m256i ones = _mm256_set1_epi16(1);                                                              \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long r = 0; r < R; r++) {                                                                          \
            const int8_t *row = w + r * C;                                                                      \
            const float *scale = scales + r * groups;                                                           \
            __m256 a0[K], a1[K];                                                                                \
            for (int j = 0; j < K; j++) a0[j] = a1[j] = _mm256_setzero_ps();                                    \
            long g = 0;                                                                                         \
            for (; g + 1 < groups; g += 2) {                                                                    \
                const int8_t *p = row + g * INT8_GROUP;                                                         \
                __builtin_prefetch(p + AHEAD, 0, 3);                                                            \
                __m256i w0 = _mm256_loadu_si256((const __m256i *)p);                                            \
                __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 32));                                     \
                __m256i w2 = _mm256_loadu_si256((const __m256i *)(p + 64));                                     \
                __m256i w3 = _mm256_loadu_si256((const __m256i *)(p + 96));                                     \
                GROUP_DOT2(K, a0, w0, w1, g, scale[g])                                                          \
                GROUP_DOT2(K, a1, w2, w3, g + 1, scale[g + 1])                                                  \
            }                                                                                                   \
            if (g < groups) {                                                                                   \
                const int8_t *p = row + g * INT8_GROUP;                                                         \
                __m256i w0 = _mm256_loadu_si256((const __m256i *)p);                                            \
                __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 32));                                     \
                GROUP_DOT2(K, a0, w0, w1, g, scale[g])                                                          \
            }                                                                                                   \
            for (int j = 0; j < K; j++) sums[j * R + r] = lanes_sum8(_mm256_add_ps(a0[j], a1[j]));              \
        }                                                                                                       \
    }

PRODUCT_I8(1) PRODUCT_I8(2) PRODUCT_I8(3) PRODUCT_I8(4) PRODUCT_I8(5) PRODUCT_I8(6) PRODUCT_I8(7) PRODUCT_I8(8)

/* 32 unsigned 4-bit values u times 32 signed inputs, summed four at a time into 8 exact 32-bit lanes (what
 * vpdpbusd gives for 16 lanes) */
static inline __m256i dot4(__m256i u, __m256i x, __m256i ones) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
}

/* One 128-weight stretch for input j: its 64 bytes' low nibbles are weights 0..63 (group 2b), its high ones
 * 64..127 (group 2b + 1), each 32 a half-vector */
#define STRETCH_DOT2(K, lo0, lo1, hi0, hi1, b)                                                                  \
    for (int j = 0; j < K; j++) {                                                                               \
        const int8_t *xj = xq + j * C + (b) * 128;                                                              \
        __m256i d0 = _mm256_add_epi32(dot4(lo0, _mm256_loadu_si256((const __m256i *)xj), ones),                 \
                                      dot4(lo1, _mm256_loadu_si256((const __m256i *)(xj + 32)), ones));         \
        __m256i d1 = _mm256_add_epi32(dot4(hi0, _mm256_loadu_si256((const __m256i *)(xj + 64)), ones),          \
                                      dot4(hi1, _mm256_loadu_si256((const __m256i *)(xj + 96)), ones));         \
        const float *xsj = xs + j * groups + 2 * (b);                                                           \
        a0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(scale[2 * (b)] * xsj[0]), a0[j]);         \
        a1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(scale[2 * (b) + 1] * xsj[1]), a1[j]);     \
    }

#define PRODUCT_I4(K)                                                                                           \
    static void product_i4_##K(const uint8_t *w, const uint16_t *scales16, const uint16_t *mins16,             \
                               const int8_t *xq, const float *xs, const float *xsum, float *sums, long R,       \
                               long C, int threads) {                                                           \
        const long groups = C / INT8_GROUP, stretches = C / 128;                                                \
        const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);                                \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long r = 0; r < R; r++) {                                                                          \
            const uint8_t *row = w + r * (C / 2);                                                               \
            float scale[MAX_GROUPS], least[MAX_GROUPS];                                                         \
            halves_to_floats(scales16 + r * groups, scale, groups);                                             \
            halves_to_floats(mins16 + r * groups, least, groups);                                               \
            __m256 a0[K], a1[K];                                                                                \
            for (int j = 0; j < K; j++) a0[j] = a1[j] = _mm256_setzero_ps();                                    \
            for (long b = 0; b < stretches; b++) {                                                              \
                __builtin_prefetch(row + b * 64 + AHEAD, 0, 3);                                                 \
                __m256i v0 = _mm256_loadu_si256((const __m256i *)(row + b * 64));                               \
                __m256i v1 = _mm256_loadu_si256((const __m256i *)(row + b * 64 + 32));                          \
                __m256i lo0 = _mm256_and_si256(v0, low), lo1 = _mm256_and_si256(v1, low);                       \
                __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);                                  \
                __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);                                  \
                STRETCH_DOT2(K, lo0, lo1, hi0, hi1, b)                                                          \
            }                                                                                                   \
            for (int j = 0; j < K; j++) {                                                                       \
                float shift = 0;                                                                                \
                for (long g = 0; g < groups; g++) shift += least[g] * xsum[j * groups + g];                     \
                sums[j * R + r] = lanes_sum8(_mm256_add_ps(a0[j], a1[j])) + shift;                              \
            }                                                                                                   \
        }                                                                                                       \
    }

PRODUCT_I4(1) PRODUCT_I4(2) PRODUCT_I4(3) PRODUCT_I4(4) PRODUCT_I4(5) PRODUCT_I4(6) PRODUCT_I4(7) PRODUCT_I4(8)

#endif

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
int int8_available(void) { return 1; }
int int4_available(void) { return 1; }

/* sums[j] = w x[j] (unrounded, no bias) for j < K (1 to 8); w: [R, C] int8 with scales and offsets
 * [R, C / INT8_GROUP]; C a multiple of INT8_GROUP; x: K rows of C float32; scratch: K * C floats. 0, or -2 for a K
 * or C it does not take. */
int product_int8(const int8_t *w, const float *scales, const float *offsets, const float *x, float *sums, long R,
                 long C, int K, float *scratch, int threads) {
    if (C % INT8_GROUP || K < 1 || K > 8) return -2;
    int8_t *xq = (int8_t *)scratch;    /* K * C bytes */
    float *xs = scratch + K * C / 4;   /* K * groups floats: fits in the K * C floats (groups <= C / 64) */
    quantize_inputs(x, K, C, INPUT_SHIFT, xq, xs, NULL);
    switch (K) {
    case 1: product_i8_1(w, scales, offsets, xq, xs, sums, R, C, threads); break;
    case 2: product_i8_2(w, scales, offsets, xq, xs, sums, R, C, threads); break;
    case 3: product_i8_3(w, scales, offsets, xq, xs, sums, R, C, threads); break;
    case 4: product_i8_4(w, scales, offsets, xq, xs, sums, R, C, threads); break;
    case 5: product_i8_5(w, scales, offsets, xq, xs, sums, R, C, threads); break;
    case 6: product_i8_6(w, scales, offsets, xq, xs, sums, R, C, threads); break;
    case 7: product_i8_7(w, scales, offsets, xq, xs, sums, R, C, threads); break;
    default: product_i8_8(w, scales, offsets, xq, xs, sums, R, C, threads); break;
    }
    return 0;
}

/* sums[j] = w x[j] (unrounded, no bias) for j < K (1 to 8); w: [R, C / 2] packed 4-bit values with float16 scales and
 * minimums [R, C / INT8_GROUP]; C a multiple of 128 and at most 64 * MAX_GROUPS; x: K rows of C float32; scratch:
 * K * C floats. 0, or -2 for a K or C it does not take. */
int product_int4(const uint8_t *w, const uint16_t *scales, const uint16_t *mins, const float *x, float *sums, long R,
                 long C, int K, float *scratch, int threads) {
    if (C % 128 || C > INT8_GROUP * MAX_GROUPS || K < 1 || K > 8) return -2;
    const long groups = C / INT8_GROUP;
    int8_t *xq = (int8_t *)scratch;          /* K * C bytes */
    float *xs = scratch + K * C / 4;         /* K * groups floats */
    float *xsum = xs + K * groups;           /* K * groups floats: K * C / 4 + 2 K C / 64 <= K * C */
    quantize_inputs(x, K, C, 0, xq, xs, xsum);
    switch (K) {
    case 1: product_i4_1(w, scales, mins, xq, xs, xsum, sums, R, C, threads); break;
    case 2: product_i4_2(w, scales, mins, xq, xs, xsum, sums, R, C, threads); break;
    case 3: product_i4_3(w, scales, mins, xq, xs, xsum, sums, R, C, threads); break;
    case 4: product_i4_4(w, scales, mins, xq, xs, xsum, sums, R, C, threads); break;
    case 5: product_i4_5(w, scales, mins, xq, xs, xsum, sums, R, C, threads); break;
    case 6: product_i4_6(w, scales, mins, xq, xs, xsum, sums, R, C, threads); break;
    case 7: product_i4_7(w, scales, mins, xq, xs, xsum, sums, R, C, threads); break;
    default: product_i4_8(w, scales, mins, xq, xs, xsum, sums, R, C, threads); break;
    }
    return 0;
}

#else

int int8_available(void) { return 0; }
int int4_available(void) { return 0; }

int product_int8(const int8_t *w, const float *scales, const float *offsets, const float *x, float *sums, long R,
                 long C, int K, float *scratch, int threads) {
    (void)w, (void)scales, (void)offsets, (void)x, (void)sums, (void)R, (void)C, (void)K, (void)scratch, (void)threads;
    return -2;
}

int product_int4(const uint8_t *w, const uint16_t *scales, const uint16_t *mins, const float *x, float *sums, long R,
                 long C, int K, float *scratch, int threads) {
    (void)w, (void)scales, (void)mins, (void)x, (void)sums, (void)R, (void)C, (void)K, (void)scratch, (void)threads;
    return -2;
}

#endif
