/* Many query tokens' grouped-query attention over a cache, in bfloat16, on CPUs with AVX512-BF16:
 * kvrag.cpu.cbf16 builds and loads this, kvrag.cpu.attention calls it for a prefill's attention.
 *
 * torch's CPU flash attention runs bfloat16 no faster than float32 here (about 130 GFLOP/s on 2 cores either
 * way), while the CPU's bfloat16 dot-product instruction (vdpbf16ps: 16 lanes, each the sum of two products)
 * reaches about 230 GFLOP/s on one core. This kernel is flash attention built on that instruction:
 *
 * - A task is one kv head and 16 query tokens: the R = 16 G rows of its G query heads (row g 16 + i: head g,
 *   token i). It walks the keys in blocks of 64 with an online softmax, so nothing of size n x T is made.
 * - Scores are computed transposed, S^T = K Q^T: a key's two adjacent bfloat16 elements are one 32-bit word
 *   broadcast to every lane, and the queries are laid out once a task as words (pairs of adjacent elements)
 *   with the 16 tokens across the lanes. Each lane then holds one query row, so the softmax's running
 *   maxima and sums are vertical: no lane sums anywhere.
 * - Probabilities go to bfloat16 pairs of adjacent keys, values to words of two adjacent keys' elements (once a
 *   call, or a block at a time by the task that reads it where few tasks read each: pack_values), and
 *   O^T += V^T P^T runs on the same instruction.
 * - Past a task's first block, while no score passes its row's running max by more than 2^LEAD, a block's
 *   probabilities are made in its score tiles against that max as it stands (a probability may exceed 1), so
 *   the block needs no pass to find its max and no second read of its scores; else the block goes the usual
 *   way. In a 4k `target_recompute` forward this took the attention's first token 4 ms sooner (paired).
 * - Sums are in float32 (scores, softmax, the weighted values); the probabilities are rounded to bfloat16
 *   before the weighted sum, as torch's bfloat16 flash attention rounds them.
 * - A mask, boolean (true: attend) or additive with only 0 and the lowest value (as kvrag's and transformers'
 *   masks are), is read once a call into a bit a key, and a task turns its tokens' bits into one 16-bit lane
 *   mask a key (or, with `causal` and no mask, token i of n sees keys up to T - n + i); a block of 64 keys that
 *   no token of the task may see is skipped (half the work of a causal prefill). Any other additive value is
 *   refused (-2) before any attention is computed. The bits can also be given (`prefill_attention_seen_bf16`):
 *   the whole forward in C (prefill_layers.c) makes them once for every layer from the tokens' logical positions
 *   (`prefill_attention_position_bits`), where a mask would be made and read again in each layer.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

#define KB 64       /* keys a block */
#define QT 16       /* query tokens a task */
#define MAXG 8      /* query heads a kv head */
#define MAXD 128    /* head size */
#define NEG (-1.0e30f) /* a score no token may see (finite: the file is compiled with -ffast-math) */
#define LEAD 8.0f      /* how far above its row's running max (in powers of 2) a score may be taken as it is */

/* 2^x for x <= 0, float32, to about 8e-5 relative: 2^n p(r) with n = round(x), r = x - n in [-1/2, 1/2] and p the
 * degree-3 polynomial nearest 2^r in relative error. The probabilities are rounded to bfloat16 (2^-9 relative)
 * next, so a closer one would buy nothing. Any x <= 0 is taken: from -2^23 down, r is 0 and 2^n is 0 (so a key
 * no token may see, a score of NEG, gets 0). The scores stay as the dot products give them: the scale and the
 * change of base are one multiply-add with the subtraction of the max, x = s c - m c. */
static inline __m512 exp2_512(__m512 x) {
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.05508868f), _mm512_set1_ps(0.24260405f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.69327624f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.99992894f));
    return _mm512_scalef_ps(p, n);
}

static const int mask_bytes[] = {1, 1, 2, 4}; /* a mask element: none, bool, bfloat16, float32 */

/* Which of a mask row's first `len` (<= 64) keys a token may see, a bit a key. A boolean mask: true. An additive
 * one (bfloat16 or float32): 0 is seen, -1e30 or lower (the dtype's lowest, -inf) is not; any other value is a
 * bias this kernel does not add, and sets *odd (the caller then computes the attention another way). */
