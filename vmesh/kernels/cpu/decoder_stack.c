/* Every decoder layer of a quantized (`--weights native`) Llama-shaped model in one call: per layer
 * the fused norm + q/k/v product, rotary + KV write, paged attention (decodes) and tiled attention
 * (prefill chunks and speculative verification rows), the o product, the fused norm + gate/up
 * product and the fused SiLU-and-multiply + down product.
 *
 * A single stream's decode step called these ~180 times from Python, and each call's dispatch
 * (checks, an output tensor, ctypes) cost more than the arithmetic of the small ops: a fifth to a
 * quarter of the step. The kernels called here are the same functions, with the same arguments, in the
 * same order, as the per-op path (services/worker/model.py), so the result is the same bit for bit.
 * The caller (services/worker/decoder_stack.py) checks every layer's shapes when it builds the
 * layers' table and the step's once per step, and the scratch buffers are its tensors. */
#include <stddef.h>
#include <stdint.h>

#include "cross_calls.h"

/* One layer's weights and cache, as decoder_stack.py fills them once per model (ctypes Structure
 * of the same fields in the same order). A bias may be NULL. */
typedef struct {
    const float *input_norm, *post_attention_norm;
    const uint8_t *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    int32_t qkv_format, o_format, gate_up_format, down_format;
    void *key_cache, *value_cache; /* float32, or int8 rows (kv_int8.h) with stack_shape.kv_int8 */
    float scale;
    int64_t window; /* 0: none */
} stack_layer;

/* The step's attention work, built once per step (cpu_checks.AttentionItems / PrefillChunks);
 * num_items or num_chunks may be 0. */
typedef struct {
    const int32_t *block_tables;
    int64_t table_width;
    const int64_t *request_rows, *token_rows;
    const int32_t *context_lens;
    int64_t num_items;
    const int64_t *chunk_requests, *chunk_starts;
    const int32_t *chunk_lens, *chunk_seq_lens;
    int64_t num_chunks;
} stack_attention;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps;
    int32_t integer; /* the products round activations to int8 (integer_linear.c) */
    int32_t kv_int8; /* the KV cache is 8-bit (kv_int8.h): its writer and attention kernels' int8 variants */
} stack_shape;

/* The kernels of a layer, in the order they run: a failure's status names one (decoder_stack.py). */
enum { KERNEL_QKV, KERNEL_DECODE_ATTENTION, KERNEL_PREFILL_ATTENTION, KERNEL_O, KERNEL_GATE_UP, KERNEL_DOWN };

/* A layer's attention, in either stack's loop (its CHECKED, work, shape, layer l, group, attention and
 * num_threads): the decodes' kernel, then the prefill chunks' (verification rows among them), over
 * the cache's element type `suffix`, queries at `query`, rows `query_stride` floats apart. */
#define ATTEND_STEP(suffix, query, query_stride)                                                                     \
    do {                                                                                                             \
        if (work->num_items)                                                                                         \
            CHECKED(KERNEL_DECODE_ATTENTION,                                                                         \
                    paged_attention_##suffix(query, query_stride, l->key_cache, l->value_cache, work->block_tables,  \
                                             work->table_width, work->request_rows, work->token_rows,                \
                                             work->context_lens, work->num_items, shape->kv_heads, group,            \
                                             shape->head_dim, shape->block_size, l->scale, l->window, attention,     \
                                             num_threads));                                                          \
        if (work->num_chunks)                                                                                        \
            CHECKED(KERNEL_PREFILL_ATTENTION,                                                                        \
                    prefill_attention_##suffix(query, query_stride, l->key_cache, l->value_cache,                    \
                                               work->block_tables, work->table_width, work->chunk_requests,          \
                                               work->chunk_starts, work->chunk_lens, work->chunk_seq_lens,           \
                                               work->num_chunks, shape->kv_heads, group, shape->head_dim,            \
                                               shape->block_size, l->scale, l->window, attention, num_threads));     \
    } while (0)

