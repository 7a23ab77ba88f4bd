/* The kernels that other kernels call (fused_linear.c, decoder_stack.c): declared once, and included
 * by the files that define them too, so that the compiler checks every caller against the definition. */
#ifndef VMESH_CROSS_CALLS_H
#define VMESH_CROSS_CALLS_H

#include <stdint.h>

void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t dim,
                      float eps, int num_threads);
void silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads);
void rotary_write_kv_f32(float *qkv, int64_t rows, int64_t stride, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         const float *cos, const float *sin, const int64_t *slot_mapping, float *key_cache,
                         float *value_cache, int num_threads);
int quantized_linear_f32(const float *x, const uint8_t *w, int format, const float *bias, float *y, int64_t rows,
                         int64_t out_features, int64_t in_features, int num_threads);
int quantized_linear_int8_f32(const float *x, const uint8_t *w, int format, const float *bias, float *y,
                              int64_t rows, int64_t out_features, int64_t in_features, int num_threads);
int rms_norm_quantized_linear_f32(const float *x, float *residual, const float *norm_weight, float eps,
                                  const uint8_t *w, int format, const float *bias, float *y, int64_t rows,
                                  int64_t out_features, int64_t in_features, int integer, int num_threads);
int silu_quantized_linear_f32(const float *gate_up, const uint8_t *w, int format, const float *bias, float *y,
                              int64_t rows, int64_t out_features, int64_t in_features, int integer, int num_threads);
int paged_attention_f32(const float *query, int64_t query_stride, const float *key_cache, const float *value_cache,
                        const int32_t *block_tables, int64_t table_width, const int64_t *request_rows,
                        const int64_t *token_rows, const int32_t *context_lens, int64_t num_items, int64_t kv_heads,
                        int64_t group, int64_t head_dim, int64_t block_size, float scale, int64_t window, float *out,
                        int num_threads);
int prefill_attention_f32(const float *query, int64_t query_stride, const float *key_cache, const float *value_cache,
                          const int32_t *block_tables, int64_t table_width, const int64_t *chunk_requests,
                          const int64_t *chunk_starts, const int32_t *chunk_lens, const int32_t *chunk_seq_lens,
                          int64_t num_chunks, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
                          float scale, int64_t window, float *out, int num_threads);

/* The bfloat16 model's (fused_ops.c, the attention kernels' bfloat16 variants, int8_linear.c). */
void add_rms_norm_bf16(const uint16_t *x, float *residual, const float *weight, uint16_t *out, int64_t rows,
                       int64_t dim, float eps, int num_threads);
void silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int num_threads);
void rotary_write_kv_bf16(const uint16_t *qkv, int64_t rows, int64_t stride, int64_t heads, int64_t kv_heads,
                          int64_t head_dim, const float *cos, const float *sin, const int64_t *slot_mapping,
                          uint16_t *key_cache, uint16_t *value_cache, float *query, int num_threads);
int paged_attention_bf16(const float *query, int64_t query_stride, const uint16_t *key_cache,
                         const uint16_t *value_cache, const int32_t *block_tables, int64_t table_width,
                         const int64_t *request_rows, const int64_t *token_rows, const int32_t *context_lens,
                         int64_t num_items, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
                         float scale, int64_t window, float *out, int num_threads);
int prefill_attention_bf16(const float *query, int64_t query_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, const int32_t *block_tables, int64_t table_width,
                           const int64_t *chunk_requests, const int64_t *chunk_starts, const int32_t *chunk_lens,
                           const int32_t *chunk_seq_lens, int64_t num_chunks, int64_t kv_heads, int64_t group,
                           int64_t head_dim, int64_t block_size, float scale, int64_t window, float *out,
                           int num_threads);
/* The 8-bit KV cache's (kv_int8.h): fused_ops.c's writers, the attention kernels' int8 variants. */
void rotary_write_kv_f32_int8(float *qkv, int64_t rows, int64_t stride, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, const float *cos, const float *sin, const int64_t *slot_mapping,
                              int8_t *key_cache, int8_t *value_cache, int num_threads);
void rotary_write_kv_bf16_int8(const uint16_t *qkv, int64_t rows, int64_t stride, int64_t heads, int64_t kv_heads,
                               int64_t head_dim, const float *cos, const float *sin, const int64_t *slot_mapping,
                               int8_t *key_cache, int8_t *value_cache, float *query, int num_threads);
int paged_attention_int8(const float *query, int64_t query_stride, const int8_t *key_cache, const int8_t *value_cache,
                         const int32_t *block_tables, int64_t table_width, const int64_t *request_rows,
                         const int64_t *token_rows, const int32_t *context_lens, int64_t num_items, int64_t kv_heads,
                         int64_t group, int64_t head_dim, int64_t block_size, float scale, int64_t window, float *out,
                         int num_threads);
int prefill_attention_int8(const float *query, int64_t query_stride, const int8_t *key_cache,
                           const int8_t *value_cache, const int32_t *block_tables, int64_t table_width,
                           const int64_t *chunk_requests, const int64_t *chunk_starts, const int32_t *chunk_lens,
                           const int32_t *chunk_seq_lens, int64_t num_chunks, int64_t kv_heads, int64_t group,
                           int64_t head_dim, int64_t block_size, float scale, int64_t window, float *out,
                           int num_threads);
int int8_block_linear(const void *x, int x_bf16, const uint8_t *packed, const float *w_scale, const float *bias,
                      void *y, int y_bf16, int64_t rows, int64_t out_features, int64_t in_features, int num_threads);

#endif