static inline uint64_t row_bits(const uint8_t *row, int kind, int len, int *odd) {
    __mmask64 live = len == KB ? ~0ull : ((1ull << len) - 1);
    if (kind == 1) return _mm512_mask_test_epi8_mask(live, _mm512_maskz_loadu_epi8(live, row), _mm512_set1_epi8((char)0xff));
    uint64_t bits = 0;
    if (kind == 2) { /* bfloat16, 32 a vector, on the bits: 0 is +-0; -1e30 or lower is the sign and a magnitude from
                      * 0x714a (the least bfloat16 at or above 1e30) to 0x7f80 (infinity; above it, NaN) */
        const __m512i magnitude = _mm512_set1_epi16(0x7fff), sign = _mm512_set1_epi16((short)0x8000);
        for (int c = 0; c < len; c += 32) {
            const __mmask32 part = (__mmask32)(live >> c);
            const __m512i x = _mm512_maskz_loadu_epi16(part, (const uint16_t *)row + c);
            const __m512i m = _mm512_and_si512(x, magnitude);
            const __mmask32 seen = _mm512_mask_cmpeq_epi16_mask(part, m, _mm512_setzero_si512());
            const __mmask32 hidden = _mm512_mask_test_epi16_mask(part, x, sign) &
                                     _mm512_cmpge_epu16_mask(m, _mm512_set1_epi16(0x714a)) &
                                     _mm512_cmple_epu16_mask(m, _mm512_set1_epi16(0x7f80));
            if ((__mmask32)(seen | hidden) != part) __atomic_store_n(odd, 1, __ATOMIC_RELAXED);
            bits |= (uint64_t)seen << c;
        }
        return bits;
    }
    for (int c = 0; c < len; c += 16) {
        __mmask16 part = (__mmask16)(live >> c);
        __m512 x = _mm512_maskz_loadu_ps(part, (const float *)row + c); /* float32 */
        __mmask16 seen = _mm512_mask_cmp_ps_mask(part, x, _mm512_setzero_ps(), _CMP_EQ_OQ);
        __mmask16 hidden = _mm512_mask_cmp_ps_mask(part, x, _mm512_set1_ps(-1.0e30f), _CMP_LE_OQ);
        if ((__mmask16)(seen | hidden) != part) __atomic_store_n(odd, 1, __ATOMIC_RELAXED);
        bits |= (uint64_t)seen << c;
    }
    return bits;
}

/* two float32 vectors (keys 2m and 2m + 1, rows across the lanes) as bfloat16 pairs: lane i = (a[i], b[i]) */
static inline __m512i pairs(__m512 a, __m512 b) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                           22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* A block's values as words of two adjacent keys, what the weighted sum's dot products take: vw[p * D + d] =
 * (v[2p, d], v[2p + 1, d]), zero for the keys past the block's `len` (a zero probability times a NaN is a NaN). */
static inline __attribute__((always_inline)) void pack_block(const uint16_t *vh, long sk_t, int len, int D,
                                                             uint32_t *vw) {
    /* word i of the result: (a[i], b[i]) for i < 16 (low_half) or for 16 <= i < 32 (high_half) */
    const __m512i low_half = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                              6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high_half = _mm512_add_epi16(low_half, _mm512_set1_epi16(16));
    for (int p = 0; p < KB / 2; p++) {
        const __mmask32 a_live = 2 * p < len ? ~0u : 0, b_live = 2 * p + 1 < len ? ~0u : 0;
        for (int d = 0; d < D; d += 32) {
            const __m512i a = _mm512_maskz_loadu_epi16(a_live, vh + 2 * p * sk_t + d);
            const __m512i b = _mm512_maskz_loadu_epi16(b_live, vh + (2 * p + 1) * sk_t + d);
            _mm512_storeu_si512(vw + p * D + d, _mm512_permutex2var_epi16(a, low_half, b));
            _mm512_storeu_si512(vw + p * D + d + 16, _mm512_permutex2var_epi16(a, high_half, b));
        }
    }
}

/* Every block's values packed once a call, [Hkv, ceil(T / KB) KB / 2, D] words, where many tasks read each block
 * (many query tokens); with few (a question over a cache: STREAMED) each task packs the blocks it reads on its
 * stack as it goes, and the values are read once, straight from the cache (a pass over all of them first, written
 * out and read again, took 8-9% of a question's forward over 8,000 cached tokens; with 200 query tokens, 13 tasks
 * a kv head packing each block again cost 3% of the attention instead). */
