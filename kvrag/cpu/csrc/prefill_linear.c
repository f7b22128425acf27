/* A bfloat16 linear layer over many tokens, out = x w^T + bias, on CPUs with AVX512-BF16: kvrag.cpu.cbf16 builds
 * this with the prefill attention, and kvrag.cpu.linear calls it for a bfloat16 prefill's linear layers on CPU.
 *
 * Inside a `target_recompute` forward (175 tokens by weights of 576 or 1,536 inputs), torch's bfloat16 matmul ran
 * at 226-249 GFLOP/s on 2 threads, against 410-420 for the CPU's bfloat16 dot-product instruction in a register
 * loop (docs/performance.md). Here:
 *
 * - The product is computed transposed, out^T = w x^T: a weight row's two adjacent elements are one 32-bit word
 *   broadcast to every lane, and the tokens run across the lanes, so the weights are read as they are stored
 *   (nothing packed at load, no second copy) and no lane is ever summed with another.
 * - x is laid out once a call as words (pairs of adjacent elements) with 16 tokens a vector, in panels of 48
 *   tokens (the tokens past the last padded with zeros), 16 x 16 blocks of words transposed in registers. A task
 *   is 8 weight rows: for every panel, 8 x 3 accumulators take each word pair of the 8 rows in turn; the 8 rows'
 *   words stay in L1, and the panels are walked in blocks that stay in L2 while every task passes over them.
 * - A task prefetches the next task's rows (the next 8 rows of the weight, a thread's next task), a line a row
 *   each time its own rows reach a new line: a forward's weights come from memory (they are several times the
 *   L3), and with few tokens a task computes too little on each line for the hardware's prefetch to keep up.
 *   In a forward's 210 products, 30 tokens ran in 9.5 ms instead of 14.7 (the floor at the matmul rate: 7.0).
 * - Every output is the same sum in the same order whatever the number of tokens and wherever a token sits in
 *   them: a token's outputs are bitwise the same alone or among any others.
 * - Sums are in float32 (the bias added last), rounded once to bfloat16, as torch's bfloat16 linear rounds.
 * - The 8 rows' outputs for 16 tokens are rounded, interleaved into words and transposed in registers, so each
 *   token's 8 outputs are one 16-byte store.
 */
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

#define NR 8      /* weight rows a task */
#define NZ 3      /* vectors of 16 tokens a panel */
#define MP (NZ * 16)
#define L2_BYTES (512 * 1024) /* laid-out tokens a block: half of a core's L2 here */

static inline long min_l(long a, long b) { return a < b ? a : b; }

/* Tokens m0 + i0 .. m0 + i0 + 15 of x (`live` of them real, zeros after), words k0 .. k1 - 1, into a panel laid out
 * as words [K/2][width]: 16 x 16 blocks transposed in registers. */
static void pack_rows(const uint16_t *x, long ldx, long m0, long i0, long live, long width, long k0, long k1,
                      uint32_t *dst) {
    for (long kk = k0; kk < k1; kk += 16) {
        long cols = min_l(16, k1 - kk);
        __mmask16 load = (__mmask16)((1u << cols) - 1);
        __m512i r[16];
        for (int l = 0; l < 16; l++)
            r[l] = l < live ? _mm512_maskz_loadu_epi32(load, x + (m0 + i0 + l) * ldx + 2 * kk) : _mm512_setzero_si512();
        transpose16(r);
        for (int c = 0; c < cols; c++) _mm512_storeu_si512(dst + (kk + c) * width + i0, r[c]);
    }
}

/* 8 rows w[r] (words, K/2 each, rows apart `stride` words) times a panel of nz vectors: acc[r][j] lane i is row r
 * on token 16 j + i. */
#define TASK(NZV)                                                                                             \
    static inline void task_##NZV(const uint32_t *a, const uint32_t *w, long stride, long half,             \
                                  __m512 acc[NR][NZ]) {                                                     \
        for (int r = 0; r < NR; r++)                                                                        \
            for (int j = 0; j < NZV; j++) acc[r][j] = _mm512_setzero_ps();                                  \
        for (long kk = 0; kk < half; kk++) {                                                                \
            if ((kk & 15) == 0) /* the next task's rows, a line each as this task's reach a new line */     \
                for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(w + (r + NR) * stride + kk), _MM_HINT_T0); \
            __m512bh av[NZV];                                                                               \
            for (int j = 0; j < NZV; j++) av[j] = (__m512bh)_mm512_loadu_si512(a + kk * (NZV * 16) + j * 16); \
            for (int r = 0; r < NR; r++) {                                                                  \
                __m512bh b = (__m512bh)_mm512_set1_epi32((int)w[r * stride + kk]);                          \
                for (int j = 0; j < NZV; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av[j], b);            \
            }                                                                                               \
        }                                                                                                   \
    }
