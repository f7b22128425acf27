/* A decoded token's attention over a cache, grouped-query, on CPU, or that of several consecutive tokens (a
 * token and its prompt-lookup drafts, each seeing the cache up to itself): kvrag.cpu.ckernel builds and loads this.
 *
 * For each kv head, its G query heads' scores over the n cached slots, softmax, weighted values. The slots are
 * split into blocks of BLOCK (flash-decoding): a block's scores, exponentials and weighted values are computed
 * on their own, each key and value read once, and the blocks go to the threads; their partial results are then
 * merged by their maxima. Sums run in float32 over float32 or bfloat16 keys and values, in 16-lane vectors
 * (GCC/Clang vector extensions), the exponentials through the C library's vector exp (omp simd). From memory
 * (a cache larger than the last-level cache) the kernel is bound by what a core's loads keep in flight, so in
 * bfloat16 each load also asks for the line AHEAD bytes further on (10% faster at 4k slots, measured; in float32,
 * whose loads are twice as many a slot, it made no difference), and each key's load asks for its slot's value,
 * so the block's values stream in with its keys rather than after them (the kernel alone over 30 layers of 4,184
 * slots, 3 kv heads of 3 query heads, from memory: 4.7 against 4.9 ms, medians of 9 runs alternated with the
 * kernel before it; a step of the whole model spends about a third of its time here at 4k). Where the CPU has
 * AVX512-BF16, a bfloat16 block's scores run on its bfloat16 dot products instead (`block_dot_bf16`, below).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vectors.h"

#define BLOCK 256
#define AHEAD 4096 /* bytes ahead in a stream of keys or values that a load asks the memory for */
#define MAX_GROUP 8   /* query heads a kv head */
#define MAX_CHUNKS 16 /* head_dim / 16 */

typedef uint16_t u16x16 __attribute__((vector_size(32)));

static inline v16 load_bf16(const uint16_t *p) {
    u16x16 h; memcpy(&h, p, sizeof h);
    u32x16 u = __builtin_convertvector(h, u32x16) << 16; /* a bfloat16 is a float32's top half */
    v16 v; memcpy(&v, &u, sizeof v); return v;
}

/* s[t] = exp(s[t] - m) for t < len, and their sum: one copy of the code for every block task, so that a row's
 * sum is the same whichever task computed it */