#define STREAMED 4 /* query blocks (of QT tokens) up to which each task packs its own */
static void pack_values(const uint16_t *values, long sk_h, long sk_t, long T, int Hkv, int D, uint32_t *packed,
                        int threads) {
    const long nb = (T + KB - 1) / KB;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long r = 0; r < Hkv * nb; r++) {
        const long h = r / nb, j0 = (r % nb) * KB;
        pack_block(values + h * sk_h + j0 * sk_t, sk_t, T - j0 < KB ? (int)(T - j0) : KB, D,
                   packed + r * (KB / 2) * D);
    }
}

/* O^T [d0, d0 + dn) += V^T P^T over one block of keys: o [dim][g], pw [key pair][g], vw [key pair][D] (words) */
static inline __attribute__((always_inline)) void pv_tile(__m512 o[][MAXG], __m512i pw[][MAXG], const uint32_t *vw,
                                                          int D, int d0, const int dn, const int G) {
    __m512 acc[16][MAXG];
    for (int t = 0; t < dn; t++)
        for (int g = 0; g < G; g++) acc[t][g] = o[d0 + t][g];
    for (int jp = 0; jp < KB / 2; jp++) {
        __m512i b[MAXG];
        for (int g = 0; g < G; g++) b[g] = pw[jp][g];
        for (int t = 0; t < dn; t++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)vw[jp * D + d0 + t]);
            for (int g = 0; g < G; g++) acc[t][g] = _mm512_dpbf16_ps(acc[t][g], a, (__m512bh)b[g]);
        }
    }
    for (int t = 0; t < dn; t++)
        for (int g = 0; g < G; g++) o[d0 + t][g] = acc[t][g];
}

/* One task: kv head h, query tokens i0 .. i0 + QT - 1 (those past n are computed and not written).
 * q [H, n, D] (strides sq_h, sq_n), keys and values [Hkv, T, D] (strides sk_h, sk_t), packed: the values as
 * pack_values lays them out, or NULL (the task packs each block it reads), seen: a mask's bits [n, ceil(T / KB)]
 * (bit j: key j of the block) or NULL, out [n, H, D] contiguous. */
