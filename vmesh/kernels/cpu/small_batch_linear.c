/* y = x @ w^T (+ bias) for a few rows of x, on CPU.
 *
 * With one to STREAM_ROWS rows (kernel_limits.h) a linear layer is a pass over its weights: memory
 * bound. oneDNN's blocked GEMM streams them at ~20 GB/s on this project's machines; a plain row-major pass,
 * each thread taking a contiguous range of output features and dotting every weight row
 * with all the rows of x while it sits in L1, streams at ~32 GB/s.
 *
 * Layouts (float32, contiguous): x [rows, in], w [out, in], bias [out] or NULL, y [rows, out].
 * Built with -fopenmp, sharing torch's OpenMP runtime (see paged_attention.h).
 */
#include <omp.h>
#include <stdint.h>

#include "kernel_limits.h"

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

/* The same product over oneDNN's packed copy of the weight, so that no plain copy need be kept
 * beside it. For float32 on AVX-512 oneDNN lays the weight out as OI16i64o: output features in
 * blocks of 64, and block b is a row-major [padded_in][64] array at w + b * padded_in * 64 (the
 * transpose of those 64 weight rows; padding rows and columns are zero). services/worker/linear.py
 * checks that layout on every weight before it lets this kernel read one.
 *
 * Such a block is a GEMV layout already: each input feature's 64 weights are contiguous, so a row
 * of x is broadcast against them and every output stays in its own vector lane (no horizontal
 * sums). Work is split in 16-lane groups (one cache line per input feature), each thread a
 * contiguous run of them, so 576 outputs divide evenly over 2 threads where whole blocks would not.
 */
#include <string.h>

#define PACKED_OUT_BLOCK 64
#define LANES 16
#define GROUPS_PER_BLOCK (PACKED_OUT_BLOCK / LANES)

typedef float lanes_f32 __attribute__((vector_size(LANES * sizeof(float))));

/* A float32 block's 4 groups serve up to STREAM_ROWS (6) rows at once: 24 accumulators and 4 weight
 * vectors of AVX-512's 32 registers. bfloat16 unpacks each group into two vectors, so beyond
 * BF16_WHOLE_BLOCK_ROWS rows it takes a block in two halves of 2 groups. Halves cost the float32 LM
 * head 2.5x whole blocks' time at 5 rows (tried with 7-8 rows in mind; benchmarks/README.md): each
 * pass reads every other pair of cache lines, which one thread streams far slower than whole lines.
 * bfloat16's 5-6 rows have not been timed against oneDNN. */
#define BF16_WHOLE_BLOCK_ROWS 4
#define HALF_BLOCK_GROUPS (GROUPS_PER_BLOCK / 2)

/* ROWS and GROUPS are constants at every call, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void packed_pass(const float *x, const float *w, int64_t in_features,
                                                              float *y, const float *bias, int64_t out_features,
                                                              int64_t first_out, const int ROWS, const int GROUPS) {
    lanes_f32 acc[STREAM_ROWS][GROUPS_PER_BLOCK];
    for (int r = 0; r < ROWS; ++r)
        for (int g = 0; g < GROUPS; ++g) acc[r][g] = (lanes_f32){0};
    for (int64_t i = 0; i < in_features; ++i) {
        lanes_f32 weights[GROUPS_PER_BLOCK];
        for (int g = 0; g < GROUPS; ++g) memcpy(&weights[g], w + i * PACKED_OUT_BLOCK + g * LANES, sizeof(lanes_f32));
        for (int r = 0; r < ROWS; ++r) {
            const float xv = x[r * in_features + i];
            for (int g = 0; g < GROUPS; ++g) acc[r][g] += xv * weights[g];
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int g = 0; g < GROUPS; ++g)
            for (int lane = 0; lane < LANES; ++lane) {
                const int64_t o = first_out + g * LANES + lane;
                if (o < out_features) y[r * out_features + o] = acc[r][g][lane] + (bias ? bias[o] : 0.0f);
            }
}

/* PASS(ROWS) for the call's rows, instantiated only up to MAX_ROWS (the caller's bound on rows). */
#define ROW_CASES(PASS, MAX_ROWS)                                                                                 \
    switch (rows) {                                                                                               \
    case 1: PASS(1); break;                                                                                       \
    case 2: if (2 <= MAX_ROWS) PASS(2); break;                                                                    \
    case 3: if (3 <= MAX_ROWS) PASS(3); break;                                                                    \
    case 4: if (4 <= MAX_ROWS) PASS(4); break;                                                                    \
    case 5: if (5 <= MAX_ROWS) PASS(5); break;                                                                    \
    default: if (6 <= MAX_ROWS) PASS(6); break;                                                                   \
    }
