/* A bfloat16 prefill's rotary embedding of its queries and keys, on CPUs with AVX512-BF16: kvrag.cpu.cbf16 builds
 * this with the prefill attention, and kvrag.cpu.rotary calls it where transformers' attention rotates.
 *
 * transformers rotates a tensor with six torch operations (two products, a negation, a concatenation, a sum),
 * each a pass over memory with its own dispatch. Here each row of D elements is read once and written once, and
 * every operation rounds where torch's does (each product and the sum to bfloat16, to nearest even, from a float32
 * result that is exact for a product of two bfloat16 numbers), so the output is bitwise torch's:
 *     out = x cos + rotate_half(x) sin,  rotate_half(x) = (-x[D/2:], x[:D/2]).
 *
 * x [B, H, n, D] with rows of D contiguous (strides sx_b, sx_h, sx_n in elements), cos and sin [B or 1, n, D]
 * (strides sc_b, sc_n; sc_b 0 for one shared by the batch), out [B, H, n, D] with strides so_b, so_h, so_n.
 * D even, at most 256.
 */
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

static inline __m512 rounded(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }

static inline void store(uint16_t *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

static void rotate(const uint16_t *x, long sx_b, long sx_h, long sx_n, const uint16_t *cos, const uint16_t *sin,
                   long sc_b, long sc_n, uint16_t *out, long so_b, long so_h, long so_n, long B, long H, long n,
                   int D, int threads) {
    const int half = D / 2;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long r = 0; r < B * H * n; r++) {
        const long b = r / (H * n), h = r / n % H, t = r % n;
        const uint16_t *xr = x + b * sx_b + h * sx_h + t * sx_n;
        const uint16_t *cr = cos + b * sc_b + t * sc_n, *sr = sin + b * sc_b + t * sc_n;
        uint16_t *o = out + b * so_b + h * so_h + t * so_n;
        for (int c = 0; c < half; c += 16) {
            const __mmask16 m = half - c >= 16 ? 0xffff : (__mmask16)((1u << (half - c)) - 1);
            const __m512 x1 = load16(xr + c, m), x2 = load16(xr + half + c, m);
            /* first half: x1 cos - x2 sin; second half: x2 cos + x1 sin (a product of -x2 is minus x2's product) */
            const __m512 a = rounded(_mm512_mul_ps(x1, load16(cr + c, m)));
            const __m512 s = rounded(_mm512_mul_ps(x2, load16(sr + c, m)));
            store(o + c, m, _mm512_sub_ps(a, s));
            const __m512 a2 = rounded(_mm512_mul_ps(x2, load16(cr + half + c, m)));
            const __m512 s2 = rounded(_mm512_mul_ps(x1, load16(sr + half + c, m)));
            store(o + half + c, m, _mm512_add_ps(a2, s2));
        }
    }
}

/* q and k rotated by the same cos and sin in one call: q [B, Hq, n, D], k [B, Hk, n, D] into qo and ko. */
int prefill_rotary_bf16(const uint16_t *q, long sq_b, long sq_h, long sq_n, const uint16_t *k, long sk_b, long sk_h,
                        long sk_n, const uint16_t *cos, const uint16_t *sin, long sc_b, long sc_n, uint16_t *qo,
                        long sqo_b, long sqo_h, long sqo_n, uint16_t *ko, long sko_b, long sko_h, long sko_n, long B,
                        long Hq, long Hk, long n, int D, int threads) {
    if (D < 2 || D % 2 || D > 256) return -1;
    rotate(q, sq_b, sq_h, sq_n, cos, sin, sc_b, sc_n, qo, sqo_b, sqo_h, sqo_n, B, Hq, n, D, threads);
    rotate(k, sk_b, sk_h, sk_n, cos, sin, sc_b, sc_n, ko, sko_b, sko_h, sko_n, B, Hk, n, D, threads);
    return 0;
}

int prefill_rotary_available(void) { return 1; }

#else

int prefill_rotary_bf16(const uint16_t *q, long sq_b, long sq_h, long sq_n, const uint16_t *k, long sk_b, long sk_h,
                        long sk_n, const uint16_t *cos, const uint16_t *sin, long sc_b, long sc_n, uint16_t *qo,
                        long sqo_b, long sqo_h, long sqo_n, uint16_t *ko, long sko_b, long sko_h, long sko_n, long B,
                        long Hq, long Hk, long n, int D, int threads) {
    return -1;
}

int prefill_rotary_available(void) { return 0; }

#endif
