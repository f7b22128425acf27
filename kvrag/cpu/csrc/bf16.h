/* What the bfloat16 kernels share (AVX512-BF16): up to 16 bfloat16 values as float32 lanes, exactly; a 16 x 16
 * block of 32-bit words (pairs of bfloat16) transposed in registers. */
#ifndef KVRAG_BF16_H
#define KVRAG_BF16_H

#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

/* p's first 16 values where `live` is set (zeros elsewhere), each bfloat16 widened to the float32 it is */
static inline __m512 load16(const uint16_t *p, __mmask16 live) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}

/* A 16 x 16 block of 32-bit words transposed in registers: r[c] lane l becomes what r[l] lane c was. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int c = 0; c < 4; c++) {
            t[8 * i + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
            t[8 * i + 4 + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0xdd);
        }
    for (int c = 0; c < 8; c++) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
    }
}

#endif
#endif