/* residual [tokens, hidden]: the embeddings in, the residual stream before the last layer's MLP
 * output on return (updated in place, as the per-op path updates its stream); hidden [tokens,
 * hidden]: that output on return. Their sum is the stack's output, formed by the final norm.
 * Scratch, as hidden, not aliasing anything: qkv [tokens, (heads + 2 kv_heads) head_dim], attention
 * [tokens, heads head_dim], attention_out [tokens, hidden], gate_up [tokens, 2 intermediate].
 * Returns 0, or the first failing kernel's status as status + 16 kernel + 256 (layer + 1). */
int decoder_stack_f32(float *hidden, float *residual, int64_t tokens, const stack_layer *layers, int64_t num_layers,
                      const stack_shape *shape, const stack_attention *work, const float *cos, const float *sin,
                      const int64_t *slot_mapping, float *qkv, float *attention, float *attention_out, float *gate_up,
                      int num_threads) {
    const int64_t qkv_width = (shape->heads + 2 * shape->kv_heads) * shape->head_dim;
    const int64_t attention_width = shape->heads * shape->head_dim, group = shape->heads / shape->kv_heads;
    for (int64_t i = 0; i < num_layers; ++i) {
        const stack_layer *l = &layers[i];
        int status;
#define CHECKED(kernel, call)                                                                                        \
    do {                                                                                                             \
        if ((status = (call)) != 0) return status + 16 * (kernel) + 256 * (int)(i + 1);                             \
    } while (0)
        /* Layer 0 normalises the embeddings as they are; later ones add the MLP output to the stream first. */
        CHECKED(KERNEL_QKV, rms_norm_quantized_linear_f32(i == 0 ? NULL : hidden, residual, l->input_norm, shape->eps,
                                                          l->qkv, l->qkv_format, l->qkv_bias, qkv, tokens, qkv_width,
                                                          shape->hidden, shape->integer, num_threads));
        if (shape->kv_int8) {
            rotary_write_kv_f32_int8(qkv, tokens, qkv_width, shape->heads, shape->kv_heads, shape->head_dim, cos,
                                     sin, slot_mapping, l->key_cache, l->value_cache, num_threads);
            ATTEND_STEP(int8, qkv, qkv_width);
        } else {
            rotary_write_kv_f32(qkv, tokens, qkv_width, shape->heads, shape->kv_heads, shape->head_dim, cos, sin,
                                slot_mapping, l->key_cache, l->value_cache, num_threads);
            ATTEND_STEP(f32, qkv, qkv_width);
        }
        CHECKED(KERNEL_O, shape->integer
                              ? quantized_linear_int8_f32(attention, l->o, l->o_format, l->o_bias, attention_out,
                                                          tokens, shape->hidden, attention_width, num_threads)
                              : quantized_linear_f32(attention, l->o, l->o_format, l->o_bias, attention_out, tokens,
                                                     shape->hidden, attention_width, num_threads));
        CHECKED(KERNEL_GATE_UP, rms_norm_quantized_linear_f32(attention_out, residual, l->post_attention_norm,
                                                              shape->eps, l->gate_up, l->gate_up_format,
                                                              l->gate_up_bias, gate_up, tokens,
                                                              2 * shape->intermediate, shape->hidden, shape->integer,
                                                              num_threads));
        CHECKED(KERNEL_DOWN, silu_quantized_linear_f32(gate_up, l->down, l->down_format, l->down_bias, hidden, tokens,
                                                       shape->hidden, shape->intermediate, shape->integer,
                                                       num_threads));
#undef CHECKED
    }
    return 0;
}

/* ---- The same for `--weights int8 --dtype bfloat16` (services/worker/int8_linear.py in the mixed
 * bfloat16 model): per layer add + RMSNorm into bfloat16, the int8 q/k/v product of 8-bit blocks
 * (int8_block_linear, bfloat16 out), rotary + bfloat16 KV write with the float32 queries rounded,
 * both attention kernels over the bfloat16 (or 8-bit) cache, the o product, add + RMSNorm, the gate/up product,
 * SiLU-and-multiply and the down product: the per-op path's calls at 8 rows or more, in its order.
 * Fewer rows take the 16-bit activation kernel, which the per-op path keeps. */
