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
 * Calls of fewer than 8 rows (int8_linear_f32; the caller picks the path): each thread takes tiles of
 * TILE_OUT features (their int8 rows stay in L1/L2 while every row passes over them) and runs 3 rows
 * x 3 features of accumulator pairs per step. Input widths that are not a multiple of 64 end with
 * one masked step. Without VNNI this file builds to a stub (status 3); the caller then keeps the
 * float32 Linear.
 *
 * Batches (int8_block_linear) round activations to 8 bits per block of 64 inputs instead: a block's
 * few large features no longer set the scale of the whole row, so 8 bits suffice (+0.74 % of
 * perplexity on the embedded model in float32, +0.42 % over bfloat16's in the mixed model, against
 * 3 % per token), and each product is one VPDPBUSD per 4 inputs where the 16-bit path takes two.
 * There the lanes hold 16 output features, not 64 inputs: each block's int32 sums are scaled into
 * float accumulators once per block (a convert and an FMA per 16 VPDPBUSD; blocks of 32, llama.cpp's
 * Q8_0 grain, ran at 0.75-0.8x the speed for no clear gain in perplexity), so no horizontal sum is
 * needed at all. The weights are held a second time for it, packed for those lanes: for each 16
 * features, per 4 inputs 64 bytes (feature-major, then the 4 inputs), each code offset by 128 into
 * the unsigned operand; the activations are the signed one, so the offset adds 128 sum(q) per row
 * and block, taken out once per row at the end (`correction`). A row holding a NaN or infinity
 * gives NaN outputs (its scales are NaN), as a float product would.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cross_calls.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_INT8_DOT 1
#include <immintrin.h>
#else
#define HAVE_INT8_DOT 0
#endif

#define BLOCK 64 /* the batch path's inputs per activation scale */

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

/* The batch path: activations as 8-bit codes per block of BLOCK inputs (see the file's comment). */
#define BLOCK_ROWS 4  /* rows x 16-feature vectors of the micro product: 12 int32 and 12 float */
#define BLOCK_VECS 3  /* accumulators, 3 weight vectors and a broadcast fill 28 of 32 registers */
#define ROW_PANEL 256 /* rows whose codes (256 x in bytes) stay in L2 while every weight tile passes */
#define PREFETCH_MAX_TILE (256 << 10) /* a tile fetched ahead beside the current one: half of a 1 MiB L2 */

static inline __m512 load_widened(const void *x, int bf16, int64_t offset) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + offset))), 16));
    return _mm512_loadu_ps((const float *)x + offset);
}

/* Round to nearest even, as torch's .to(torch.bfloat16) does. */
static inline void store_rounded(void *y, int bf16, int64_t offset, __m512 v, __mmask16 mask) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)y + offset, mask, v);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    /* A NaN stays a (quiet) NaN: rounding its low bits up could carry it into an infinity. */
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16((uint16_t *)y + offset, mask, _mm512_cvtepi32_epi16(rounded));
}

/* One row: codes [in], scales [in / 64]; returns the row's correction 128 sum_b scale_b sum(codes_b). */
static float quantize_blocks(const void *x, int bf16, int64_t row, int64_t in_features, int8_t *codes, float *scales) {
    float correction = 0.0f;
    for (int64_t b = 0; b < in_features / BLOCK; ++b) {
        const int64_t k = row * in_features + b * BLOCK;
        __m512 v[BLOCK / 16], top = _mm512_setzero_ps();
        __mmask16 nonfinite = 0; /* max would drop a NaN; v - v is NaN for NaN and for infinities */
        for (int i = 0; i < BLOCK / 16; ++i) {
            v[i] = load_widened(x, bf16, k + 16 * i);
            top = _mm512_max_ps(top, _mm512_abs_ps(v[i]));
            nonfinite |= _mm512_cmp_ps_mask(_mm512_sub_ps(v[i], v[i]), _mm512_setzero_ps(), _CMP_UNORD_Q);
        }
        const float largest = nonfinite ? 0.0f : _mm512_reduce_max_ps(top);
        const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
        __m512i sum = _mm512_setzero_si512();
        for (int i = 0; i < BLOCK / 16; ++i) {
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inverse));
            _mm_storeu_si128((__m128i *)(codes + b * BLOCK + 16 * i), _mm512_cvtsepi32_epi8(q));
            sum = _mm512_add_epi32(sum, q);
        }
        scales[b] = nonfinite ? __builtin_nanf("") : largest / 127.0f;
        correction += scales[b] * (float)_mm512_reduce_add_epi32(sum);
    }
    return 128.0f * correction;
}

typedef struct {
    const int8_t *codes;      /* [rows, in] */
    const float *scales;      /* [rows, in / 64] */
    const float *correction;  /* [rows] */
    int64_t in_features;
} BlockActivations;

