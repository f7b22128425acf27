/* Stored chunk KV written into a serving engine's paged cache in one pass: kvrag.cpu.cpaged builds and loads this
 * apart (it needs the compiler's _Float16), for the vLLM connector.
 *
 * A piece's keys and values ([L, H, T, D] of float32, float16 or bfloat16, a token every D elements) go to the
 * cache slots given a token (slot = block * block_size + offset), converted to the cache's dtype. Its keys are
 * rotated on the way by one RoPE shift (k' = k*cos + rotate_half(k)*sin on the first `rot` dims, in float32, as
 * rotate_keys.c does; cos == NULL: no rotation). A block holds, for each kv head, block_size keys and then
 * block_size values: values one row of D a slot, keys either so or transposed (D rows of block_size slots, the
 * layout vLLM's CPU attention keeps). The rows (one kv head of one layer each) go to the threads.
 */
#include <stdint.h>
#include <string.h>

static inline float from_f32(float x) { return x; }
static inline float from_f16(_Float16 x) { return (float)x; }
static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float to_f32(float x) { return x; }
static inline _Float16 to_f16(float x) { return (_Float16)x; }
static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's cast; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

#define MAX_D 512

/* keys, values: the piece, a layer every src_layer elements, a head every src_head, a token every d.
 * key_dst, value_dst: each layer's cache (its keys' and its values' start), a block every block_stride elements,
 * a head every head_stride. slots: a token's slot. Returns 0, or -1 for a head size past MAX_D. */
#define PAGED_WRITE(NAME, S, LOAD, C, STORE)                                                                    \
    int NAME(const S *keys, const S *values, long src_layer, long src_head, int layers, int heads, long tokens,  \
             int d, int rot, const float *cos, const float *sin, C *const *key_dst, C *const *value_dst,          \
             const int64_t *slots, long block_stride, long head_stride, int block_size, int keys_transposed,      \
             int threads) {                                                                                     \
        if (d > MAX_D) return -1;                                                                               \
        const int half = rot / 2;                                                                               \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long r = 0; r < (long)layers * heads; r++) {                                                       \
            const long l = r / heads, h = r % heads;                                                            \
            const S *k = keys + l * src_layer + h * src_head;                                                   \
            const S *v = values + l * src_layer + h * src_head;                                                 \
            float row[MAX_D];                                                                                   \
            for (long t = 0; t < tokens; t++, k += d, v += d) {                                                 \
                const long block = slots[t] / block_size, at = slots[t] % block_size;                           \
                C *kb = key_dst[l] + block * block_stride + h * head_stride;                                    \
                C *vb = value_dst[l] + block * block_stride + h * head_stride + at * d;                         \
                _Pragma("omp simd")                                                                             \
                for (int i = 0; i < d; i++) row[i] = LOAD(k[i]);                                                \
                if (cos) {                                                                                      \
                    _Pragma("omp simd")                                                                         \
                    for (int i = 0; i < half; i++) {                                                            \
                        const float k1 = row[i], k2 = row[i + half];                                            \
                        row[i] = k1 * cos[i] - k2 * sin[i];                                                     \
                        row[i + half] = k2 * cos[i + half] + k1 * sin[i + half];                                \
                    }                                                                                           \
                }                                                                                               \
                if (keys_transposed)                                                                            \
                    for (int i = 0; i < d; i++) kb[(long)i * block_size + at] = STORE(row[i]);                  \
                else {                                                                                          \
                    _Pragma("omp simd")                                                                         \
                    for (int i = 0; i < d; i++) kb[at * d + i] = STORE(row[i]);                                 \
                }                                                                                               \
                _Pragma("omp simd")                                                                             \
                for (int i = 0; i < d; i++) vb[i] = STORE(LOAD(v[i]));                                          \
            }                                                                                                   \
        }                                                                                                       \
        return 0;                                                                                               \
    }

#define PAGED_WRITES(S, LOAD, SNAME)                                                                            \
    PAGED_WRITE(paged_write_##SNAME##_f32, S, LOAD, float, to_f32)                                              \
    PAGED_WRITE(paged_write_##SNAME##_f16, S, LOAD, _Float16, to_f16)                                           \
    PAGED_WRITE(paged_write_##SNAME##_bf16, S, LOAD, uint16_t, to_bf16)

PAGED_WRITES(float, from_f32, f32)
PAGED_WRITES(_Float16, from_f16, f16)
PAGED_WRITES(uint16_t, from_bf16, bf16)
