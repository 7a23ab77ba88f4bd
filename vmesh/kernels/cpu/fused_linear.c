/* A quantized linear (quantized_linear.c, integer_linear.c) with the elementwise op that feeds it in
 * the same call: RMSNorm (with the residual add) before q/k/v and gate/up, SiLU-and-multiply before
 * down. A single stream's decode step makes ~270 calls from Python, each costing more in dispatch
 * (checks, an output tensor, ctypes) than the norm's arithmetic; these take 90 of them away.
 *
 * The ops are fused_ops.c's own functions, called as they are, into a scratch row block: the
 * result is the same, bit for bit, as the two calls. The callers (vmesh/kernels/cpu_native.py) check
 * every shape before calling, since the norm updates the residual in place before the product runs. */
#include <stdint.h>
#include <stdlib.h>

#include "cross_calls.h"

static int product(int integer, const float *x, const uint8_t *w, int format, const float *bias, float *y,
                   int64_t rows, int64_t out_features, int64_t in_features, int num_threads) {
    return integer ? quantized_linear_int8_f32(x, w, format, bias, y, rows, out_features, in_features, num_threads)
                   : quantized_linear_f32(x, w, format, bias, y, rows, out_features, in_features, num_threads);
}

/* add_rms_norm_f32(x, residual, norm_weight) (x NULL: residual is the stream, left as it is), then
 * y = that @ W.T + bias. Returns the product's status, or 2 when the scratch cannot be allocated. */
int rms_norm_quantized_linear_f32(const float *x, float *residual, const float *norm_weight, float eps,
                                  const uint8_t *w, int format, const float *bias, float *y, int64_t rows,
                                  int64_t out_features, int64_t in_features, int integer, int num_threads) {
    float *normed = malloc((size_t)(rows * in_features) * sizeof(float));
    if (!normed) return 2;
    add_rms_norm_f32(x, residual, norm_weight, normed, rows, in_features, eps, num_threads);
    const int status = product(integer, normed, w, format, bias, y, rows, out_features, in_features, num_threads);
    free(normed);
    return status;
}

/* gate_up [rows, 2 * in_features] -> y = (silu(gate) * up) @ W.T + bias. */
int silu_quantized_linear_f32(const float *gate_up, const uint8_t *w, int format, const float *bias, float *y,
                              int64_t rows, int64_t out_features, int64_t in_features, int integer, int num_threads) {
    float *act = malloc((size_t)(rows * in_features) * sizeof(float));
    if (!act) return 2;
    silu_and_mul_f32(gate_up, act, rows, in_features, num_threads);
    const int status = product(integer, act, w, format, bias, y, rows, out_features, in_features, num_threads);
    free(act);
    return status;
}