/* y[r0 .. r0+ROWS, v0*16 ..] for VECS vectors of 16 features; `last` masks the final vector's lanes. */
static inline __attribute__((always_inline)) void block_micro(const BlockActivations *a, int64_t r0,
                                                               const uint8_t *w, int64_t vec_bytes, int64_t v0,
                                                               const float *w_scale, const float *bias, void *y,
                                                               int y_bf16, int64_t out_features, __mmask16 last,
                                                               const int ROWS, const int VECS) {
    const int64_t in_features = a->in_features, blocks = in_features / BLOCK;
    const int8_t *codes = a->codes + r0 * in_features;
    const float *scales = a->scales + r0 * blocks;
    const uint8_t *wv0 = w + v0 * vec_bytes;
    __m512 sum[BLOCK_ROWS][BLOCK_VECS];
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < VECS; ++v) sum[r][v] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i dot[BLOCK_ROWS][BLOCK_VECS];
        for (int r = 0; r < ROWS; ++r)
            for (int v = 0; v < VECS; ++v) dot[r][v] = _mm512_setzero_si512();
#pragma GCC unroll 16 /* unrolled, the accumulators stay in place (rolled, gcc copied them each pass) */
        for (int g = 0; g < BLOCK / 4; ++g) {
            const int64_t group = b * (BLOCK / 4) + g;
            __m512i wv[BLOCK_VECS];
            for (int v = 0; v < VECS; ++v) {
                wv[v] = _mm512_loadu_si512((const void *)(wv0 + v * vec_bytes + group * 64));
                __asm__("" : "+v"(wv[v])); /* held in registers for every row (gcc would reload it) */
            }
            for (int r = 0; r < ROWS; ++r) {
                int32_t four;
                memcpy(&four, codes + r * in_features + group * 4, sizeof four);
                const __m512i x4 = _mm512_set1_epi32(four);
                for (int v = 0; v < VECS; ++v) dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], wv[v], x4);
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            const __m512 scale = _mm512_set1_ps(scales[r * blocks + b]);
            for (int v = 0; v < VECS; ++v) sum[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][v]), scale, sum[r][v]);
        }
    }
    for (int v = 0; v < VECS; ++v) {
        const int64_t f = (v0 + v) * 16;
        const __mmask16 mask = v == VECS - 1 ? last : (__mmask16)0xffff;
        const __m512 ws = _mm512_maskz_loadu_ps(mask, w_scale + f);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + f) : _mm512_setzero_ps();
        for (int r = 0; r < ROWS; ++r) {
            const __m512 corrected = _mm512_sub_ps(sum[r][v], _mm512_set1_ps(a->correction[r0 + r]));
            store_rounded(y, y_bf16, (r0 + r) * out_features + f, _mm512_fmadd_ps(corrected, ws, bv), mask);
        }
    }
}

#define BLOCK_CASE(R, V) block_micro(a, r, w, vec_bytes, v0, w_scale, bias, y, y_bf16, out_features, last, R, V)
#define BLOCK_VECS_OF(R)                                                                                          \
    switch (vecs) {                                                                                               \
    case 1: BLOCK_CASE(R, 1); break;                                                                              \
    case 2: BLOCK_CASE(R, 2); break;                                                                              \
    default: BLOCK_CASE(R, BLOCK_VECS); break;                                                                    \
    }

static inline void prefetch_to_l2(const uint8_t *bytes, int64_t count) {
    for (int64_t b = 0; b < count; b += 64) __builtin_prefetch(bytes + b, 0, 2);
}

/* Tile t's bytes to fetch ahead: none past the thread's run (t >= end), nor where two tiles would
 * not sit in half an L2 (layers wider than the model's measured here: untried, so left alone). */
static inline int64_t bytes_ahead(int64_t t, int64_t end, int64_t tile_bytes, int64_t weight_bytes) {
    if (t >= end || tile_bytes > PREFETCH_MAX_TILE) return 0;
    return weight_bytes - t * tile_bytes < tile_bytes ? weight_bytes - t * tile_bytes : tile_bytes;
}

/* Rows first_row .. first_row + rows of the tile of `vecs` 16-feature vectors from v0; meanwhile
 * next_bytes of w from byte `next` (the tile this thread takes next) are fetched into L2, a share
 * per row group: a model's weights come from memory (a layer's are long evicted by the others'
 * and the KV cache's), which the hardware prefetcher alone did not hide: 30 layers' products at
 * 64 rows took 1.15x the time from memory that they took on cached weights, 1.07x with this, and
 * the 64-row int8 + bfloat16 decode step 0.96x (benchmarks/int8_layers_from_memory.py;
 * benchmarks/README.md, "Weights fetched a tile ahead"). */
