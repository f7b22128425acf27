/* Re-positioning on CPU: stored keys rotated by one RoPE shift, written into a cache in one pass; kvrag.cpu.ckernel
 * builds and loads this beside the decode attention.
 *
 * k' = k*cos + rotate_half(k)*sin on the first `rot` dims (rotate_half(k) = (-k2, k1)), the other dims copied.
 * The rows (one kv head of one layer each) go to the threads; each key is read once and written once, where
 * torch's three elementwise passes read and write every key three times. bfloat16 keys are rotated in float32 and
 * rounded once (to nearest even), as kvrag's torch path casts its float32 result.
 */
#include <stdint.h>
#include <string.h>

static inline float widen(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t narrow(float f) { /* round to nearest even, as torch's cast; integer tests survive -ffast-math */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* one key rotated: k' = k*cos + rotate_half(k)*sin on its first rot dims, the rest copied */
static inline void rotate_token_f32(const float *k, float *o, const float *c, const float *s, int d, int rot) {
    int half = rot / 2;
    _Pragma("omp simd")
    for (int i = 0; i < half; i++) {
        float k1 = k[i], k2 = k[i + half];
        o[i] = k1 * c[i] - k2 * s[i];
        o[i + half] = k2 * c[i + half] + k1 * s[i + half];
    }
    if (rot < d) memcpy(o + rot, k + rot, sizeof(float) * (d - rot));
}

/* a bfloat16 key rotated in float32 and rounded once */
static inline void rotate_token_bf16(const uint16_t *k, uint16_t *o, const float *c, const float *s, int d, int rot) {
    int half = rot / 2;
    _Pragma("omp simd")
    for (int i = 0; i < half; i++) {
        float k1 = widen(k[i]), k2 = widen(k[i + half]);
        o[i] = narrow(k1 * c[i] - k2 * s[i]);
        o[i + half] = narrow(k2 * c[i + half] + k1 * s[i + half]);
    }
    if (rot < d) memcpy(o + rot, k + rot, sizeof(uint16_t) * (d - rot));
}

/* keys: rows x tokens x d (float32 or bfloat16), a row every keys_row elements. out: the same, a row every out_row
 * elements (a view into a larger cache). cos, sin: rot float32 angles, one shift for every token. */
#define ROTATE_KEYS(NAME, T, ROTATE)                                                                            \
    void NAME(const T *keys, T *out, const float *cos, const float *sin, long rows, long tokens, int d, int rot, \
              long keys_row, long out_row, int threads) {                                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long r = 0; r < rows; r++) {                                                                       \
            const T *k = keys + r * keys_row;                                                                   \
            T *o = out + r * out_row;                                                                           \
            for (long t = 0; t < tokens; t++, k += d, o += d) ROTATE(k, o, cos, sin, d, rot);                   \
        }                                                                                                       \
    }

ROTATE_KEYS(rotate_keys_f32, float, rotate_token_f32)
ROTATE_KEYS(rotate_keys_bf16, uint16_t, rotate_token_bf16)

/* A whole stitch in one call: every reused piece (the prefix, each chunk) of every layer and kv head written into
 * a cache's slots, its keys rotated by the piece's one shift (or copied as they are: the prefix) and its values
 * copied. The threads take (row, piece) pairs. The cache's lines are written with streaming stores where the
 * CPU has them: the forward reads the cache from memory anyway (a 4k cache is three times this CPU's L3), and a
 * plain store first reads every line it writes, a third more traffic on a pass bound by memory.
 *
 * Piece p: keys [rows, count[p], d] and values [rows, count[p], dv], contiguous, at keys_src[p], values_src[p];
 * written from slot[p] of every row of out_keys (a row every out_row_k elements, a slot every d) and out_values
 * (out_row_v, dv). cos, sin: [pieces, rot] float32 angles, used where rotate[p] is nonzero. Rows row0.. of the
 * pieces go to the cache's rows 0..rows - 1 (the whole forward in C stitches one layer at a time: its kv heads'
 * rows). With `stream` 0 the cache is written with plain stores, for a reader that comes straight after (that
 * forward's attention over the layer just written finds it in the caches, not in memory). */
#define STITCH_TOKENS 32 /* keys rotated into a scratch block, then streamed out */
#define STITCH_MAXD 256  /* the largest head the block holds */

static void stream_out(char *dst, const char *src, long bytes) {
#if defined(__AVX512F__)
    long head = (long)((64 - ((uintptr_t)dst & 63)) & 63);
    if (head > bytes) head = bytes;
    memcpy(dst, src, head);
    dst += head, src += head, bytes -= head;
    for (; bytes >= 64; bytes -= 64, dst += 64, src += 64)
        _mm512_stream_si512((__m512i *)dst, _mm512_loadu_si512(src));
#endif
    memcpy(dst, src, bytes);
}

static void write_out(void *dst, const void *src, long bytes, int stream) {
    if (stream) stream_out((char *)dst, (const char *)src, bytes);
    else memcpy(dst, src, bytes);
}

static void stream_fence(void) {
#if defined(__AVX512F__)
    _mm_sfence(); /* the streamed lines are visible to every thread once the call returns */
#endif
}

#define STITCH(NAME, T, ROTATE)                                                                                 \
    int NAME(const T *const *keys_src, const T *const *values_src, const long *slot, const long *count,          \
             const int *rotate, const float *cos, const float *sin, long pieces, long rows, int d, int dv,       \
             int rot, T *out_keys, T *out_values, long out_row_k, long out_row_v, long row0, int stream,          \
             int threads) {                                                                                     \
        if (d > STITCH_MAXD || rot > d || rot % 2) return -1;                                                   \
        _Pragma("omp parallel num_threads(threads)") {                                                          \
            T block[STITCH_TOKENS * STITCH_MAXD];                                                               \
            _Pragma("omp for schedule(dynamic, 4) nowait")                                                      \
            for (long w = 0; w < rows * pieces; w++) {                                                          \
                long r = w / pieces, p = w % pieces, m = count[p];                                             \
                const T *k = keys_src[p] + (row0 + r) * m * d;                                                  \
                T *ko = out_keys + r * out_row_k + slot[p] * d;                                                 \
                const float *c = cos + p * rot, *s = sin + p * rot;                                             \
                if (!rotate[p])                                                                                 \
                    write_out(ko, k, sizeof(T) * m * d, stream);                                                \
                else if (!stream)                                                                               \
                    for (long t = 0; t < m; t++) ROTATE(k + t * d, ko + t * d, c, s, d, rot);                   \
                else                                                                                            \
                    for (long t0 = 0; t0 < m; t0 += STITCH_TOKENS) {                                            \
                        long n = m - t0 < STITCH_TOKENS ? m - t0 : STITCH_TOKENS;                               \
                        for (long t = 0; t < n; t++)                                                            \
                            ROTATE(k + (t0 + t) * d, block + t * d, c, s, d, rot);                              \
                        stream_out((char *)(ko + t0 * d), (const char *)block, sizeof(T) * n * d);              \
                    }                                                                                           \
                write_out(out_values + r * out_row_v + slot[p] * dv, values_src[p] + (row0 + r) * m * dv,       \
                          sizeof(T) * m * dv, stream);                                                          \
            }                                                                                                   \
            if (stream) stream_fence();                                                                         \
        }                                                                                                       \
        return 0;                                                                                               \
    }

STITCH(stitch_f32, float, rotate_token_f32)
STITCH(stitch_bf16, uint16_t, rotate_token_bf16)