__attribute__((noinline)) static float exp_sum(float *s, int len, float m) {
    float sum = 0;
    _Pragma("omp simd reduction(+ : sum)")
    for (int t = 0; t < len; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    return sum;
}

/* One block of slots t0..t1 of kv head h for G query rows (a kv head's query heads, of one token or of several):
 * row g's query at q[g], its block's largest score, mass and weighted values written to p[g] ([D + 2]). Each row
 * is computed alone (its dot products, sums and exponentials in the same order whatever the other rows are), the
 * rows only share each key and value loaded. Inlined where G and the number of 16-lane chunks of a head are
 * constants, so that the query rows and the accumulators stay in registers (with G and chunks only known at run
 * time they live on the stack, and every key and value costs a round trip through memory for each of them). */
#define BLOCK_TASK(NAME, T, LOAD)                                                                               \
    static inline __attribute__((always_inline)) void NAME(const float *const *q, const T *keys,                \
                                                           const T *values, long stride, long h, long t0,       \
                                                           long t1, float scale, float *const *p, const int G,  \
                                                           const int chunks) {                                  \
        const int D = chunks * 16;                                                                              \
        float scores[MAX_GROUP][BLOCK], top[MAX_GROUP], mass[MAX_GROUP];                                        \
        v16 qv[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS];                                              \
        for (int g = 0; g < G; g++) {                                                                           \
            top[g] = -3.0e38f;                                                                                  \
            for (int c = 0; c < chunks; c++) {                                                                  \
                qv[g][c] = load_f32(q[g] + c * 16);                                                             \
                acc[g][c] = (v16){0};                                                                           \
            }                                                                                                   \
        }                                                                                                       \
        for (long t = t0; t < t1; t++) {                                                                        \
            const T *k = keys + (h * stride + t) * D;                                                           \
            v16 dot[MAX_GROUP];                                                                                 \
            for (int g = 0; g < G; g++) dot[g] = (v16){0};                                                      \
            for (int c = 0; c < chunks; c++) {                                                                  \
                v16 kc = LOAD(k + c * 16);                                                                      \
                if (sizeof(T) == 2) __builtin_prefetch(k + c * 16 + AHEAD / 2);                                  \
                if (sizeof(T) == 2) __builtin_prefetch(values + (h * stride + t) * D + c * 16);                  \
                for (int g = 0; g < G; g++) dot[g] += qv[g][c] * kc;                                            \
            }                                                                                                   \
            for (int g = 0; g < G; g++) {                                                                       \
                float s = lanes_sum(dot[g]) * scale;                                                            \
                scores[g][t - t0] = s;                                                                          \
                top[g] = s > top[g] ? s : top[g];                                                               \
            }                                                                                                   \
        }                                                                                                       \
        int len = (int)(t1 - t0);                                                                               \
        for (int g = 0; g < G; g++) mass[g] = exp_sum(scores[g], len, top[g]);                                  \
        for (long t = t0; t < t1; t++) {                                                                        \
            const T *v = values + (h * stride + t) * D;                                                         \
            for (int c = 0; c < chunks; c++) {                                                                  \
                v16 vc = LOAD(v + c * 16);                                                                      \
                if (sizeof(T) == 2) __builtin_prefetch(v + c * 16 + AHEAD / 2);                                  \
                for (int g = 0; g < G; g++) acc[g][c] += scores[g][t - t0] * vc;                                \
            }                                                                                                   \
        }                                                                                                       \
        for (int g = 0; g < G; g++) {                                                                           \
            p[g][0] = top[g];                                                                                   \
            p[g][1] = mass[g];                                                                                  \
            memcpy(p[g] + 2, acc[g], sizeof(float) * D);                                                        \
        }                                                                                                       \
    }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "bf16.h"
#define DOT_BF16 1

/* block_bf16 on the CPU's bfloat16 dot products (vdpbf16ps), where it has them. The generic task costs about 90
 * instructions a slot and a kv head (each key widened to float32, 16-lane partial sums folded to one per query
 * row) and at 4k slots ran at about half the rate the memory streams the cache. Here 16 slots go together: their
 * keys, as words of two adjacent elements, are transposed in registers so that a vector holds one word of 16 keys,
 * and each query row's word is broadcast against it, so a row's 16 scores come out in the lanes with no lane sum.
 * A float32 query is taken as three bfloat16 parts, each what the parts before leave, rounded (24 bits of
 * mantissa, as float32's), and a part's products are taken only in rows that have it: each score sums exact
 * products in float32, as precise as the generic task's, and is then scaled. A bfloat16 query is its first part
 * alone, so the steps pass the model's query unscaled and the kernel scales the scores (a query scaled first by
 * 1/sqrt(128) took all three parts, three times the dot products: over the 1.5B's 28 layers of 4,100 slots
 * 4.39 ms against 3.93 ms unscaled, alternated in one process; the 0.5B's 24 layers 1.79 against 1.73 ms; the
 * weighted sum's float32 multiply-adds, G for every 16 elements of a value, now bound it). The softmax is the
 * generic task's, and so is the weighted sum: each output element the same multiply-adds in the same order (a
 * value's even and odd elements widened apart, put back in order at the end). A row's results depend on its own
 * query alone, as in the generic task. */
static inline __attribute__((always_inline)) void block_dot_bf16(const float *const *q, const uint16_t *keys,
                                                                 const uint16_t *values, long stride, long h,
                                                                 long t0, long t1, float scale, float *const *p,
                                                                 const int G, const int chunks) {
    const int D = chunks * 16, W = D / 2;
    uint32_t part[3][MAX_GROUP][MAX_CHUNKS * 8]; /* q = part 0 + part 1 + part 2, each bfloat16 */
    float scores[MAX_GROUP][BLOCK];
    unsigned more[3] = {0}; /* more[k] bit g: row g has a part k */
    for (int g = 0; g < G; g++)
        for (int c = 0; c < chunks; c++) {
            __m512 x = _mm512_loadu_ps(q[g] + 16 * c);
            for (int k = 0; k < 3; k++) { /* each part the rest rounded: exact, 8 more bits each */
                const __m256bh b = _mm512_cvtneps_pbh(x);
                _mm256_storeu_si256((__m256i *)(part[k][g] + 8 * c), (__m256i)b);
                if (_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ)) more[k] |= 1u << g;
                x = _mm512_sub_ps(x, load16((const uint16_t *)&b, 0xffff));
            }
        }
    const uint16_t *kh = keys + h * stride * D;
    const __m512 scaled = _mm512_set1_ps(scale);
    __m512 most[MAX_GROUP];
    for (int g = 0; g < G; g++) most[g] = _mm512_set1_ps(-3.0e38f);
    for (long t = t0; t < t1; t += 16) {
        const int live = t1 - t < 16 ? (int)(t1 - t) : 16;
        const __mmask16 lanes = (__mmask16)((1u << live) - 1);
        /* the keys AHEAD bytes on (asking for the block's values here too, as the generic task does, made the kernel
         * slower from memory here: 3.0 against 2.3 ms for 30 layers of 4,184 slots; they are asked for AHEAD bytes
         * on as they are weighted instead) */
        for (int i = 0; i < live; i++)
            for (int b = 0; b < D * 2; b += 64) __builtin_prefetch((const char *)(kh + (t + i) * D) + AHEAD + b);
        __m512 acc[MAX_GROUP];
        for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
        for (int w0 = 0; w0 < W; w0 += 16) {
            const int cols = W - w0 < 16 ? W - w0 : 16;
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < live ? _mm512_maskz_loadu_epi32((__mmask16)((1u << cols) - 1), kh + (t + i) * D + 2 * w0)
                                : _mm512_setzero_si512();
            transpose16(r); /* r[c] lane i: word w0 + c of slot t + i */
            for (int c = 0; c < cols; c++)
                for (int g = 0; g < G; g++)
                    for (int k = 0; k < 3; k++)
                        if (k == 0 || more[k] >> g & 1)
                            acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)r[c],
                                                      (__m512bh)_mm512_set1_epi32((int)part[k][g][w0 + c]));
        }
        for (int g = 0; g < G; g++) {
            acc[g] = _mm512_mul_ps(acc[g], scaled);
            _mm512_mask_storeu_ps(scores[g] + (t - t0), lanes, acc[g]);
            most[g] = _mm512_mask_max_ps(most[g], lanes, most[g], acc[g]);
        }
    }
    const int len = (int)(t1 - t0);
    float top[MAX_GROUP], mass[MAX_GROUP];
    for (int g = 0; g < G; g++) {
        top[g] = _mm512_reduce_max_ps(most[g]);
        mass[g] = exp_sum(scores[g], len, top[g]);
    }
    /* weighted values: 32 elements a load, the even ones and the odd ones widened apart */
    const int pairs = D / 32, tail = D % 32; /* tail: 0 or 16 elements, widened in order */
    __m512 even[MAX_GROUP][MAX_CHUNKS / 2], odd[MAX_GROUP][MAX_CHUNKS / 2], last[MAX_GROUP];
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < pairs; c++) even[g][c] = odd[g][c] = _mm512_setzero_ps();
        last[g] = _mm512_setzero_ps();
    }
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    for (long t = t0; t < t1; t++) {
        const uint16_t *v = values + (h * stride + t) * D;
        for (int b = 0; b < D * 2; b += 64) __builtin_prefetch((const char *)v + AHEAD + b);
        __m512 weight[MAX_GROUP];
        for (int g = 0; g < G; g++) weight[g] = _mm512_set1_ps(scores[g][t - t0]);
        for (int c = 0; c < pairs; c++) {
            const __m512i x = _mm512_loadu_si512(v + 32 * c);
            const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(x, high));
            for (int g = 0; g < G; g++) {
                even[g][c] = _mm512_fmadd_ps(weight[g], e, even[g][c]);
                odd[g][c] = _mm512_fmadd_ps(weight[g], o, odd[g][c]);
            }
        }
        if (tail) {
            const __m512 x = load16(v + 32 * pairs, 0xffff);
            for (int g = 0; g < G; g++) last[g] = _mm512_fmadd_ps(weight[g], x, last[g]);
        }
    }
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int g = 0; g < G; g++) {
        p[g][0] = top[g];
        p[g][1] = mass[g];
        for (int c = 0; c < pairs; c++) {
            _mm512_storeu_ps(p[g] + 2 + 32 * c, _mm512_permutex2var_ps(even[g][c], first, odd[g][c]));
            _mm512_storeu_ps(p[g] + 2 + 32 * c + 16, _mm512_permutex2var_ps(even[g][c], second, odd[g][c]));
        }
        if (tail) _mm512_storeu_ps(p[g] + 2 + 32 * pairs, last[g]);
    }
}
#else
#define DOT_BF16 0
#endif

