/* A llama-family decoder's weights as the C kernels that run whole forwards read them (kvrag.cpu.cstep fills it from
 * a kvrag.cpu.decode.FastDecoder): the decode step (decode_step.c) and the bfloat16 prefill (prefill_layers.c). */
#ifndef KVRAG_STEP_MODEL_H
#define KVRAG_STEP_MODEL_H

struct layer_weights { /* one decoder layer, in the model's dtype; q_norm, k_norm and qkv_bias may be NULL */
    const void *norm_in, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *norm_post, *gate_up, *down;
};

struct step_model {
    long layers, dim, ffn, heads, kv_heads, head_dim, vocab, bf16;
    double eps, scale;
    const void *embed, *norm, *lm_head;    /* [V, D], [D], [V, D] */
    const struct layer_weights *layer;     /* [layers] */
};

#endif
