/* transformers' RMSNorm over many bfloat16 tokens in one pass, on CPUs with AVX512-BF16: kvrag.cpu.cbf16 builds
 * this with the prefill attention, and kvrag.cpu.norm calls it for a bfloat16 prefill's norms on CPU.
 *
 * The module computes x in float32, x * rsqrt(mean(x^2) + eps), rounds that to bfloat16, multiplies by the weight
 * and rounds again: five or six torch operations over the whole [tokens, dim] tensor, each a pass through memory
 * with its own dispatch. Here a token's row is read once and written once, with the same roundings; the mean's
 * sum runs in float32 in another order than torch's, so an output can differ from the module's by one bfloat16
 * step where the two sums straddle a rounding boundary.
 */
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

/* out [rows][dim] (rows ldo apart) = RMSNorm(x [rows][dim], rows ldx apart) with weight w [dim]; 0, or -1. */
int prefill_rms_norm_bf16(const uint16_t *x, long ldx, const uint16_t *w, uint16_t *out, long ldo, long rows,
                          long dim, float eps, int threads) {
    if (rows < 1 || dim < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * ldx;
        uint16_t *o = out + r * ldo;
        __m512 acc = _mm512_setzero_ps();
        for (long i = 0; i < dim; i += 16) {
            __mmask16 live = dim - i >= 16 ? 0xffff : (__mmask16)((1u << (dim - i)) - 1);
            __m512 v = load16(xr + i, live);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        /* mean, + eps, sqrt and 1 / as torch's float32 ops round them (scalar instructions, which -ffast-math
         * leaves as they are: no reciprocal in place of the division) */
        __m128 mean = _mm_div_ss(_mm_set_ss(_mm512_reduce_add_ps(acc)), _mm_set_ss((float)dim));
        __m128 inv = _mm_div_ss(_mm_set_ss(1.0f), _mm_sqrt_ss(_mm_add_ss(mean, _mm_set_ss(eps))));
        __m512 scale = _mm512_broadcastss_ps(inv);
        for (long i = 0; i < dim; i += 16) {
            __mmask16 live = dim - i >= 16 ? 0xffff : (__mmask16)((1u << (dim - i)) - 1);
            __m256bh normed = _mm512_cvtneps_pbh(_mm512_mul_ps(load16(xr + i, live), scale));
            __m512 n32 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)normed), 16));
            __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(load16(w + i, live), n32));
            _mm256_mask_storeu_epi16(o + i, live, (__m256i)y);
        }
    }
    return 0;
}

#else

int prefill_rms_norm_bf16(const uint16_t *x, long ldx, const uint16_t *w, uint16_t *out, long ldo, long rows,
                          long dim, float eps, int threads) {
    return -1;
}

#endif
