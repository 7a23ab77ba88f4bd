/* y = x @ w^T (+ bias) for a few rows of x, on CPU.
 *
 * With one to four rows a linear layer is a pass over its weights: memory bound. oneDNN's
 * blocked GEMM streams them at ~20 GB/s on this project's machines; a plain row-major pass,
 * each thread taking a contiguous range of output features and dotting every weight row
 * with all the rows of x while it sits in L1, streams at ~32 GB/s.
 *
 * Layouts (float32, contiguous): x [rows, in], w [out, in], bias [out] or NULL, y [rows, out].
 * Built with -fopenmp, sharing torch's OpenMP runtime (see paged_attention.c).
 */
#include <stdint.h>

void small_batch_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t rows,
                            int64_t out_features, int64_t in_features, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t o = 0; o < out_features; ++o) {
        const float *weight_row = w + o * in_features;
        const float b = bias ? bias[o] : 0.0f;
        for (int64_t r = 0; r < rows; ++r) {
            const float *xr = x + r * in_features;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < in_features; ++i) acc += xr[i] * weight_row[i];
            y[r * out_features + o] = acc + b;
        }
    }
}