static inline __attribute__((always_inline)) void task(const uint16_t *q, long sq_h, long sq_n, const uint16_t *keys,
                                                       long sk_h, long sk_t, const uint16_t *values,
                                                       const uint32_t *packed, const uint64_t *seen, int causal,
                                                       uint16_t *out, long n, long T, int H, long h, long i0,
                                                       float scale,
                                                       const int G, const int D) {
    const int RK = G == 1 ? 16 : G == 2 ? 12 : G == 3 ? 8 : G == 4 ? 6 : G <= 6 ? 4 : 3; /* keys a score tile */
    const int DT = RK;                                                                   /* dims an output tile */
    const int W = D / 2;                                                                 /* words a head */
    __m512i qt[MAXD / 2][MAXG];          /* queries as words: [k][g], lane i = (q[2k], q[2k + 1]) of token i */
    __m512 o[MAXD][MAXG];                /* O^T: [dim][g], lane i = token i */
    __m512 s[KB][MAXG];                  /* scores of a block, S^T: [key][g] */
    __m512i pw[KB / 2][MAXG];            /* probabilities as pairs of adjacent keys */
    uint16_t valid[KB];                  /* a key's lane mask: the tokens that may see it */
    __m512 m[MAXG], l[MAXG];
    const uint16_t zero_row[MAXD] = {0};
    for (int g = 0; g < G; g++) {
        m[g] = _mm512_set1_ps(NEG);
        l[g] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) o[d][g] = _mm512_setzero_ps();
        const uint16_t *qh = q + (h * G + g) * sq_h;
        for (int k = 0; k < W; k++) {
            uint32_t lane[QT];
            for (int i = 0; i < QT; i++) {
                uint32_t word = 0;
                if (i0 + i < n) memcpy(&word, qh + (i0 + i) * sq_n + 2 * k, 4);
                lane[i] = word;
            }
            qt[k][g] = _mm512_loadu_si512(lane);
        }
    }
    const uint16_t *kh = keys + h * sk_h, *vh = values + h * sk_h;
    const long blocks = (T + KB - 1) / KB;
    uint32_t own[KB / 2 * MAXD] __attribute__((aligned(64))); /* a block's values as words, where packed is NULL */
    /* With few query tokens (a question over a cache) each key is read by a task or two, from memory: a task asks
     * for the next block's keys while it computes this one (30 tokens over 8,000 keys, 30 layers: 31-32 ms against
     * 34-35). With many, every task of a kv head reads the keys again, from the cache, and the requests only cost. */
    const int streamed = (n + QT - 1) / QT <= STREAMED;
    const __mmask16 live = i0 + QT <= n ? 0xffff : (__mmask16)((1u << (n - i0)) - 1); /* the lanes of real tokens */
    const __m512 c = _mm512_set1_ps(scale * 1.44269504088896341f);                     /* x = s c - m c, base 2 */
    const __m512 lead = _mm512_set1_ps(LEAD / (scale * 1.44269504088896341f));        /* LEAD in the scores' units */
    const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    for (long j0 = 0; j0 < T; j0 += KB) {
        int len = T - j0 < KB ? (int)(T - j0) : KB;
        if (streamed && j0 + KB < T) { /* the next block's keys, and its values where this task packs them */
            const char *next = (const char *)(kh + (j0 + KB) * sk_t), *next_v = (const char *)(vh + (j0 + KB) * sk_t);
            const long bytes = (T - j0 - KB < KB ? T - j0 - KB : KB) * sk_t * 2;
            for (long a = 0; a < bytes; a += 64) {
                __builtin_prefetch(next + a);
                if (!packed) __builtin_prefetch(next_v + a);
            }
        }
        /* which tokens see which key of the block */
        uint16_t any = 0;
        if (seen) {
            uint64_t rows[QT];
            for (int i = 0; i < QT; i++) rows[i] = i0 + i < n ? seen[(i0 + i) * blocks + j0 / KB] : 0;
            uint64_t live = len == KB ? ~0ull : ((1ull << len) - 1), all = live;
            for (int i = 0; i < QT; i++) all &= i0 + i < n ? rows[i] : live;
            if (all == live) { /* every token sees every key of the block (most of a cache): no transposing */
                for (int j = 0; j < KB; j++) valid[j] = j < len ? 0xffff : 0;
                any = 0xffff;
            } else
                for (int j = 0; j < KB; j++) {
                    uint16_t bits = 0;
                    for (int i = 0; i < QT; i++) bits |= (uint16_t)(((rows[i] >> j) & 1) << i);
                    valid[j] = bits;
                    any |= bits;
                }
        } else if (causal) { /* token i sees keys up to T - n + i */
            for (int j = 0; j < KB; j++) {
                uint16_t bits = 0;
                for (int i = 0; i < QT; i++)
                    bits |= (uint16_t)((j < len && i0 + i < n && j0 + j <= T - n + i0 + i) << i);
                valid[j] = bits;
                any |= bits;
            }
        } else {
            for (int j = 0; j < KB; j++) valid[j] = j < len ? 0xffff : 0;
            any = 0xffff;
        }
        if (!any) continue; /* no token of the task sees this block */
        const uint32_t *vw = packed ? packed + (h * blocks * (KB / 2) + j0 / 2) * D : own;
        if (!packed) pack_block(vh + j0 * sk_t, sk_t, len, D, own);
        uint16_t every = 0xffff; /* the tokens that see every key of the block */
        for (int j = 0; j < KB; j++) every &= valid[j];
        const int full = every == 0xffff;
        /* Once every token of the task has seen a key, a block's probabilities are taken in its score tiles, against
         * the rows' running maxima as they stand, while the tiles' scores are still in registers: no pass to find
         * the block's max, no second read of its scores. A probability may then be above 1, up to 2^LEAD; a
         * score further above its row's max sends the block the usual way (its max found first, from the scores
         * kept), which also runs the first blocks and every block of tiles with an odd number of keys. */
        int early = RK % 2 == 0;
        __m512 lim[MAXG], stale[MAXG], mass[MAXG];
        for (int g = 0; g < G; g++) {
            early &= _mm512_mask_cmp_ps_mask(live, m[g], _mm512_set1_ps(0.5f * NEG), _CMP_GT_OQ) == live;
            lim[g] = _mm512_add_ps(m[g], lead);
            stale[g] = _mm512_maskz_mul_ps(live, m[g], c); /* a padded lane: 0, so its probabilities stay finite */
            mass[g] = _mm512_setzero_ps();
        }
        __mmask16 over = 0;
        /* S^T = K Q^T, RK keys a tile */
        for (int j = 0; j < KB; j += RK) {
            __m512 acc[16][MAXG];
            const uint16_t *krow[16];
            for (int r = 0; r < RK; r++) {
                krow[r] = j + r < len ? kh + (j0 + j + r) * sk_t : zero_row;
                for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();
            }
            for (int k = 0; k < W; k++) {
                __m512i b[MAXG];
                for (int g = 0; g < G; g++) b[g] = qt[k][g];
                for (int r = 0; r < RK; r++) {
                    uint32_t word;
                    memcpy(&word, krow[r] + 2 * k, 4);
                    __m512bh a = (__m512bh)_mm512_set1_epi32((int)word);
                    for (int g = 0; g < G; g++) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], a, (__m512bh)b[g]);
                }
            }
            for (int r = 0; r < RK && j + r < KB; r++)
                for (int g = 0; g < G; g++)
                    s[j + r][g] = full ? acc[r][g] : _mm512_mask_mov_ps(_mm512_set1_ps(NEG), valid[j + r], acc[r][g]);
            if (early)
                for (int r = 0; r + 1 < RK && j + r + 1 < KB; r += 2)
                    for (int g = 0; g < G; g++) {
                        const __m512 a = s[j + r][g], b = s[j + r + 1][g];
                        over |= _mm512_mask_cmp_ps_mask(live, a, lim[g], _CMP_GT_OQ);
                        over |= _mm512_mask_cmp_ps_mask(live, b, lim[g], _CMP_GT_OQ);
                        const __m512i w = pairs(exp2_512(_mm512_fmsub_ps(a, c, stale[g])),
                                                exp2_512(_mm512_fmsub_ps(b, c, stale[g])));
                        pw[(j + r) / 2][g] = w;
                        mass[g] = _mm512_dpbf16_ps(mass[g], (__m512bh)w, ones);
                    }
        }
        /* online softmax, a row a lane */
        if (early && !over) /* the probabilities are made and the maxima stay: only the sums grow */
            for (int g = 0; g < G; g++) l[g] = _mm512_add_ps(l[g], mass[g]);
        else
            for (int g = 0; g < G; g++) {
                /* a row that has seen no key yet stays at NEG (alpha 1 over nothing); at its first key, alpha is 0 */
                /* four running maxima, not one: one max a key in a single chain waits on each max's latency (a max
                 * is exact, so the result is the same) */
                __m512 top = m[g], t1 = s[0][g], t2 = s[1][g], t3 = s[2][g];
                for (int j = 3; j < KB - 1; j += 4) {
                    top = _mm512_max_ps(top, s[j][g]);
                    t1 = _mm512_max_ps(t1, s[j + 1][g]);
                    t2 = _mm512_max_ps(t2, s[j + 2][g]);
                    t3 = _mm512_max_ps(t3, s[j + 3][g]);
                }
                top = _mm512_max_ps(_mm512_max_ps(top, s[KB - 1][g]), _mm512_max_ps(t1, _mm512_max_ps(t2, t3)));
                /* past the first blocks a row's max rarely grows (most rows' largest score is an early key) */
                const __mmask16 grew = _mm512_cmp_ps_mask(top, m[g], _CMP_GT_OQ);
                const __m512 shift = _mm512_mul_ps(top, c);
                /* 1 exactly where the max stayed: there x = m c - round(m c) is the product's rounding error, which
                 * at NEG (a row that has seen no key) is large, of either sign */
                const __m512 alpha = grew ? _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), grew,
                                                               exp2_512(_mm512_fmsub_ps(m[g], c, shift)))
                                          : _mm512_set1_ps(1.0f);
                m[g] = top;
                /* the mass of what the weighted sum uses: the rounded probabilities, summed by the instruction the
                 * weighted sum runs on (a pair times (1, 1)), so it counts exactly what that sum counts */
                __m512 sum = _mm512_setzero_ps(), sum2 = _mm512_setzero_ps();
                if (full) /* every score of the block is a finite score: no floor, no mask */
                    for (int j = 0; j < KB; j += 4) {
                        __m512i w = pairs(exp2_512(_mm512_fmsub_ps(s[j][g], c, shift)),
                                          exp2_512(_mm512_fmsub_ps(s[j + 1][g], c, shift)));
                        __m512i w2 = pairs(exp2_512(_mm512_fmsub_ps(s[j + 2][g], c, shift)),
                                           exp2_512(_mm512_fmsub_ps(s[j + 3][g], c, shift)));
                        pw[j / 2][g] = w;
                        pw[j / 2 + 1][g] = w2;
                        sum = _mm512_dpbf16_ps(sum, (__m512bh)w, ones);
                        sum2 = _mm512_dpbf16_ps(sum2, (__m512bh)w2, ones);
                    }
                else
                    for (int j = 0; j < KB; j += 2) {
                        __m512 p0 = _mm512_maskz_mov_ps(valid[j], exp2_512(_mm512_fmsub_ps(s[j][g], c, shift)));
                        __m512 p1 = _mm512_maskz_mov_ps(valid[j + 1], exp2_512(_mm512_fmsub_ps(s[j + 1][g], c, shift)));
                        __m512i w = pairs(p0, p1);
                        pw[j / 2][g] = w;
                        sum = _mm512_dpbf16_ps(sum, (__m512bh)w, ones);
                    }
                sum = _mm512_add_ps(sum, sum2);
                if (grew) {
                    l[g] = _mm512_fmadd_ps(l[g], alpha, sum);
                    for (int d = 0; d < D; d++) o[d][g] = _mm512_mul_ps(o[d][g], alpha);
                } else /* alpha is 1 in every lane: the rescale would change nothing */
                    l[g] = _mm512_add_ps(l[g], sum);
            }
        /* O^T += V^T P^T, DT dims a tile: whole tiles (a constant count, so their accumulators stay in
         * registers), then what is left of the head */
        int d0 = 0;
        for (; d0 + DT <= D; d0 += DT) pv_tile(o, pw, vw, D, d0, DT, G);
        if (d0 < D) pv_tile(o, pw, vw, D, d0, D - d0, G);
    }
    /* out[token, head, dim] = O^T / l, rounded to bfloat16 */
    for (int g = 0; g < G; g++) {
        float tile[MAXD][QT];
        /* a token that sees no key (a padded row) gets zeros, not 0/0: a NaN in its output would become a NaN key
         * and value in the next layer, and a zero probability times NaN is NaN for every row that reads it */
        __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(l[g], _mm512_setzero_ps(), _CMP_GT_OQ),
                                         _mm512_set1_ps(1.0f), l[g]);
        for (int d = 0; d < D; d++) _mm512_storeu_ps(tile[d], _mm512_mul_ps(o[d][g], inv));
        for (int i = 0; i < QT && i0 + i < n; i++) {
            uint16_t *row = out + ((i0 + i) * H + h * G + g) * D;
            for (int d = 0; d < D; d += 16) {
                float lane[16];
                for (int e = 0; e < 16; e++) lane[e] = tile[d + e][i];
                _mm256_storeu_si256((__m256i *)(row + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(lane)));
            }
        }
    }
}

