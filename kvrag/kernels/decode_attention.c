/* One decoded token's attention over a cache, grouped-query, on CPU: kvrag.ckernel builds and loads this.
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
 * kernel before it; a step of the whole model spends about a third of its time here at 4k).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define AHEAD 4096 /* bytes ahead in a stream of keys or values that a load asks the memory for */
#define MAX_GROUP 8   /* query heads a kv head */
#define MAX_CHUNKS 16 /* head_dim / 16 */

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

static inline v16 load_f32(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

static inline v16 load_bf16(const uint16_t *p) {
    u16x16 h; memcpy(&h, p, sizeof h);
    u32x16 u = __builtin_convertvector(h, u32x16) << 16; /* a bfloat16 is a float32's top half */
    v16 v; memcpy(&v, &u, sizeof v); return v;
}

static inline float lanes_sum(v16 v) { float s = 0; for (int i = 0; i < 16; i++) s += v[i]; return s; }

/* One block of slots t0..t1 of kv head h: its G query heads' scores, exponentials and weighted values, written
 * to p ([G][D + 2]: the block's largest score, its mass, then the weighted values). Inlined where G and the
 * number of 16-lane chunks of a head are constants, so that the query rows and the accumulators stay in
 * registers (with G and chunks only known at run time they live on the stack, and every key and value costs a
 * round trip through memory for each of them). */
#define BLOCK_TASK(NAME, T, LOAD)                                                                               \
    static inline __attribute__((always_inline)) void NAME(const float *q, const T *keys, const T *values,      \
                                                           long stride, long h, long t0, long t1, float *p,     \
                                                           const int G, const int chunks) {                     \
        const int D = chunks * 16;                                                                              \
        float scores[MAX_GROUP][BLOCK], top[MAX_GROUP], mass[MAX_GROUP];                                        \
        v16 qv[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS];                                              \
        for (int g = 0; g < G; g++) {                                                                           \
            top[g] = -3.0e38f;                                                                                  \
            for (int c = 0; c < chunks; c++) {                                                                  \
                qv[g][c] = load_f32(q + (h * G + g) * D + c * 16);                                              \
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
                float s = lanes_sum(dot[g]);                                                                    \
                scores[g][t - t0] = s;                                                                          \
                top[g] = s > top[g] ? s : top[g];                                                               \
            }                                                                                                   \
        }                                                                                                       \
        int len = (int)(t1 - t0);                                                                               \
        for (int g = 0; g < G; g++) {                                                                           \
            float m = top[g], sum = 0, *s = scores[g];                                                          \
            _Pragma("omp simd reduction(+ : sum)")                                                              \
            for (int t = 0; t < len; t++) {                                                                     \
                s[t] = expf(s[t] - m);                                                                          \
                sum += s[t];                                                                                    \
            }                                                                                                   \
            mass[g] = sum;                                                                                      \
        }                                                                                                       \
        for (long t = t0; t < t1; t++) {                                                                        \
            const T *v = values + (h * stride + t) * D;                                                         \
            for (int c = 0; c < chunks; c++) {                                                                  \
                v16 vc = LOAD(v + c * 16);                                                                      \
                if (sizeof(T) == 2) __builtin_prefetch(v + c * 16 + AHEAD / 2);                                  \
                for (int g = 0; g < G; g++) acc[g][c] += scores[g][t - t0] * vc;                                \
            }                                                                                                   \
        }                                                                                                       \
        for (int g = 0; g < G; g++) {                                                                           \
            float *pg = p + g * (D + 2);                                                                        \
            pg[0] = top[g];                                                                                     \
            pg[1] = mass[g];                                                                                    \
            memcpy(pg + 2, acc[g], sizeof(float) * D);                                                          \
        }                                                                                                       \
    }

/* The shapes of the models kvrag meets most (head sizes 64 and 128, 1 to 4 query heads a kv head) get a block
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
    default: TASK(ARGS, G, chunks); break;                                                                      \
    }

/* q: [hkv * G, D] float32, already scaled. keys, values: [hkv, stride, D]. out: [hkv * G, D] float32.
 * part: scratch of hkv * ceil(n / BLOCK) * G * (D + 2) floats. D a multiple of 16, at most 16 * MAX_CHUNKS. */
#define DECODE_ATTENTION(NAME, TASK, T)                                                                         \
    void NAME(const float *q, const T *keys, const T *values, long stride, int hkv, int G, int D, long n,        \
              float *out, float *part, int threads) {                                                           \
        long blocks = (n + BLOCK - 1) / BLOCK;                                                                  \
        long tasks = hkv * blocks;                                                                              \
        int chunks = D / 16;                                                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long task = 0; task < tasks; task++) {                                                            \
            long h = task / blocks, t0 = (task % blocks) * BLOCK, t1 = t0 + BLOCK < n ? t0 + BLOCK : n;         \
            float *p = part + task * G * (D + 2);                                                               \
            SHAPES(TASK, ARGS_OF_TASK, G, chunks)                                                               \
        }                                                                                                       \
        for (long h = 0; h < hkv; h++)                                                                          \
            for (int g = 0; g < G; g++) {                                                                       \
                float m = -3.0e38f, total = 0, *o = out + (h * G + g) * D;                                      \
                for (long b = 0; b < blocks; b++) {                                                             \
                    float top_b = part[((h * blocks + b) * G + g) * (D + 2)];                                   \
                    m = top_b > m ? top_b : m;                                                                  \
                }                                                                                               \
                memset(o, 0, sizeof(float) * D);                                                                \
                for (long b = 0; b < blocks; b++) {                                                             \
                    const float *p = part + ((h * blocks + b) * G + g) * (D + 2);                               \
                    float r = expf(p[0] - m);                                                                   \
                    total += p[1] * r;                                                                          \
                    for (int d = 0; d < D; d++) o[d] += p[2 + d] * r;                                           \
                }                                                                                               \
                for (int d = 0; d < D; d++) o[d] /= total;                                                      \
            }                                                                                                   \
    }

#define ARGS_OF_TASK q, keys, values, stride, h, t0, t1, p

BLOCK_TASK(block_f32, float, load_f32)
BLOCK_TASK(block_bf16, uint16_t, load_bf16)
DECODE_ATTENTION(decode_attention_f32, block_f32, float)
DECODE_ATTENTION(decode_attention_bf16, block_bf16, uint16_t)
