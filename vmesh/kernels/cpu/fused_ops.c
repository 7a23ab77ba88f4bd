/* The elementwise work of a decoder layer on CPU, one pass per fused step.
 *
 * At decode batch sizes each of these is a few tens of thousands of floats: a torch op
 * costs more in dispatch and in extra passes over memory (RMSNorm is five ops, rotary five,
 * the KV write two) than in arithmetic. Results follow vmesh/kernels/reference.py; only the order
 * of the RMSNorm sum and the last bits of exp differ from torch.
 *
 * Layouts (float32; the _bf16 variants below say what they hold in bfloat16): rows are `stride`
 * elements apart where a stride is given, else contiguous.
 * Built with -fopenmp, sharing torch's OpenMP runtime (see paged_attention.h).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernel_limits.h"
#include "vec_math.h"
#include "kv_int8.h"
#include "cross_calls.h"

/* Below this many floats a pass is cheaper on one thread than the fork and join. */
#define PARALLEL_MIN_FLOATS 16384

/* residual <- x + residual (skipped when x is NULL), out <- weight * (residual / rms(residual)).
 * out may not alias residual; x may. */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t dim,
                      float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; ++r) {
        float *h = residual + r * dim;
        float *o = out + r * dim;
        float sum_squares = 0.0f;
        if (x != NULL) {
            const float *xr = x + r * dim;
#pragma omp simd reduction(+ : sum_squares)
            for (int64_t i = 0; i < dim; ++i) {
                h[i] += xr[i];
                sum_squares += h[i] * h[i];
            }
        } else {
#pragma omp simd reduction(+ : sum_squares)
            for (int64_t i = 0; i < dim; ++i) sum_squares += h[i] * h[i];
        }
        const float inv_rms = 1.0f / sqrtf(sum_squares / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) o[i] = weight[i] * (h[i] * inv_rms);
    }
}

/* gate_up [rows, 2 * inter] (gate, then up) -> out [rows, inter] = silu(gate) * up. */
void silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}

/* The first `count` heads of a float32 row rotated in place (halves, as Llama and Qwen2 do: with x1,
 * x2 the two halves, x1 cos - x2 sin and x2 cos + x1 sin); c, s: the row's [head_dim] tables. */
static inline void rotate_heads_f32(float *row, int64_t count, int64_t head_dim, const float *c, const float *s) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < count; ++h) {
        float *x1 = row + h * head_dim, *x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float a = x1[i], b = x2[i];
            const float rotated_first = a * c[i] - b * s[i];
            x2[i] = b * c[i + half] + a * s[i + half];
            x1[i] = rotated_first;
        }
    }
}

/* qkv [rows, (heads + 2 * kv_heads) * head_dim], rows `stride` floats apart: queries, keys,
 * values. Rotates the queries and keys in place (halves, as Llama and Qwen2 do: with x1, x2
 * the two halves, x1 cos - x2 sin and x2 cos + x1 sin), then copies each row's keys and
 * values into slot slot_mapping[row] of the caches [num_slots, kv_heads * head_dim]; a
 * negative slot is skipped. cos, sin: [rows, head_dim], this step's positions. */
void rotary_write_kv_f32(float *qkv, int64_t rows, int64_t stride, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         const float *cos, const float *sin, const int64_t *slot_mapping, float *key_cache,
                         float *value_cache, int num_threads) {
    const int64_t kv_floats = kv_heads * head_dim;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * stride >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; ++r) {
        float *row = qkv + r * stride;
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        rotate_heads_f32(row, heads + kv_heads, head_dim, c, s);
        const int64_t slot = slot_mapping[r];
        if (slot >= 0) {
            const float *k = row + heads * head_dim;
            memcpy(key_cache + slot * kv_floats, k, sizeof(float) * (size_t)kv_floats);
            memcpy(value_cache + slot * kv_floats, k + kv_floats, sizeof(float) * (size_t)kv_floats);
        }
    }
}

/* As rotary_write_kv_f32 with an 8-bit cache [num_slots, kv_heads * (head_dim + 4)] bytes
 * (kv_int8.h): each rotated key and each value row goes in as its codes and scale. */
void rotary_write_kv_f32_int8(float *qkv, int64_t rows, int64_t stride, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, const float *cos, const float *sin, const int64_t *slot_mapping,
                              int8_t *key_cache, int8_t *value_cache, int num_threads) {
    const int64_t row_bytes = head_dim + KV_INT8_SCALE_BYTES, slot_bytes = kv_heads * row_bytes;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * stride >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; ++r) {
        float *row = qkv + r * stride;
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        rotate_heads_f32(row, heads + kv_heads, head_dim, c, s);
        const int64_t slot = slot_mapping[r];
        if (slot >= 0) {
            const float *k = row + heads * head_dim, *v = k + kv_heads * head_dim;
            for (int64_t h = 0; h < kv_heads; ++h) {
                quantize_row_int8(k + h * head_dim, head_dim, key_cache + slot * slot_bytes + h * row_bytes);
                quantize_row_int8(v + h * head_dim, head_dim, value_cache + slot * slot_bytes + h * row_bytes);
            }
        }
    }
}

/* ---- The bfloat16 model on CPU (services/worker/model.py): bfloat16 linears and KV cache, with the
 * residual stream, norms, rotary and attention's softmax and sums in float32 (queries rounded to
 * bfloat16, as the keys are). These read the linears' bfloat16 outputs,
 * compute in float32 and round once, where they write bfloat16, to nearest even (vec_math.h). */