TASK(1)
TASK(2)
TASK(3)

/* Round rows r (plus bias) to bfloat16 and store 16 tokens' 8 outputs each: out[(m0 + i) ldo + n0 + r]. */
static inline void store8(__m512 acc[NR][NZ], int j, const float *bias, long n0, uint16_t *out, long ldo, long m0,
                          long live) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i p[4];
    for (int q = 0; q < 4; q++) {
        __m512 lo = acc[2 * q][j], hi = acc[2 * q + 1][j];
        if (bias) {
            lo = _mm512_add_ps(lo, _mm512_set1_ps(bias[n0 + 2 * q]));
            hi = _mm512_add_ps(hi, _mm512_set1_ps(bias[n0 + 2 * q + 1]));
        }
        __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(lo)),
                                          (__m256i)_mm512_cvtneps_pbh(hi), 1);
        p[q] = _mm512_permutexvar_epi16(interleave, both); /* word i: rows 2q, 2q + 1 on token i */
    }
    __m512i t0 = _mm512_unpacklo_epi32(p[0], p[1]), t1 = _mm512_unpackhi_epi32(p[0], p[1]);
    __m512i t2 = _mm512_unpacklo_epi32(p[2], p[3]), t3 = _mm512_unpackhi_epi32(p[2], p[3]);
    __m512i r[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3),
                    _mm512_unpackhi_epi64(t1, t3)};
    /* r[c] 128-bit lane L: token 4 L + c's 8 outputs */
    __m128i lanes[16];
    for (int c = 0; c < 4; c++) {
        lanes[c] = _mm512_castsi512_si128(r[c]);
        lanes[4 + c] = _mm512_extracti32x4_epi32(r[c], 1);
        lanes[8 + c] = _mm512_extracti32x4_epi32(r[c], 2);
        lanes[12 + c] = _mm512_extracti32x4_epi32(r[c], 3);
    }
    for (long i = 0; i < min_l(live, 16); i++) _mm_storeu_si128((__m128i *)(out + (m0 + i) * ldo + n0), lanes[i]);
}

/* The rows of a last task with fewer than 8: one output at a time. */
static inline void store_rows(__m512 acc[NR][NZ], int j, int rows, const float *bias, long n0, uint16_t *out,
                              long ldo, long m0, long live) {
    for (int r = 0; r < rows; r++) {
        __m512 v = bias ? _mm512_add_ps(acc[r][j], _mm512_set1_ps(bias[n0 + r])) : acc[r][j];
        __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
        uint16_t b[16];
        _mm256_storeu_si256((__m256i *)b, h);
        for (long i = 0; i < min_l(live, 16); i++) out[(m0 + i) * ldo + n0 + r] = b[i];
    }
}

long prefill_linear_scratch(long M, long K) { return ((M + MP - 1) / MP) * MP * (K / 2); }

/* out [M][N] (rows ldo apart) = x [M][K] (rows ldx apart) w^T (w [N][K] contiguous) + bias (float32 [N] or NULL).
 * K even. `packed`: prefill_linear_scratch(M, K) words, where x is laid out. 0, or -1 for a shape it does not take. */
