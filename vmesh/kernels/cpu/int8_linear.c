/* `--weights int8`: float checkpoints' linears as int8 weights, one scale per output feature
 * (symmetric, quantized at load), times 16-bit activations, one scale per row (token) taken per call:
 * y[r, f] = sx[r] sw[f] sum_k a[r, k] w[f, k] + bias[f].
 *
 * 16 bits, not 8: with one scale per token a row's few large features set the scale, and 8 bits
 * left its small ones too coarse (3 % of perplexity); 16 bits cost none measurable. Each code is
 * split into bytes, a = 256 h + l, and both are multiplied by the same weight bytes with VPDPBUSD
 * (64 unsigned x signed int8 products into 16 int32 lanes per instruction): l is unsigned already,
 * h is stored offset by 128 (u = h + 128) and the load-time sum of each weight row corrects it:
 * sum(a w) = sum(l w) + 256 (sum(u w) - 128 sum(w)). With one scale per row and per feature the
 * whole input width is one integer sum per byte, so the inner loop is VPDPBUSD alone, two per
 * weight register, with no float work until each output's end. A lane holds at most in / 16
 * products of |l w|, |u w| <= 255 * 127, inside int32 for any width below a million; the sums are
 * combined in int64.
 *
 * One path for every row count: each thread takes tiles of TILE_OUT features (their int8 rows stay
 * in L1/L2 while every row passes over them) and runs 3 rows x 3 features of accumulator pairs per
 * step. Input widths that are not a multiple of 64 end with one masked step. Without VNNI this file
 * builds to a stub (status 3); the caller then keeps the float32 Linear.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_INT8_DOT 1
#include <immintrin.h>
#else
#define HAVE_INT8_DOT 0
#endif

#if HAVE_INT8_DOT
#define TILE_OUT 16
#define MICRO_R 3
#define MICRO_F 3

/* One row of x as 16-bit codes rounded to nearest (ties to even), split into their low bytes and
 * their high bytes offset by 128; returns its scale. */
static float quantize_row(const float *x, int64_t in_features, uint8_t *low, uint8_t *high) {
    __m512 amax = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= in_features; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    const __mmask16 tail = (__mmask16)((1u << (in_features - k)) - 1);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail, x + k)));
    const float top = _mm512_reduce_max_ps(amax), scale = top / 32767.0f;
    const __m512 inverse = _mm512_set1_ps(top > 0.0f ? 1.0f / scale : 0.0f);
    const __m512i offset = _mm512_set1_epi32(128);
    for (k = 0; k < in_features; k += 16) {
        const int64_t left = in_features - k;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + k), inverse));
        _mm_mask_storeu_epi8(low + k, mask, _mm512_cvtepi32_epi8(q)); /* the low byte, as is */
        _mm_mask_storeu_epi8(high + k, mask, _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_srai_epi32(q, 8), offset)));
    }
    return scale;
}