static void block_tile(const BlockActivations *a, int64_t first_row, int64_t rows, const uint8_t *w,
                       int64_t vec_bytes, int64_t v0, int64_t vecs, const float *w_scale, const float *bias, void *y,
                       int y_bf16, int64_t out_features, int64_t next, int64_t next_bytes) {
    const int64_t tail = out_features - (v0 + vecs - 1) * 16;
    const __mmask16 last = tail >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << tail) - 1);
    const int64_t groups = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS, share = ((next_bytes + groups - 1) / groups + 63) / 64 * 64;
    for (int64_t r = first_row, fetched = 0; r < first_row + rows; r += BLOCK_ROWS, fetched += share) {
        if (fetched < next_bytes)
            prefetch_to_l2(w + next + fetched, fetched + share < next_bytes ? share : next_bytes - fetched);
        switch (first_row + rows - r) {
        case 1: BLOCK_VECS_OF(1) break;
        case 2: BLOCK_VECS_OF(2) break;
        case 3: BLOCK_VECS_OF(3) break;
        default: BLOCK_VECS_OF(BLOCK_ROWS) break;
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

/* The block path's inputs per activation scale: Python packs and checks shapes by it. */
int vmesh_int8_block_inputs(void) { return BLOCK; }

/* x [rows, in] (float32, or bfloat16 where x_bf16), packed as the file's comment lays it out
 * (ceil(out / 16) x in / 4 x 64 bytes), w_scale [out], bias [out] or NULL (float32), y [rows,
 * out] (float32, or bfloat16 where y_bf16). in must be a multiple of BLOCK. Returns 0, 1 for a
 * bad shape, 2 when out of memory, 3 when built without VNNI. */
int int8_block_linear(const void *x, int x_bf16, const uint8_t *packed, const float *w_scale, const float *bias,
                      void *y, int y_bf16, int64_t rows, int64_t out_features, int64_t in_features, int num_threads) {
#if HAVE_INT8_DOT
    if (rows < 0 || out_features < 0 || in_features <= 0 || in_features % BLOCK) return 1;
    if (rows == 0 || out_features == 0) return 0;
    const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    const int64_t blocks = in_features / BLOCK;
    int8_t *codes = malloc((size_t)(rows * in_features));
    float *scales = malloc((size_t)(rows * blocks) * sizeof(float)), *correction = malloc((size_t)rows * sizeof(float));
    int status = 2; /* out of memory, unless all three came */
    if (codes && scales && correction) {
        const BlockActivations a = {codes, scales, correction, in_features};
        const int64_t vectors = (out_features + 15) / 16, vec_bytes = in_features / 4 * 64;
        const int64_t tiles = (vectors + BLOCK_VECS - 1) / BLOCK_VECS, tile_bytes = BLOCK_VECS * vec_bytes;
        const int64_t weight_bytes = vectors * vec_bytes;
#pragma omp parallel num_threads(threads)
        {
            /* Each thread's tiles are a run of its own, so that it knows which it takes next. */
            const int64_t team = omp_get_num_threads(), per = (tiles + team - 1) / team;
            const int64_t first = omp_get_thread_num() * per, end = first + per < tiles ? first + per : tiles;
            if (first < end) /* while the activations are rounded */
                prefetch_to_l2(packed + first * tile_bytes, bytes_ahead(first, end, tile_bytes, weight_bytes));
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; ++r)
                correction[r] = quantize_blocks(x, x_bf16, r, in_features, codes + r * in_features, scales + r * blocks);
            for (int64_t panel = 0; panel < rows; panel += ROW_PANEL) {
                const int64_t panel_rows = rows - panel < ROW_PANEL ? rows - panel : ROW_PANEL;
                for (int64_t t = first; t < end; ++t) {
                    const int64_t v0 = t * BLOCK_VECS, vecs = vectors - v0 < BLOCK_VECS ? vectors - v0 : BLOCK_VECS;
                    /* After the run's last tile its first, for the next panel of rows. */
                    const int64_t next = t + 1 < end ? t + 1 : panel + ROW_PANEL < rows ? first : end;
                    block_tile(&a, panel, panel_rows, packed, vec_bytes, v0, vecs, w_scale, bias, y, y_bf16,
                               out_features, next * tile_bytes, bytes_ahead(next, end, tile_bytes, weight_bytes));
                }
            }
        }
        status = 0;
    }
    free(codes);
    free(scales);
    free(correction);
    return status;
#else
    (void)x, (void)x_bf16, (void)packed, (void)w_scale, (void)bias, (void)y, (void)y_bf16, (void)rows;
    (void)out_features, (void)in_features, (void)num_threads;
    return 3;
#endif
}