/* The shapes of the models kvrag meets most (head sizes 64 and 128, 1 to 4 query heads a kv head, the Qwen2.5
 * models' 6 and 7, and 8 for several tokens of them together) get a block
 * task of their own, compiled with G and chunks as constants; any other shape runs the general one. (With more
 * query heads the accumulators outgrow the registers anyway, and each such task costs seconds of compiling.) */
#define SHAPES(TASK, ARGS, G, chunks)                                                                           \
    switch ((G) * 100 + (chunks)) {                                                                             \
    case 104: TASK(ARGS, 1, 4); break;                                                                          \
    case 204: TASK(ARGS, 2, 4); break;                                                                          \
    case 304: TASK(ARGS, 3, 4); break;                                                                          \
    case 404: TASK(ARGS, 4, 4); break;                                                                          \
    case 108: TASK(ARGS, 1, 8); break;                                                                          \
    case 208: TASK(ARGS, 2, 8); break;                                                                          \
    case 408: TASK(ARGS, 4, 8); break;                                                                          \
    case 604: TASK(ARGS, 6, 4); break;                                                                          \
    case 704: TASK(ARGS, 7, 4); break;                                                                          \
    case 804: TASK(ARGS, 8, 4); break;                                                                          \
    case 608: TASK(ARGS, 6, 8); break;                                                                          \
    case 808: TASK(ARGS, 8, 8); break;                                                                          \
    default: TASK(ARGS, G, chunks); break;                                                                      \
    }