/* The attention given which keys each token sees (`seen`, a bit a key: [n][ceil(T / KB)], or NULL: `causal` or every
 * key). 0, -1 for a shape it does not take, -3 where memory ran out. */
int prefill_attention_seen_bf16(const uint16_t *q, long sq_h, long sq_n, const uint16_t *keys, const uint16_t *values,
                                long sk_h, long sk_t, const uint64_t *seen, int causal, uint16_t *out, long n, long T,
                                int H, int Hkv, int D, float scale, int threads) {
    const int G = H / Hkv;
    if (G < 1 || G > MAXG || G * Hkv != H || D % 32 || D > MAXD) return -1;
    const long blocks = (n + QT - 1) / QT, tasks = Hkv * blocks;
    uint32_t *packed = NULL;
    if (blocks > STREAMED) {
        packed = malloc(sizeof(uint32_t) * Hkv * ((T + KB - 1) / KB) * (KB / 2) * D);
        if (!packed) return -3;
        pack_values(values, sk_h, sk_t, T, Hkv, D, packed, threads);
    }
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
    for (long t = 0; t < tasks; t++) {
        long h = t % Hkv, i0 = (t / Hkv) * QT;
#define ARGS q, sq_h, sq_n, keys, sk_h, sk_t, values, packed, seen, causal, out, n, T, H, h, i0, scale
        switch (G) { /* G a constant in each: the tiles' accumulators stay in registers */
        case 1: task(ARGS, 1, D); break;
        case 2: task(ARGS, 2, D); break;
        case 3: task(ARGS, 3, D); break;
        case 4: task(ARGS, 4, D); break;
        case 5: task(ARGS, 5, D); break;
        case 6: task(ARGS, 6, D); break;
        case 7: task(ARGS, 7, D); break;
        default: task(ARGS, 8, D); break;
        }
#undef ARGS
    }
    free(packed);
    return 0;
}