_Static_assert(STREAM_ROWS == 6, "ROW_CASES lists the row counts up to STREAM_ROWS");

#define PASS_WHOLE(ROWS) packed_pass(x, w, in_features, y, bias, out_features, first_out, ROWS, GROUPS_PER_BLOCK)
#define PASS_GROUP(ROWS) packed_pass(x, w, in_features, y, bias, out_features, first_out, ROWS, 1)

static void packed_groups(const float *x, const float *w, int64_t in_features, float *y, const float *bias,
                          int64_t out_features, int64_t first_out, int64_t rows, int64_t groups) {
    if (groups == GROUPS_PER_BLOCK) {
        ROW_CASES(PASS_WHOLE, STREAM_ROWS)
        return;
    }
    for (int64_t g = 0; g < groups; ++g, w += LANES, first_out += LANES) ROW_CASES(PASS_GROUP, STREAM_ROWS)
}

/* x [rows <= STREAM_ROWS, in], w as above with padded_in >= in, bias [out] or NULL, y [rows, out]. */
int packed_small_batch_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t rows,
                                  int64_t out_features, int64_t in_features, int64_t padded_in, int num_threads) {
    if (rows == 0) return 0;
    if (rows < 0 || rows > STREAM_ROWS || padded_in < in_features) return 1;
    const int64_t blocks = (out_features + PACKED_OUT_BLOCK - 1) / PACKED_OUT_BLOCK;
    const int64_t units = blocks * GROUPS_PER_BLOCK;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t unit = units * t / threads;
        const int64_t end = units * (t + 1) / threads;
        while (unit < end) {
            const int64_t block = unit / GROUPS_PER_BLOCK, first_group = unit % GROUPS_PER_BLOCK;
            const int64_t left_in_run = end - block * GROUPS_PER_BLOCK;
            const int64_t stop = left_in_run < GROUPS_PER_BLOCK ? left_in_run : GROUPS_PER_BLOCK;
            const float *block_w = w + block * padded_in * PACKED_OUT_BLOCK + first_group * LANES;
            packed_groups(x, block_w, in_features, y, bias, out_features,
                          block * PACKED_OUT_BLOCK + first_group * LANES, rows, stop - first_group);
            unit = block * GROUPS_PER_BLOCK + stop;
        }
    }
    return 0;
}

/* ---- bfloat16 weights (the bfloat16 model, services/worker/model.py). oneDNN packs a bfloat16 weight
 * as AB16b64a2b on AVX-512 (AB16b32a2b with AMX): blocks of out_block = 64 (32) output features,
 * block b a row-major [padded_in / 2][out_block][2] array at w + b * padded_in * out_block (elements):
 * for each pair of input features, the block's outputs' two weights side by side (the layout of
 * AVX512-BF16's pairwise dot product and of AMX's tiles).
 * services/worker/linear.py checks it weight by weight, as for float32. Read 32 bits per output
 * lane, the pair's first weight is the low half shifted up and its second the high half masked, both
 * exact floats: the products and sums are float32 FMAs, as in the float32 kernel, at half the bytes.
 * x is widened into float32 once per call (zero-padded to padded_in), y rounded to bfloat16. */
#include <stdlib.h>

#include "vec_math.h"

typedef uint32_t lanes_u32 __attribute__((vector_size(LANES * sizeof(uint32_t))));