int prefill_linear_bf16(const uint16_t *x, long M, long K, long ldx, const uint16_t *w, long N, const float *bias,
                        uint16_t *out, long ldo, uint32_t *packed, int threads) {
    if (M < 1 || N < 1 || K < 2 || K % 2) return -1;
    long half = K / 2, panels = (M + MP - 1) / MP, tasks = (N + NR - 1) / NR;
    {
        long groups = (M + 15) / 16, chunks = (half + 63) / 64;
#pragma omp parallel for schedule(static) collapse(2) num_threads(threads)
        for (long g = 0; g < groups; g++)
            for (long c = 0; c < chunks; c++) {
                long p = g / NZ, m0 = p * MP, i0 = (g % NZ) * 16;
                long width = (min_l(M - m0, MP) + 15) / 16 * 16;
                pack_rows(x, ldx, m0, i0, M - m0 - i0, width, c * 64, min_l((c + 1) * 64, half),
                          packed + p * MP * half);
            }
    }
    /* panels a block: the block's laid-out tokens stay in L2 while every task walks them */
    long per_block = L2_BYTES / (MP * K * 2) > 0 ? L2_BYTES / (MP * K * 2) : 1;
#pragma omp parallel num_threads(threads)
    for (long p0 = 0; p0 < panels; p0 += per_block) {
        long p1 = min_l(p0 + per_block, panels);
#pragma omp for schedule(static)
        for (long t = 0; t < tasks; t++) {
            long n0 = t * NR;
            int rows = (int)min_l(N - n0, NR);
            const uint32_t *wt = (const uint32_t *)(w + n0 * K);
            for (long p = p0; p < p1; p++) {
                long m0 = p * MP, live = min_l(M - m0, MP), nz = (live + 15) / 16;
                const uint32_t *a = packed + p * MP * half;
                __m512 acc[NR][NZ];
                if (rows == NR) {
                    if (nz == 3) task_3(a, wt, half, half, acc);
                    else if (nz == 2) task_2(a, wt, half, half, acc);
                    else task_1(a, wt, half, half, acc);
                } else {
                    /* a last task of fewer rows (N not a multiple of 8): a row at a time, the same sums */
                    for (int r = 0; r < rows; r++) {
                        __m512 one[NR][NZ];
                        if (nz == 3) task_3(a, wt + r * half, 0, half, one);
                        else if (nz == 2) task_2(a, wt + r * half, 0, half, one);
                        else task_1(a, wt + r * half, 0, half, one);
                        for (int j = 0; j < nz; j++) acc[r][j] = one[0][j];
                    }
                }
                for (int j = 0; j < nz; j++) {
                    long first = m0 + 16 * j, left = M - first;
                    if (rows == NR) store8(acc, j, bias, n0, out, ldo, first, left);
                    else store_rows(acc, j, rows, bias, n0, out, ldo, first, left);
                }
            }
        }
    }
    return 0;
}

/* One token: out [N] = x [K] w^T + bias, each output the same sum in the same order as the panels give it (one
 * float32 accumulator, the word pairs in turn on the same instruction: a token's outputs bitwise the same alone as
 * among others). The outputs run across the lanes instead of the tokens: a task is 4 x 16 rows, 16 words of each
 * row at a time transposed in registers, four independent chains. It reads the weight once, as it is stored. */
#define GR 4 /* groups of 16 rows a task */
int prefill_linear_one_bf16(const uint16_t *x, long K, const uint16_t *w, long N, const float *bias, uint16_t *out,
                            int threads) {
    if (N < 1 || K < 2 || K % 2) return -1;
    const long half = K / 2, tasks = (N + 16 * GR - 1) / (16 * GR);
    const uint32_t *xw = (const uint32_t *)x, *ww = (const uint32_t *)w;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < tasks; t++) {
        const long n0 = t * 16 * GR;
        __m512 acc[GR];
        for (int g = 0; g < GR; g++) acc[g] = _mm512_setzero_ps();
        for (long kk = 0; kk < half; kk += 16) {
            const long cols = min_l(16, half - kk);
            const __mmask16 load = (__mmask16)((1u << cols) - 1);
            for (int g = 0; g < GR; g++) {
                __m512i r[16];
                for (int l = 0; l < 16; l++) /* the same rows' next line, two steps ahead */
                    _mm_prefetch((const char *)(ww + min_l(n0 + 16 * g + l, N - 1) * half + kk + 32), _MM_HINT_T0);
                for (int l = 0; l < 16; l++) {
                    const long n = n0 + 16 * g + l;
                    r[l] = n < N ? _mm512_maskz_loadu_epi32(load, ww + n * half + kk) : _mm512_setzero_si512();
                }
                transpose16(r); /* r[c] lane l: row n0 + 16 g + l, word kk + c */
                for (long c = 0; c < cols; c++)
                    acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)r[c], (__m512bh)_mm512_set1_epi32((int)xw[kk + c]));
            }
        }
        for (int g = 0; g < GR; g++) {
            const long first = n0 + 16 * g;
            if (first >= N) break;
            const __mmask16 live = N - first >= 16 ? 0xffff : (__mmask16)((1u << (N - first)) - 1);
            __m512 v = acc[g];
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, bias + first));
            _mm256_mask_storeu_epi16(out + first, live, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
    return 0;
}

int prefill_linear_available(void) { return 1; }

#else

long prefill_linear_scratch(long M, long K) { return 0; }
int prefill_linear_bf16(const uint16_t *x, long M, long K, long ldx, const uint16_t *w, long N, const float *bias,
                        uint16_t *out, long ldo, uint32_t *packed, int threads) {
    return -1;
}
int prefill_linear_one_bf16(const uint16_t *x, long K, const uint16_t *w, long N, const float *bias, uint16_t *out,
                            int threads) {
    return -1;
}
int prefill_linear_available(void) { return 0; }

#endif