/* K tokens' attention (1 to MAX_QUERIES) at consecutive slots: query j ([hkv * G, D] float32, its scores times
 * `scale`, at q + j * hkv * G * D) attends to slots 0..n + j - 1 of keys, values ([hkv, stride, D]); its output goes to
 * out + j * hkv * G * D. A task is one block of one kv head for all K queries, one after the other: the block's
 * keys and values come from memory once and stay in the core's cache for the next query. Each query's blocks and
 * their merge run the same code whatever K is, so its output is what it would be alone, bit for bit.
 * part: scratch of K * hkv * ceil((n + K - 1) / BLOCK) * G * (D + 2) floats. D a multiple of 16, at most
 * 16 * MAX_CHUNKS. */
#define DECODE_ATTENTION(NAME, TASK, T)                                                                         \
    __attribute__((noinline)) void NAME##_queries(const float *queries, const T *keys, const T *values,         \
                                                  long stride, int hkv, int G, int D, long n, int K, float scale, \
                                                  float *outs, float *part, int threads) {                        \
        long blocks = (n + K - 1 + BLOCK - 1) / BLOCK, rows = (long)hkv * G * D;                                \
        long tasks = hkv * blocks, size = G * (D + 2);                                                          \
        int chunks = D / 16;                                                                                    \
        int together = MAX_GROUP / G < K ? MAX_GROUP / G : K; /* queries a block task takes at once */         \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long task = 0; task < tasks; task++) {                                                            \
            long h = task / blocks, t0 = (task % blocks) * BLOCK;                                               \
            const float *q[MAX_GROUP];                                                                          \
            float *p[MAX_GROUP];                                                                                \
            for (int j = 0; j < K;) {                                                                           \
                long t1 = t0 + BLOCK < n + j ? t0 + BLOCK : n + j;                                              \
                /* queries that all see the whole block go together; the others one by one */                  \
                int take = t1 == t0 + BLOCK && j + together <= K ? together : 1;                                \
                if (t1 <= t0) { j++; continue; }                                                                \
                for (int i = 0; i < take * G; i++) {                                                            \
                    q[i] = queries + (j + i / G) * rows + (h * G + i % G) * D;                                  \
                    p[i] = part + ((j + i / G) * tasks + task) * size + (i % G) * (D + 2);                      \
                }                                                                                               \
                SHAPES(TASK, ARGS_OF_TASK, take * G, chunks)                                                    \
                j += take;                                                                                      \
            }                                                                                                   \
        }                                                                                                       \
        for (int j = 0; j < K; j++) {                                                                           \
            long seen = (n + j + BLOCK - 1) / BLOCK; /* the blocks query j reads */                            \
            for (long h = 0; h < hkv; h++)                                                                      \
                for (int g = 0; g < G; g++) {                                                                   \
                    float m = -3.0e38f, total = 0, *o = outs + j * rows + (h * G + g) * D;                      \
                    const float *ph = part + (j * tasks + h * blocks) * size + g * (D + 2);                     \
                    for (long b = 0; b < seen; b++) {                                                           \
                        float top_b = ph[b * size];                                                             \
                        m = top_b > m ? top_b : m;                                                              \
                    }                                                                                           \
                    memset(o, 0, sizeof(float) * D);                                                            \
                    for (long b = 0; b < seen; b++) {                                                           \
                        const float *p = ph + b * size;                                                         \
                        float r = expf(p[0] - m);                                                               \
                        total += p[1] * r;                                                                      \
                        for (int d = 0; d < D; d++) o[d] += p[2 + d] * r;                                       \
                    }                                                                                           \
                    for (int d = 0; d < D; d++) o[d] /= total;                                                  \
                }                                                                                               \
        }                                                                                                       \
    }                                                                                                           \
    /* one token's attention over slots 0..n-1: q [hkv * G, D], out [hkv * G, D]; part: hkv * ceil(n / BLOCK) \
     * * G * (D + 2) floats */                                                                                  \
    void NAME(const float *q, const T *keys, const T *values, long stride, int hkv, int G, int D, long n,        \
              float scale, float *out, float *part, int threads) {                                              \
        NAME##_queries(q, keys, values, stride, hkv, G, D, n, 1, scale, out, part, threads);                    \
    }

#define ARGS_OF_TASK q, keys, values, stride, h, t0, t1, scale, p

BLOCK_TASK(block_f32, float, load_f32)
DECODE_ATTENTION(decode_attention_f32, block_f32, float)
#if DOT_BF16
DECODE_ATTENTION(decode_attention_bf16, block_dot_bf16, uint16_t)
#else
BLOCK_TASK(block_bf16, uint16_t, load_bf16)
DECODE_ATTENTION(decode_attention_bf16, block_bf16, uint16_t)
#endif
