/* Re-positioning on CPU: stored keys rotated by one RoPE shift, written into a cache in one pass; kvrag.ckernel
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

static inline float same(float f) { return f; }

/* keys: rows x tokens x d (float32 or bfloat16), a row every keys_row elements. out: the same, a row every out_row
 * elements (a view into a larger cache). cos, sin: rot float32 angles, one shift for every token. */
#define ROTATE_KEYS(NAME, T, LOAD, STORE)                                                                       \
    void NAME(const T *keys, T *out, const float *cos, const float *sin, long rows, long tokens, int d, int rot, \
              long keys_row, long out_row, int threads) {                                                       \
        int half = rot / 2;                                                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                       \
        for (long r = 0; r < rows; r++) {                                                                       \
            const T *k = keys + r * keys_row;                                                                   \
            T *o = out + r * out_row;                                                                           \
            for (long t = 0; t < tokens; t++, k += d, o += d) {                                                 \
                _Pragma("omp simd")                                                                             \
                for (int i = 0; i < half; i++) {                                                                \
                    float k1 = LOAD(k[i]), k2 = LOAD(k[i + half]);                                              \
                    o[i] = STORE(k1 * cos[i] - k2 * sin[i]);                                                    \
                    o[i + half] = STORE(k2 * cos[i + half] + k1 * sin[i + half]);                               \
                }                                                                                               \
                if (rot < d) memcpy(o + rot, k + rot, sizeof(T) * (d - rot));                                   \
            }                                                                                                   \
        }                                                                                                       \
    }

ROTATE_KEYS(rotate_keys_f32, float, same, same)
ROTATE_KEYS(rotate_keys_bf16, uint16_t, widen, narrow)