static inline __attribute__((always_inline)) void packed_pass_bf16(const float *x, const uint16_t *w,
                                                                   int64_t pairs, int64_t pair_stride,
                                                                   int64_t x_stride, uint16_t *y,
                                                                   const uint16_t *bias, int64_t out_features,
                                                                   int64_t first_out, const int ROWS,
                                                                   const int GROUPS) {
    lanes_f32 acc[STREAM_ROWS][GROUPS_PER_BLOCK];
    for (int r = 0; r < ROWS; ++r)
        for (int g = 0; g < GROUPS; ++g) acc[r][g] = (lanes_f32){0};
    for (int64_t p = 0; p < pairs; ++p) {
        lanes_f32 first[GROUPS_PER_BLOCK], second[GROUPS_PER_BLOCK];
        for (int g = 0; g < GROUPS; ++g) {
            lanes_u32 bits;
            memcpy(&bits, w + p * pair_stride + g * 2 * LANES, sizeof bits);
            const lanes_u32 low = bits << 16, high = bits & 0xffff0000u;
            memcpy(&first[g], &low, sizeof low);
            memcpy(&second[g], &high, sizeof high);
        }
        for (int r = 0; r < ROWS; ++r) {
            const float x0 = x[r * x_stride + 2 * p], x1 = x[r * x_stride + 2 * p + 1];
            /* Two separate updates: two FMAs, where one expression would be a multiply, an FMA and an add. */
            for (int g = 0; g < GROUPS; ++g) {
                acc[r][g] += x0 * first[g];
                acc[r][g] += x1 * second[g];
            }
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int g = 0; g < GROUPS; ++g)
            for (int lane = 0; lane < LANES; ++lane) {
                const int64_t o = first_out + g * LANES + lane;
                if (o < out_features)
                    y[r * out_features + o] = f32_to_bf16(acc[r][g][lane] + (bias ? bf16_to_f32(bias[o]) : 0.0f));
            }
}

#define PASS_BF16(ROWS, GROUPS) \
    packed_pass_bf16(x, w, pairs, 2 * out_block, x_stride, y, bias, out_features, first_out, ROWS, GROUPS)
#define PASS_BF16_WHOLE(ROWS) PASS_BF16(ROWS, GROUPS_PER_BLOCK)
#define PASS_BF16_HALF(ROWS) PASS_BF16(ROWS, HALF_BLOCK_GROUPS)
#define PASS_BF16_GROUP(ROWS) PASS_BF16(ROWS, 1)

/* `groups` consecutive 16-output groups of one block (out_block wide). A 32-wide block is two groups,
 * whole cache lines per pair of inputs: its whole-block pass is PASS_BF16_HALF. */
static void packed_groups_bf16(const float *x, const uint16_t *w, int64_t pairs, int64_t out_block, int64_t x_stride,
                               uint16_t *y, const uint16_t *bias, int64_t out_features, int64_t first_out,
                               int64_t rows, int64_t groups) {
    if (groups == GROUPS_PER_BLOCK && rows <= BF16_WHOLE_BLOCK_ROWS) {
        ROW_CASES(PASS_BF16_WHOLE, BF16_WHOLE_BLOCK_ROWS)
        return;
    }
    if (groups == GROUPS_PER_BLOCK) {
        for (int half = 0; half < 2;
             ++half, w += HALF_BLOCK_GROUPS * 2 * LANES, first_out += HALF_BLOCK_GROUPS * LANES)
            ROW_CASES(PASS_BF16_HALF, STREAM_ROWS)
        return;
    }
    if (groups == HALF_BLOCK_GROUPS) {
        ROW_CASES(PASS_BF16_HALF, STREAM_ROWS)
        return;
    }
    for (int64_t g = 0; g < groups; ++g, w += 2 * LANES, first_out += LANES) ROW_CASES(PASS_BF16_GROUP, STREAM_ROWS)
}

/* x [rows <= STREAM_ROWS, in]: bfloat16 when x_bf16, else float32; w as above (bfloat16, padded_in even and
 * >= in, out_block 32 or 64); bias [out] bfloat16 or NULL; y [rows, out] bfloat16. Returns 0, 1 for a bad
 * size, 2 when out of memory. */
int packed_small_batch_linear_bf16(const void *x, int x_bf16, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                                   int64_t rows, int64_t out_features, int64_t in_features, int64_t padded_in,
                                   int64_t out_block, int num_threads) {
    if (rows == 0) return 0;
    if (rows < 0 || rows > STREAM_ROWS || padded_in < in_features || padded_in % 2 ||
        (out_block != PACKED_OUT_BLOCK && out_block != HALF_BLOCK_GROUPS * LANES))
        return 1;
    float *xf = calloc((size_t)(rows * padded_in), sizeof(float));
    if (xf == NULL) return 2;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < in_features; ++i)
            xf[r * padded_in + i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[r * in_features + i])
                                           : ((const float *)x)[r * in_features + i];
    const int64_t pairs = (in_features + 1) / 2, x_stride = padded_in;
    const int64_t groups_per_block = out_block / LANES;
    const int64_t blocks = (out_features + out_block - 1) / out_block;
    const int64_t units = blocks * groups_per_block;
    const float *x_in = xf;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t unit = units * t / threads;
        const int64_t end = units * (t + 1) / threads;
        while (unit < end) {
            const int64_t block = unit / groups_per_block, first_group = unit % groups_per_block;
            const int64_t left_in_run = end - block * groups_per_block;
            const int64_t stop = left_in_run < groups_per_block ? left_in_run : groups_per_block;
            const uint16_t *block_w = w + block * padded_in * out_block + first_group * 2 * LANES;
            packed_groups_bf16(x_in, block_w, pairs, out_block, x_stride, y, bias, out_features,
                               block * out_block + first_group * LANES, rows, stop - first_group);
            unit = block * groups_per_block + stop;
        }
    }
    free(xf);
    return 0;
}