static inline __attribute__((always_inline)) void micro_product(const uint8_t *low, const uint8_t *high,
                                                                int64_t stride, const int8_t *w, int64_t in_features,
                                                                int32_t sums[2][MICRO_R][MICRO_F], const int ROWS,
                                                                const int FEATURES) {
    __m512i acc_low[MICRO_R][MICRO_F], acc_high[MICRO_R][MICRO_F];
    for (int r = 0; r < ROWS; ++r)
        for (int f = 0; f < FEATURES; ++f) acc_low[r][f] = acc_high[r][f] = _mm512_setzero_si512();
    for (int64_t k = 0; k < in_features; k += 64) {
        const int64_t left = in_features - k;
        const __mmask64 mask = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        __m512i wv[MICRO_F];
        for (int f = 0; f < FEATURES; ++f) {
            wv[f] = _mm512_maskz_loadu_epi8(mask, w + f * in_features + k);
            __asm__("" : "+v"(wv[f])); /* held in registers for every row (gcc would reload it) */
        }
        for (int r = 0; r < ROWS; ++r) {
            __m512i lv = _mm512_loadu_si512((const void *)(low + r * stride + k));
            __m512i hv = _mm512_loadu_si512((const void *)(high + r * stride + k));
            __asm__("" : "+v"(lv), "+v"(hv));
            for (int f = 0; f < FEATURES; ++f) {
                acc_low[r][f] = _mm512_dpbusd_epi32(acc_low[r][f], lv, wv[f]);
                acc_high[r][f] = _mm512_dpbusd_epi32(acc_high[r][f], hv, wv[f]);
            }
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int f = 0; f < FEATURES; ++f) {
            sums[0][r][f] = _mm512_reduce_add_epi32(acc_low[r][f]);
            sums[1][r][f] = _mm512_reduce_add_epi32(acc_high[r][f]);
        }
}

#define MICRO_CASE(R, F) micro_product(low_rows, high_rows, stride, wf, in_features, sums, R, F)
#define MICRO_FEATURES(R)                                                                                         \
    switch (features) {                                                                                           \
    case 1: MICRO_CASE(R, 1); break;                                                                              \
    case 2: MICRO_CASE(R, 2); break;                                                                              \
    default: MICRO_CASE(R, MICRO_F); break;                                                                       \
    }

static void tile_product(const uint8_t *low, const uint8_t *high, const float *x_scale, int64_t rows, int64_t stride,
                         const int8_t *w, const float *w_scale, const int32_t *w_sum, const float *bias, float *y,
                         int64_t first, int64_t count, int64_t out_features, int64_t in_features) {
    for (int64_t r0 = 0; r0 < rows; r0 += MICRO_R) {
        const int64_t row_count = rows - r0 < MICRO_R ? rows - r0 : MICRO_R;
        const uint8_t *low_rows = low + r0 * stride, *high_rows = high + r0 * stride;
        for (int64_t f0 = first; f0 < first + count; f0 += MICRO_F) {
            const int64_t features = first + count - f0 < MICRO_F ? first + count - f0 : MICRO_F;
            const int8_t *wf = w + f0 * in_features;
            int32_t sums[2][MICRO_R][MICRO_F];
            switch (row_count) {
            case 1: MICRO_FEATURES(1) break;
            case 2: MICRO_FEATURES(2) break;
            default: MICRO_FEATURES(3) break;
            }
            for (int64_t r = 0; r < row_count; ++r)
                for (int64_t f = 0; f < features; ++f) {
                    const int64_t o = f0 + f;
                    const int64_t dot = (int64_t)sums[0][r][f] + 256 * ((int64_t)sums[1][r][f] - 128 * (int64_t)w_sum[o]);
                    const float scale = x_scale[r0 + r] * w_scale[o];
                    y[(r0 + r) * out_features + o] = scale * (float)dot + (bias ? bias[o] : 0.0f);
                }
        }
    }
}
#endif /* HAVE_INT8_DOT */

/* x [rows, in] float32, w [out, in] int8 with w_scale [out] and w_sum [out] (each row's sum of
 * codes), bias [out] or NULL, y [rows, out] float32. Returns 0, 1 for a bad shape, 2 when out of
 * memory, 3 when built without VNNI. */
int int8_linear_f32(const float *x, const int8_t *w, const float *w_scale, const int32_t *w_sum, const float *bias,
                    float *y, int64_t rows, int64_t out_features, int64_t in_features, int num_threads) {
#if HAVE_INT8_DOT
    if (rows < 0 || out_features < 0 || in_features <= 0) return 1;
    if (rows == 0 || out_features == 0) return 0;
    const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    const int64_t stride = (in_features + 63) / 64 * 64;
    uint8_t *low = aligned_alloc(64, (size_t)rows * stride), *high = aligned_alloc(64, (size_t)rows * stride);
    float *x_scale = malloc((size_t)rows * sizeof(float));
    if (!low || !high || !x_scale) {
        free(low);
        free(high);
        free(x_scale);
        return 2;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 16)
    for (int64_t r = 0; r < rows; ++r) {
        memset(low + r * stride + in_features, 0, (size_t)(stride - in_features));
        memset(high + r * stride + in_features, 128, (size_t)(stride - in_features));
        x_scale[r] = quantize_row(x + r * in_features, in_features, low + r * stride, high + r * stride);
    }
    const int64_t tiles = (out_features + TILE_OUT - 1) / TILE_OUT;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t first = t * TILE_OUT, count = out_features - first < TILE_OUT ? out_features - first : TILE_OUT;
        tile_product(low, high, x_scale, rows, stride, w, w_scale, w_sum, bias, y, first, count, out_features,
                     in_features);
    }
    free(low);
    free(high);
    free(x_scale);
    return 0;
#else
    (void)x, (void)w, (void)w_scale, (void)w_sum, (void)bias, (void)y, (void)rows, (void)out_features;
    (void)in_features, (void)num_threads;
    return 3;
#endif
}