typedef struct {
    const float *input_norm, *post_attention_norm;
    const uint8_t *qkv, *o, *gate_up, *down; /* int8_linear.py's pack_for_blocks */
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    void *key_cache, *value_cache; /* bfloat16, or int8 rows (kv_int8.h) with stack_shape.kv_int8 */
    float scale;
    int64_t window;
} int8_stack_layer;

/* As decoder_stack_f32, in the mixed model's dtypes: hidden (the last MLP output) bfloat16, residual
 * float32; scratch normed [tokens, hidden] and qkv bfloat16, query and attention float32 [tokens,
 * heads head_dim], attention_out [tokens, hidden], gate_up and activated [tokens, intermediate (x2)]
 * bfloat16. Same return codes. */
int decoder_stack_int8_bf16(uint16_t *hidden, float *residual, int64_t tokens, const int8_stack_layer *layers,
                            int64_t num_layers, const stack_shape *shape, const stack_attention *work,
                            const float *cos, const float *sin, const int64_t *slot_mapping, uint16_t *normed,
                            uint16_t *qkv, float *query, float *attention, uint16_t *attention_out, uint16_t *gate_up,
                            uint16_t *activated, int num_threads) {
    const int64_t qkv_width = (shape->heads + 2 * shape->kv_heads) * shape->head_dim;
    const int64_t attention_width = shape->heads * shape->head_dim, group = shape->heads / shape->kv_heads;
    const int64_t hidden_size = shape->hidden, intermediate = shape->intermediate;
    for (int64_t i = 0; i < num_layers; ++i) {
        const int8_stack_layer *l = &layers[i];
        int status;
#define CHECKED(kernel, call)                                                                                        \
    do {                                                                                                             \
        if ((status = (call)) != 0) return status + 16 * (kernel) + 256 * (int)(i + 1);                             \
    } while (0)
        add_rms_norm_bf16(i == 0 ? NULL : hidden, residual, l->input_norm, normed, tokens, hidden_size, shape->eps,
                          num_threads);
        CHECKED(KERNEL_QKV, int8_block_linear(normed, 1, l->qkv, l->qkv_scale, l->qkv_bias, qkv, 1, tokens, qkv_width,
                                              hidden_size, num_threads));
        if (shape->kv_int8) {
            rotary_write_kv_bf16_int8(qkv, tokens, qkv_width, shape->heads, shape->kv_heads, shape->head_dim, cos,
                                      sin, slot_mapping, l->key_cache, l->value_cache, query, num_threads);
            ATTEND_STEP(int8, query, attention_width);
        } else {
            rotary_write_kv_bf16(qkv, tokens, qkv_width, shape->heads, shape->kv_heads, shape->head_dim, cos, sin,
                                 slot_mapping, l->key_cache, l->value_cache, query, num_threads);
            ATTEND_STEP(bf16, query, attention_width);
        }
        CHECKED(KERNEL_O, int8_block_linear(attention, 0, l->o, l->o_scale, l->o_bias, attention_out, 1, tokens,
                                            hidden_size, attention_width, num_threads));
        add_rms_norm_bf16(attention_out, residual, l->post_attention_norm, normed, tokens, hidden_size, shape->eps,
                          num_threads);
        CHECKED(KERNEL_GATE_UP, int8_block_linear(normed, 1, l->gate_up, l->gate_up_scale, l->gate_up_bias, gate_up, 1,
                                                  tokens, 2 * intermediate, hidden_size, num_threads));
        silu_and_mul_bf16(gate_up, activated, tokens, intermediate, num_threads);
        CHECKED(KERNEL_DOWN, int8_block_linear(activated, 1, l->down, l->down_scale, l->down_bias, hidden, 1, tokens,
                                               hidden_size, intermediate, num_threads));
#undef CHECKED
    }
    return 0;
}
