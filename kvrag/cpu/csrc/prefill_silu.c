/* A gated MLP's SiLU(gate) * up over many bfloat16 tokens in one pass, on CPUs with AVX512-BF16: kvrag.cpu.cbf16
 * builds this with the prefill attention, and kvrag.cpu.mlp calls it between a bfloat16 prefill's gate and up
 * projections and its down projection.
 *
 * transformers runs two torch operations here, SiLU over the gate and the product with up, each a pass through
 * memory with its own dispatch. Here each element is read once and written once, with torch's roundings: SiLU in
 * float32, gate / (1 + exp(-gate)), rounded to bfloat16, then the product with up (exact in float32) rounded again.
 * torch's exp is SLEEF's and this one is a polynomial of its own, both within about an ulp of float32, so an
 * output can differ from torch's by one bfloat16 step where the two land on either side of a rounding boundary.
 *
 * gate, up, out [rows][cols], rows ldg, ldu, ldo elements apart.
 */
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

/* exp(x) in float32 to about an ulp: 2^n e^r with r = x - n ln 2 in two parts and e^r = 1 + r + r^2 P(r), P of
 * degree 5 (Cephes' expf). Held in [-104, 89] first: below, exp is 0; above, the scaling makes it infinite, as
 * torch's does, and SiLU's quotient then is -0 as torch's is. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

int prefill_silu_mul_bf16(const uint16_t *gate, long ldg, const uint16_t *up, long ldu, uint16_t *out, long ldo,
                          long rows, long cols, int threads) {
    if (rows < 1 || cols < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < rows; r++) {
        const uint16_t *g = gate + r * ldg, *u = up + r * ldu;
        uint16_t *o = out + r * ldo;
        for (long i = 0; i < cols; i += 16) {
            const __mmask16 live = cols - i >= 16 ? 0xffff : (__mmask16)((1u << (cols - i)) - 1);
            const __m512 x = load16(g + i, live);
            /* a true division (with -ffast-math a plain one becomes a reciprocal estimate, NaN at an infinite exp) */
            const __m512 silu = _mm512_div_round_ps(
                x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512 a = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(silu));
            _mm256_mask_storeu_epi16(o + i, live, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a, load16(u + i, live))));
        }
    }
    return 0;
}

#else

int prefill_silu_mul_bf16(const uint16_t *gate, long ldg, const uint16_t *up, long ldu, uint16_t *out, long ldo,
                          long rows, long cols, int threads) {
    return -1;
}

#endif
