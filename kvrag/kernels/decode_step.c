/* One decoded token through a whole llama-family decoder on CPU, in one call: kvrag.ckernel builds and loads
 * this, kvrag.fastdecode calls it once a token.
 *
 * A decode step is vector-matrix products over every weight, attention over the cache, and a little
 * elementwise work between them. Each product walks its weight rows in order, one row after the other, each
 * output row a dot product in 16-lane float32 vectors: the cores then read the weights as a single stream and
 * the memory bandwidth, not the arithmetic, sets the time. (Four rows side by side, the usual way to reuse the
 * input vector, read the weights at about half the bandwidth here: the hardware prefetcher follows one stream
 * a core, not four.) Rows are split across the threads in equal contiguous runs.
 *
 * Weights and cache are float32 or bfloat16 (the model's dtype). In bfloat16 every value is rounded to
 * bfloat16 where transformers' bfloat16 forward rounds it (each product's output, the residual sums, RMSNorm's
 * output before its weight and after it, the rotary embedding's products and sum, SiLU and its product), and
 * every sum runs in float32, so the step computes what kvrag's torch step computes up to the order of the sums.
 * A bfloat16 weight row is read as 32-bit words: the even element is a word's low half shifted up, the odd one
 * its high half masked, each multiplied by the input's even or odd elements (kept apart once an input).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

void decode_attention_f32(const float *q, const float *keys, const float *values, long stride, int hkv, int G,
                          int D, long n, float *out, float *part, int threads);
void decode_attention_bf16(const float *q, const uint16_t *keys, const uint16_t *values, long stride, int hkv,
                           int G, int D, long n, float *out, float *part, int threads);

struct layer_weights { /* one decoder layer, in the model's dtype; q_norm, k_norm and qkv_bias may be NULL */
    const void *norm_in, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *norm_post, *gate_up, *down;
};

struct step_model {
    long layers, dim, ffn, heads, kv_heads, head_dim, vocab, bf16;
    double eps, scale;
    const void *embed, *norm, *lm_head;    /* [V, D], [D], [V, D] */
    const struct layer_weights *layer;     /* [layers] */
};

static inline v16 load_f32(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline float lanes_sum(v16 v) { float s = 0; for (int i = 0; i < 16; i++) s += v[i]; return s; }

static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's cast */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* v rounded to the model's dtype (float32: as it is) */
static inline float rnd(float v, int bf16) { return bf16 ? from_bf16(to_bf16(v)) : v; }

static inline float get(const void *p, long i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void put(void *p, long i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = to_bf16(v); else ((float *)p)[i] = v;
}

/* out[r] = rnd(sum_i w[r, i] x[i] + bias[r]) for r < R; w [R, C] float32. */
static void product_f32(const float *w, const float *x, const void *bias, float *out, long R, long C, int bf16,
                        int threads) {
    long body = C - C % 32;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long r = 0; r < R; r++) {
        const float *row = w + r * C;
        v16 a0 = {0}, a1 = {0};
        for (long c = 0; c < body; c += 32) {
            a0 += load_f32(row + c) * load_f32(x + c);
            a1 += load_f32(row + c + 16) * load_f32(x + c + 16);
        }
        float s = lanes_sum(a0 + a1);
        for (long c = body; c < C; c++) s += row[c] * x[c];
        out[r] = rnd(bias ? s + get(bias, r, bf16) : s, bf16);
    }
}

/* The same over bfloat16 rows; xe, xo: x's even and odd elements up to C - C % 32. */
static void product_bf16(const uint16_t *w, const float *x, const float *xe, const float *xo, const void *bias,
                         float *out, long R, long C, int threads) {
    long body = C - C % 32;
    const u32x16 high = (u32x16){0} + 0xffff0000u;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long r = 0; r < R; r++) {
        const uint16_t *row = w + r * C;
        v16 a0 = {0}, a1 = {0};
        for (long c = 0; c < body; c += 32) {
            u32x16 u; memcpy(&u, row + c, sizeof u);
            u32x16 even = u << 16, odd = u & high;
            v16 fe, fo; memcpy(&fe, &even, sizeof fe); memcpy(&fo, &odd, sizeof fo);
            a0 += fe * load_f32(xe + c / 2);
            a1 += fo * load_f32(xo + c / 2);
        }
        float s = lanes_sum(a0 + a1);
        for (long c = body; c < C; c++) s += from_bf16(row[c]) * x[c];
        out[r] = rnd(bias ? s + from_bf16(((const uint16_t *)bias)[r]) : s, 1);
    }
}

/* out = rnd(w x + bias), x [C] float32 (its values already in the model's dtype); split: 32 KB of scratch */
static void product(const void *w, const float *x, const void *bias, float *out, long R, long C, int bf16,
                    float *split, int threads) {
    if (!bf16) { product_f32(w, x, bias, out, R, C, 0, threads); return; }
    long body = C - C % 32;
    for (long c = 0; c < body / 2; c++) { split[c] = x[2 * c]; split[body / 2 + c] = x[2 * c + 1]; }
    product_bf16(w, x, split, split + body / 2, bias, out, R, C, threads);
}