/* As add_rms_norm_f32 with x (a linear's output, or NULL) and out in bfloat16; residual and
 * weight stay float32. */
void add_rms_norm_bf16(const uint16_t *x, float *residual, const float *weight, uint16_t *out, int64_t rows,
                       int64_t dim, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; ++r) {
        float *h = residual + r * dim;
        uint16_t *o = out + r * dim;
        float sum_squares = 0.0f;
        if (x != NULL) {
            const uint16_t *xr = x + r * dim;
#pragma omp simd reduction(+ : sum_squares)
            for (int64_t i = 0; i < dim; ++i) {
                h[i] += bf16_to_f32(xr[i]);
                sum_squares += h[i] * h[i];
            }
        } else {
#pragma omp simd reduction(+ : sum_squares)
            for (int64_t i = 0; i < dim; ++i) sum_squares += h[i] * h[i];
        }
        const float inv_rms = 1.0f / sqrtf(sum_squares / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) o[i] = f32_to_bf16(weight[i] * (h[i] * inv_rms));
    }
}

/* As silu_and_mul_f32, bfloat16 in and out. */
void silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
            const float gate = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(gate / (1.0f + exp_f32(-gate)) * bf16_to_f32(u[i]));
        }
    }
}

/* A bfloat16 query head (x, head_dim elements) rotated as rotate_heads_f32 rotates, rounded to
 * bfloat16, into the float32 q. */
static inline void rotate_query_bf16(const uint16_t *x1, int64_t head_dim, const float *c, const float *s, float *q1) {
    const int64_t half = head_dim / 2;
    const uint16_t *x2 = x1 + half;
    float *q2 = q1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
        const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
        q1[i] = bf16_to_f32(f32_to_bf16(a * c[i] - b * s[i]));
        q2[i] = bf16_to_f32(f32_to_bf16(b * c[i + half] + a * s[i + half]));
    }
}

/* As rotary_write_kv_f32 over a bfloat16 qkv (rows `stride` elements apart), which it leaves as
 * it is: the rotated queries, rounded to bfloat16, go to query [rows, heads * head_dim] as float32
 * (the mode's activations are bfloat16, and prefill attention multiplies them in bfloat16 pairs),
 * the rotated keys, rounded, and the values, as they are, to the bfloat16 caches. */
void rotary_write_kv_bf16(const uint16_t *qkv, int64_t rows, int64_t stride, int64_t heads, int64_t kv_heads,
                          int64_t head_dim, const float *cos, const float *sin, const int64_t *slot_mapping,
                          uint16_t *key_cache, uint16_t *value_cache, float *query, int num_threads) {
    const int64_t half = head_dim / 2, kv_elements = kv_heads * head_dim;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * stride >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *row = qkv + r * stride;
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        const int64_t slot = slot_mapping[r];
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
            const uint16_t *x1 = row + h * head_dim, *x2 = x1 + half;
            if (h < heads) {
                rotate_query_bf16(x1, head_dim, c, s, query + (r * heads + h) * head_dim);
            } else if (slot >= 0) {
                uint16_t *k1 = key_cache + slot * kv_elements + (h - heads) * head_dim, *k2 = k1 + half;
#pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
                    k1[i] = f32_to_bf16(a * c[i] - b * s[i]);
                    k2[i] = f32_to_bf16(b * c[i + half] + a * s[i + half]);
                }
            }
        }
        if (slot >= 0)
            memcpy(value_cache + slot * kv_elements, row + (heads + kv_heads) * head_dim,
                   sizeof(uint16_t) * (size_t)kv_elements);
    }
}

/* As rotary_write_kv_bf16 with an 8-bit cache (kv_int8.h, as rotary_write_kv_f32_int8): the rotated
 * keys (float32, not first rounded to bfloat16) and the bfloat16 values go in as codes and scales.
 * head_dim <= MAX_HEAD_DIM (a row is widened in a buffer of that size): its callers check it
 * (CpuKernels.rotary_write_kv, and the decoder stack's refusal of larger heads). */
void rotary_write_kv_bf16_int8(const uint16_t *qkv, int64_t rows, int64_t stride, int64_t heads, int64_t kv_heads,
                               int64_t head_dim, const float *cos, const float *sin, const int64_t *slot_mapping,
                               int8_t *key_cache, int8_t *value_cache, float *query, int num_threads) {
    const int64_t half = head_dim / 2, row_bytes = head_dim + KV_INT8_SCALE_BYTES, slot_bytes = kv_heads * row_bytes;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * stride >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *row = qkv + r * stride;
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        const int64_t slot = slot_mapping[r];
        float widened[MAX_HEAD_DIM];
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
            const uint16_t *x1 = row + h * head_dim, *x2 = x1 + half;
            if (h < heads) {
                rotate_query_bf16(x1, head_dim, c, s, query + (r * heads + h) * head_dim);
            } else if (slot >= 0) {
#pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
                    widened[i] = a * c[i] - b * s[i];
                    widened[i + half] = b * c[i + half] + a * s[i + half];
                }
                quantize_row_int8(widened, head_dim, key_cache + slot * slot_bytes + (h - heads) * row_bytes);
            }
        }
        if (slot >= 0)
            for (int64_t h = 0; h < kv_heads; ++h) {
                const uint16_t *v = row + (heads + kv_heads + h) * head_dim;
                for (int64_t i = 0; i < head_dim; ++i) widened[i] = bf16_to_f32(v[i]);
                quantize_row_int8(widened, head_dim, value_cache + slot * slot_bytes + h * row_bytes);
            }
    }
}
