/* What the bfloat16 prefill kernels share (AVX512-BF16): up to 16 bfloat16 values as float32 lanes, exactly. */
#ifndef KVRAG_BF16_H
#define KVRAG_BF16_H

#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

/* p's first 16 values where `live` is set (zeros elsewhere), each bfloat16 widened to the float32 it is */
static inline __m512 load16(const uint16_t *p, __mmask16 live) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}

#endif
#endif