/* Which keys each token sees where token i sits at query_pos[i] and key j at key_pos[j]: key j is seen iff
 * key_pos[j] <= query_pos[i] (the mask kvrag.model.recompute.causal_mask makes, as bits): seen [n][ceil(T / KB)]. */
void prefill_attention_position_bits(const long *key_pos, long T, const long *query_pos, long n, uint64_t *seen,
                                     int threads) {
    const long nb = (T + KB - 1) / KB;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long r = 0; r < n * nb; r++) {
        const long i = r / nb, j0 = (r % nb) * KB, len = T - j0 < KB ? T - j0 : KB;
        const __m512i at = _mm512_set1_epi64(query_pos[i]);
        uint64_t bits = 0;
        for (long c = 0; c < len; c += 8) {
            const __mmask8 live = len - c >= 8 ? 0xff : (__mmask8)((1u << (len - c)) - 1);
            const __m512i k = _mm512_maskz_loadu_epi64(live, key_pos + j0 + c);
            bits |= (uint64_t)_mm512_mask_cmple_epi64_mask(live, k, at) << c;
        }
        seen[r] = bits;
    }
}

int prefill_attention_bf16(const uint16_t *q, long sq_h, long sq_n, const uint16_t *keys, const uint16_t *values,
                           long sk_h, long sk_t, const uint8_t *mask, int kind, long sm, int causal, uint16_t *out,
                           long n, long T, int H, int Hkv, int D, float scale, int threads) {
    int G = H / Hkv, odd = 0;
    if (G < 1 || G > MAXG || G * Hkv != H || D % 32 || D > MAXD || kind < 0 || kind > 3 || (kind && !mask)) return -1;
    const long nb = (T + KB - 1) / KB;
    uint64_t *seen = kind ? malloc(sizeof(uint64_t) * n * nb) : NULL;
    if (kind && !seen) return -3;
    if (kind) { /* the mask read once, a bit a key; every kv head's tasks share it */
        _Pragma("omp parallel for schedule(static) num_threads(threads)")
        for (long r = 0; r < n * nb; r++) {
            long i = r / nb, j0 = (r % nb) * KB;
            seen[r] = row_bits(mask + (i * sm + j0) * mask_bytes[kind], kind, T - j0 < KB ? (int)(T - j0) : KB, &odd);
        }
    }
    /* -2: a mask value neither 0 nor the lowest (found before any attention was computed) */
    const int status = odd ? -2 : prefill_attention_seen_bf16(q, sq_h, sq_n, keys, values, sk_h, sk_t, seen, causal,
                                                               out, n, T, H, Hkv, D, scale, threads);
    free(seen);
    return status;
}

int prefill_attention_available(void) { return 1; }

#else

int prefill_attention_bf16(const uint16_t *q, long sq_h, long sq_n, const uint16_t *keys, const uint16_t *values,
                           long sk_h, long sk_t, const uint8_t *mask, int kind, long sm, int causal, uint16_t *out,
                           long n, long T, int H, int Hkv, int D, float scale, int threads) {
    return -1;
}

int prefill_attention_seen_bf16(const uint16_t *q, long sq_h, long sq_n, const uint16_t *keys, const uint16_t *values,
                                long sk_h, long sk_t, const uint64_t *seen, int causal, uint16_t *out, long n, long T,
                                int H, int Hkv, int D, float scale, int threads) {
    return -1;
}

void prefill_attention_position_bits(const long *key_pos, long T, const long *query_pos, long n, uint64_t *seen,
                                     int threads) {}

int prefill_attention_available(void) { return 0; }

#endif