/* transformers' RMSNorm: x * rsqrt(mean(x^2) + eps) in float32, rounded, then times the weight, rounded */
static void rms_norm(const float *x, const void *weight, float *out, long n, double eps, int bf16) {
    float sum = 0;
    for (long i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)n + (float)eps);
    for (long i = 0; i < n; i++) out[i] = rnd(get(weight, i, bf16) * rnd(x[i] * inv, bf16), bf16);
}

/* rotate-half RoPE on one head [d]: x * cos + cat(-x2, x1) * sin, each product and the sum rounded */
static void rope(float *x, const void *cos, const void *sin, long d, int bf16) {
    float tmp[512];
    long half = d / 2;
    for (long i = 0; i < d; i++) {
        float rotated = i < half ? -x[i + half] : x[i - half];
        tmp[i] = rnd(rnd(x[i] * get(cos, i, bf16), bf16) + rnd(rotated * get(sin, i, bf16), bf16), bf16);
    }
    memcpy(x, tmp, sizeof(float) * d);
}

/* The logits [V] (float32) of `token` at the position whose rotary rows are cos, sin [head_dim] (model dtype).
 * Its key and value go to slot `slot` of each layer's keys[l], values[l] ([kv_heads, capacity, head_dim], the
 * model's dtype, contiguous), and it attends to slots 0..slot. 0, or -1 where scratch memory ran out. */
int decode_step(const struct step_model *m, void *const *keys, void *const *values, long capacity, long token,
                const void *cos, const void *sin, long slot, float *logits, int threads) {
    const int bf16 = (int)m->bf16;
    const long D = m->dim, F = m->ffn, H = m->heads, Hkv = m->kv_heads, d = m->head_dim, G = H / Hkv;
    const long qkv_rows = (H + 2 * Hkv) * d, widest = F > H * d ? (F > D ? F : D) : (H * d > D ? H * d : D);
    const long blocks = (slot + 1 + 255) / 256;
    size_t floats = D + D + qkv_rows + H * d + H * d + 2 * F + F + widest + Hkv * blocks * G * (d + 2);
    float *x = malloc(sizeof(float) * floats);
    if (!x) return -1;
    float *h = x + D, *qkv = h + D, *q32 = qkv + qkv_rows, *att = q32 + H * d, *gu = att + H * d;
    float *act = gu + 2 * F, *split = act + F, *part = split + widest;
    for (long i = 0; i < D; i++) x[i] = get(m->embed, token * D + i, bf16);
    for (long l = 0; l < m->layers; l++) {
        const struct layer_weights *w = &m->layer[l];
        rms_norm(x, w->norm_in, h, D, m->eps, bf16);
        product(w->qkv, h, w->qkv_bias, qkv, qkv_rows, D, bf16, split, threads);
        float *q = qkv, *k = qkv + H * d, *v = k + Hkv * d;
        if (w->q_norm) {
            for (long i = 0; i < H; i++) rms_norm(q + i * d, w->q_norm, q + i * d, d, m->eps, bf16);
            for (long i = 0; i < Hkv; i++) rms_norm(k + i * d, w->k_norm, k + i * d, d, m->eps, bf16);
        }
        for (long i = 0; i < H; i++) rope(q + i * d, cos, sin, d, bf16);
        for (long i = 0; i < Hkv; i++) {
            rope(k + i * d, cos, sin, d, bf16);
            for (long j = 0; j < d; j++) {
                put(keys[l], (i * capacity + slot) * d + j, k[i * d + j], bf16);
                put(values[l], (i * capacity + slot) * d + j, v[i * d + j], bf16);
            }
        }
        for (long i = 0; i < H * d; i++) q32[i] = q[i] * (float)m->scale;
        if (bf16)
            decode_attention_bf16(q32, keys[l], values[l], capacity, Hkv, G, d, slot + 1, att, part, threads);
        else
            decode_attention_f32(q32, keys[l], values[l], capacity, Hkv, G, d, slot + 1, att, part, threads);
        for (long i = 0; i < H * d; i++) att[i] = rnd(att[i], bf16);
        product(w->o, att, NULL, h, D, H * d, bf16, split, threads);
        for (long i = 0; i < D; i++) x[i] = rnd(x[i] + h[i], bf16);
        rms_norm(x, w->norm_post, h, D, m->eps, bf16);
        product(w->gate_up, h, NULL, gu, 2 * F, D, bf16, split, threads);
        for (long i = 0; i < F; i++) {
            float g = gu[i];
            act[i] = rnd(rnd(g / (1.0f + expf(-g)), bf16) * gu[F + i], bf16);
        }
        product(w->down, act, NULL, h, D, F, bf16, split, threads);
        for (long i = 0; i < D; i++) x[i] = rnd(x[i] + h[i], bf16);
    }
    rms_norm(x, m->norm, h, D, m->eps, bf16);
    product(m->lm_head, h, NULL, logits, m->vocab, D, bf16, split, threads);
    free(x);
    return 0;
}
