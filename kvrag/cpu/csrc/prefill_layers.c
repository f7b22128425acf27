/* A bfloat16 prefill of many tokens through a whole llama-family decoder, every layer and the output head, in one
 * call on CPUs with AVX512-BF16: kvrag.cpu.cbf16 builds this with the other prefill kernels, and kvrag.model.recompute
 * calls it for a stitched prefill's forward where the model's own forward would run those same kernels.
 *
 * The model's forward runs each layer as a dozen module calls from Python, a C kernel in most of them (norms,
 * products, rotation, attention, SiLU) and torch for the rest (residual sums, the cache's write, views): in a
 * `target_recompute` first token at 4,129 tokens the interpreter and those small operations held one core while
 * the other waited. Here the same kernels run in the same order over the same weights, the decoder's own (q, k
 * and v stacked in one product, gate and up in another: each output the same sum as alone), and the rest is a few
 * loops: the embedding rows, the keys (rotated straight into the cache's slots) and values written, the residual
 * sums rounded as torch's bfloat16 addition rounds them. Its logits and cache are the forward's, bit for bit
 * (tested on every architecture it takes).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "step_model.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

int prefill_attention_seen_bf16(const uint16_t *q, long sq_h, long sq_n, const uint16_t *keys, const uint16_t *values,
                                long sk_h, long sk_t, const uint64_t *seen, int causal, uint16_t *out, long n, long T,
                                int H, int Hkv, int D, float scale, int threads);
void prefill_attention_position_bits(const long *key_pos, long T, const long *query_pos, long n, uint64_t *seen,
                                     int threads);
int prefill_linear_bf16(const uint16_t *x, long M, long K, long ldx, const uint16_t *w, long N, const float *bias,
                        uint16_t *out, long ldo, uint32_t *packed, int threads);
int prefill_linear_one_bf16(const uint16_t *x, long K, const uint16_t *w, long N, const float *bias, uint16_t *out,
                            int threads);
long prefill_linear_scratch(long M, long K);
int prefill_rms_norm_bf16(const uint16_t *x, long ldx, const uint16_t *w, uint16_t *out, long ldo, long rows,
                          long dim, float eps, int threads);
int prefill_rotary_bf16(const uint16_t *q, long sq_b, long sq_h, long sq_n, const uint16_t *k, long sk_b, long sk_h,
                        long sk_n, const uint16_t *cos, const uint16_t *sin, long sc_b, long sc_n, uint16_t *qo,
                        long sqo_b, long sqo_h, long sqo_n, uint16_t *ko, long sko_b, long sko_h, long sko_n, long B,
                        long Hq, long Hk, long n, int D, int threads);
int stitch_bf16(const uint16_t *const *keys_src, const uint16_t *const *values_src, const long *slot, const long *count,
                const int *rotate, const float *cos, const float *sin, long pieces, long rows, int d, int dv, int rot,
                uint16_t *out_keys, uint16_t *out_values, long out_row_k, long out_row_v, long row0, int stream,
                int threads);
int prefill_silu_mul_bf16(const uint16_t *gate, long ldg, const uint16_t *up, long ldu, uint16_t *out, long ldo,
                          long rows, long cols, int threads);

/* x = x + y, each sum rounded to bfloat16 (torch's bfloat16 addition: the float32 sum, rounded to nearest even) */
static void residual(uint16_t *x, const uint16_t *y, long count, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (long i = 0; i < count; i += 16) {
        const __mmask16 live = count - i >= 16 ? 0xffff : (__mmask16)((1u << (count - i)) - 1);
        const __m512 sum = _mm512_add_ps(load16(x + i, live), load16(y + i, live));
        _mm256_mask_storeu_epi16(x + i, live, (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

/* The logits [V] (bfloat16, as the model's head gives them) of the last of n >= 2 tokens at logical positions
 * query_pos[i], whose rotary rows are cos[i], sin[i] ([n][head_dim]). Token i's key and value go to slot filled + i
 * of each layer's keys[l], values[l] ([kv_heads, capacity, head_dim] bfloat16, rows contiguous), and it attends to
 * the slots j < filled + n whose logical position key_pos[j] is at most its own (the forward's mask, as bits, made
 * once for every layer). 0; -1 where scratch memory ran out; -2 for a model or shape it does not take.
 *
 * With `pieces` > 0 the filled slots are not written yet: each layer's are written just before its attention, as
 * stitch_bf16 writes them (the pieces' keys rotated, values copied; the arguments stitch_bf16's, for every layer's
 * rows), with plain stores. The attention then reads the layer's keys and values from the caches the stitch left
 * them in where it would read them from memory after a stitch of every layer first (the stitch itself the same
 * bytes read and written): a question's first token over 8,000 cached tokens ~8 ms sooner. */
int prefill_layers_bf16(const struct step_model *m, void *const *keys, void *const *values, long capacity,
                        long filled, const long *tokens, long n, const uint16_t *cos, const uint16_t *sin,
                        const long *key_pos, const long *query_pos, uint16_t *logits,
                        const uint16_t *const *pieces_k, const uint16_t *const *pieces_v, const long *piece_slot,
                        const long *piece_count, const int *piece_rotate, const float *piece_cos,
                        const float *piece_sin, long pieces, int rot, int threads) {
    const long D = m->dim, F = m->ffn, H = m->heads, Hkv = m->kv_heads, d = m->head_dim, T = filled + n;
    const long rows = (H + 2 * Hkv) * d; /* q, k and v of a token */
    if (!m->bf16 || n < 2 || T > capacity) return -2;
    const long widest = rows > 2 * F ? rows : 2 * F, deepest = F > H * d ? (F > D ? F : D) : (H * d > D ? H * d : D);
    const long scratch = prefill_linear_scratch(n, deepest);
    uint16_t *x = malloc(sizeof(uint16_t) * n * (2 * D + widest + 2 * H * d + F + (H + Hkv) * d));
    uint32_t *packed = malloc(sizeof(uint32_t) * scratch);
    float *bias = malloc(sizeof(float) * rows);
    uint64_t *seen = malloc(sizeof(uint64_t) * n * ((T + 63) / 64));
    if (!x || !packed || !bias || !seen) {
        free(x);
        free(packed);
        free(bias);
        free(seen);
        return -1;
    }
    prefill_attention_position_bits(key_pos, T, query_pos, n, seen, threads);
    uint16_t *h = x + n * D, *wide = h + n * D, *q = wide + n * widest, *att = q + n * H * d, *act = att + n * H * d;
    uint16_t *qn = act + n * F, *kn = qn + n * H * d; /* q [n, H, d] and k [n, Hkv, d], where there are q/k norms */
    int status = 0;
    for (long i = 0; i < n; i++) memcpy(x + i * D, (const uint16_t *)m->embed + tokens[i] * D, sizeof(uint16_t) * D);
    for (long l = 0; l < m->layers && !status; l++) {
        const struct layer_weights *w = &m->layer[l];
        uint16_t *kc = keys[l], *vc = values[l];
        prefill_rms_norm_bf16(x, D, w->norm_in, h, D, n, D, (float)m->eps, threads);
        if (w->qkv_bias) /* the bias in float32, as kvrag.cpu.linear hands it to the product */
            for (long r = 0; r < rows; r++) {
                uint32_t u = (uint32_t)((const uint16_t *)w->qkv_bias)[r] << 16;
                memcpy(bias + r, &u, 4);
            }
        prefill_linear_bf16(h, n, D, D, w->qkv, rows, w->qkv_bias ? bias : NULL, wide, rows, packed, threads);
        /* q rotated into [n, H, d]; k rotated straight into the cache's slots; v copied there. With q/k norms
         * (qwen3), each head's q and k normalized first, as the model's norm modules do over [n, heads, d]. */
        const uint16_t *qs = wide, *ks = wide + H * d;
        long q_stride = rows, k_stride = rows;
        if (w->q_norm) {
            for (long i = 0; i < n; i++) {
                memcpy(qn + i * H * d, wide + i * rows, sizeof(uint16_t) * H * d);
                memcpy(kn + i * Hkv * d, wide + i * rows + H * d, sizeof(uint16_t) * Hkv * d);
            }
            prefill_rms_norm_bf16(qn, d, w->q_norm, qn, d, n * H, d, (float)m->eps, threads);
            prefill_rms_norm_bf16(kn, d, w->k_norm, kn, d, n * Hkv, d, (float)m->eps, threads);
            qs = qn, ks = kn, q_stride = H * d, k_stride = Hkv * d;
        }
        prefill_rotary_bf16(qs, 0, d, q_stride, ks, 0, d, k_stride, cos, sin, 0, d, q, 0, d, H * d, kc + filled * d,
                            0, capacity * d, d, 1, H, Hkv, n, (int)d, threads);
        for (long k = 0; k < Hkv; k++)
            for (long i = 0; i < n; i++)
                memcpy(vc + (k * capacity + filled + i) * d, wide + i * rows + (H + Hkv + k) * d, sizeof(uint16_t) * d);
        if (pieces && stitch_bf16(pieces_k, pieces_v, piece_slot, piece_count, piece_rotate, piece_cos, piece_sin,
                                  pieces, Hkv, (int)d, (int)d, rot, kc, vc, capacity * d, capacity * d, l * Hkv, 0,
                                  threads)) {
            status = -1; /* a head size or rotation the stitch does not take (checked by the caller) */
            break;
        }
        status = prefill_attention_seen_bf16(q, d, H * d, kc, vc, capacity * d, d, seen, 0, att, n, T, (int)H,
                                             (int)Hkv, (int)d, (float)m->scale, threads);
        if (status) break;
        prefill_linear_bf16(att, n, H * d, H * d, w->o, D, NULL, h, D, packed, threads);
        residual(x, h, n * D, threads);
        prefill_rms_norm_bf16(x, D, w->norm_post, h, D, n, D, (float)m->eps, threads);
        prefill_linear_bf16(h, n, D, D, w->gate_up, 2 * F, NULL, wide, 2 * F, packed, threads);
        prefill_silu_mul_bf16(wide, 2 * F, wide + F, 2 * F, act, F, n, F, threads);
        prefill_linear_bf16(act, n, F, F, w->down, D, NULL, h, D, packed, threads);
        residual(x, h, n * D, threads);
    }
    if (!status) {
        prefill_rms_norm_bf16(x + (n - 1) * D, D, m->norm, h, D, 1, D, (float)m->eps, threads);
        prefill_linear_one_bf16(h, D, m->lm_head, m->vocab, NULL, logits, threads);
    }
    free(x);
    free(packed);
    free(bias);
    free(seen);
    return status == -3 ? -1 : status ? -2 : 0; /* the attention's: -1 shape, -3 memory */
}

int prefill_layers_available(void) { return 1; }

#else

int prefill_layers_bf16(const struct step_model *m, void *const *keys, void *const *values, long capacity,
                        long filled, const long *tokens, long n, const uint16_t *cos, const uint16_t *sin,
                        const long *key_pos, const long *query_pos, uint16_t *logits,
                        const uint16_t *const *pieces_k, const uint16_t *const *pieces_v, const long *piece_slot,
                        const long *piece_count, const int *piece_rotate, const float *piece_cos,
                        const float *piece_sin, long pieces, int rot, int threads) {
    return -2;
}

int prefill_layers_available(void) { return 0; }

#endif
