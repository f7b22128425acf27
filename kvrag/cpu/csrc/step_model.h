/* A llama-family decoder's weights as the C kernels that run whole forwards read them (kvrag.cpu.cstep fills it from
 * a kvrag.cpu.decode.FastDecoder): the decode step (decode_step.c) and the bfloat16 prefill (prefill_layers.c). */
#ifndef KVRAG_STEP_MODEL_H
#define KVRAG_STEP_MODEL_H

struct layer_weights { /* one decoder layer, in the model's dtype; q_norm, k_norm and qkv_bias may be NULL */
    const void *norm_in, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *norm_post, *gate_up, *down;
};

/* a product's weight quantized (decode_quantized.c). int8: values [R, C]; for each 64 of a row a float32 scale and
 * its offset (128 times the scale times the group's sum). int4: values [R, C / 2], two to a byte; for each 64 of a
 * row a float16 scale and a float16 minimum (in `offsets`). */
struct int8_rows {
    const void *values, *scales, *offsets;
};

struct layer_int8 { /* one decoder layer's products in int8, for the decode step */
    struct int8_rows qkv, o, gate_up, down;
};

struct step_model {
    long layers, dim, ffn, heads, kv_heads, head_dim, vocab, bf16;
    double eps, scale;
    const void *embed, *norm, *lm_head;    /* [V, D], [D], [V, D] */
    const struct layer_weights *layer;     /* [layers] */
    const struct layer_int8 *int8_layer;   /* [layers], or NULL: the decode step's products read these instead */
    struct int8_rows int8_head;            /* the head's, where int8_layer is set */
    long int_bits;                         /* 8 or 4: what int8_layer and int8_head hold */
};

#endif
