/* GGUF Q4_0 / Q4_1 / Q8_0 linears on integer dot products (AVX-512 VNNI).
 *
 * quantized_linear.c expands every weight block to floats and multiplies in float32: 16 products
 * per instruction, plus the expansion. Here the activations are quantized instead, per row and per
 * block of 32 features, to int8 with one float scale each (da = max |x| / 127, codes rounded to
 * nearest, ties to even), and each pair of blocks is one VPDPBUSD: 64 int8 products summed into 16
 * int32 lanes, 8 lanes per block. A block's sum is then scaled by dw * da in float32 and accumulated.
 *
 * VPDPBUSD multiplies unsigned bytes by signed bytes. Activations are stored offset by 128 (u = a +
 * 128, in [1, 255]) and weights are signed codes w (Q8_0: its bytes; Q4_0: nibble - 8; Q4_1: the
 * nibble), so sum(u * w) = sum(a * w) + 128 sum(w). The correction -128 sum(w) is the accumulator
 * each block's dot starts from, computed once per weight block (itself a VPDPBUSD of 128s by w) and
 * reused by every row. Q4_1's offset m adds m * da * sum(a) per block, also per row: sum(a) is
 * taken when the activations are quantized.
 *
 * Exact apart from float32 rounding: each block's integer sum is exact, so the result equals
 * dequant(W) times the int8-rounded activations up to the order of float32 accumulation.
 *
 * Two paths, as in quantized_linear.c: up to SMALL_ROWS rows one streaming pass over the blocks
 * (each thread a run of output features; a block pair is unpacked in registers and used by every
 * row); with more rows each thread unpacks a tile of TILE_OUT features once per chunk of rows into a
 * scratch of ready vectors (codes, corrections, scales) and runs 4 rows x 4 features over it.
 * Without VNNI this file builds to a stub that reports so; callers keep quantized_linear.c.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__) &&  \
    defined(__F16C__)
#define HAVE_INTEGER_DOT 1
#include <immintrin.h>
#else
#define HAVE_INTEGER_DOT 0
#endif

int vmesh_integer_dot_available(void) { return HAVE_INTEGER_DOT; }

#if HAVE_INTEGER_DOT

enum { FORMAT_Q4_0 = 2, FORMAT_Q4_1 = 3, FORMAT_Q8_0 = 8 };
#define QBLOCK 32
#define SMALL_ROWS 4
#define TILE_OUT 16
#define MICRO 4
#define ROW_CHUNK 256

static int block_bytes(int format) {
    return format == FORMAT_Q4_0 ? 18 : format == FORMAT_Q4_1 ? 20 : format == FORMAT_Q8_0 ? 34 : 0;
}

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* Activations, quantized: per row `pairs` vectors of 64 offset codes, and per pair 16 lanes of
 * scales (block 2p's da in lanes 0-7, 2p + 1's in 8-15) and of da * sum(a) (in lanes 0 and 8 only,
 * so that the lanes' sum counts it once per block). A missing last block is zeros throughout. */
typedef struct {
    uint8_t *codes;
    float *scales;
    float *offsets;
    int64_t pairs;
} Activations;

static void quantize_row(const float *x, int64_t blocks, int64_t pairs, uint8_t *codes, float *scales,
                         float *offsets) {
    for (int64_t b = 0; b < 2 * pairs; ++b) {
        uint8_t *out = codes + b * QBLOCK;
        float *scale = scales + (b / 2) * 16 + (b % 2) * 8, *offset = offsets + (b / 2) * 16 + (b % 2) * 8;
        memset(offset, 0, 8 * sizeof(float));
        if (b >= blocks) {
            memset(out, 128, QBLOCK);
            for (int j = 0; j < 8; ++j) scale[j] = 0.0f;
            continue;
        }
        const __m512 lo = _mm512_loadu_ps(x + b * QBLOCK), hi = _mm512_loadu_ps(x + b * QBLOCK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = amax / 127.0f, inverse = amax > 0.0f ? 1.0f / d : 0.0f;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inverse)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inverse)));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        const __m128i flip = _mm_set1_epi8((char)0x80);
        _mm_storeu_si128((__m128i *)out, _mm_xor_si128(_mm512_cvtepi32_epi8(qlo), flip));
        _mm_storeu_si128((__m128i *)(out + 16), _mm_xor_si128(_mm512_cvtepi32_epi8(qhi), flip));
        for (int j = 0; j < 8; ++j) scale[j] = d;
        offset[0] = d * (float)sum;
    }
}

static int quantize_activations(const float *x, int64_t rows, int64_t in_features, Activations *a, int threads) {
    const int64_t blocks = in_features / QBLOCK;
    a->pairs = (blocks + 1) / 2;
    a->codes = aligned_alloc(64, (size_t)rows * a->pairs * 64);
    a->scales = aligned_alloc(64, (size_t)rows * a->pairs * 16 * sizeof(float));
    a->offsets = aligned_alloc(64, (size_t)rows * a->pairs * 16 * sizeof(float));
    if (!a->codes || !a->scales || !a->offsets) return 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 16)
    for (int64_t r = 0; r < rows; ++r)
        quantize_row(x + r * in_features, blocks, a->pairs, a->codes + r * a->pairs * 64,
                     a->scales + r * a->pairs * 16, a->offsets + r * a->pairs * 16);
    return 0;
}

static void free_activations(Activations *a) {
    free(a->codes);
    free(a->scales);
    free(a->offsets);
}

/* One block pair of a weight row, ready for VPDPBUSD: signed codes, the accumulator start
 * (-128 sum(w) per block), dw per lane, and Q4_1's m per lane. FORMAT is a constant at every call. */
typedef struct {
    __m512i codes, start;
    __m512 scale, offset;
} WeightPair;

static inline __attribute__((always_inline)) __m256i block_codes(const uint8_t *block, const int format) {
    if (format == FORMAT_Q8_0) return _mm256_loadu_si256((const __m256i *)(block + 2));
    const __m128i packed = _mm_loadu_si128((const __m128i *)(block + (format == FORMAT_Q4_1 ? 4 : 2)));
    const __m128i nibble = _mm_set1_epi8(0x0f);
    __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble), _mm_and_si128(packed, nibble));
    if (format == FORMAT_Q4_0) codes = _mm256_sub_epi8(codes, _mm256_set1_epi8(8));
    return codes;
}

static inline __attribute__((always_inline)) WeightPair weight_pair(const uint8_t *row, int64_t pair, int64_t blocks,
                                                                    const int format) {
    const int bytes = block_bytes(format);
    const uint8_t *first = row + 2 * pair * bytes, *second = first + bytes;
    const int has_second = 2 * pair + 1 < blocks;
    WeightPair w;
    w.codes = _mm512_inserti64x4(_mm512_castsi256_si512(block_codes(first, format)),
                                 has_second ? block_codes(second, format) : _mm256_setzero_si256(), 1);
    const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), w.codes);
    w.start = _mm512_sub_epi32(_mm512_setzero_si512(), sums);
    w.scale = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(half(first)),
                                   _mm512_set1_ps(has_second ? half(second) : 0.0f));
    w.offset = format == FORMAT_Q4_1 ? _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(half(first + 2)),
                                                            _mm512_set1_ps(has_second ? half(second + 2) : 0.0f))
                                     : _mm512_setzero_ps();
    return w;
}

/* acc += the pair's contribution for one row. */
static inline __attribute__((always_inline)) __m512 pair_product(__m512 acc, __m512i codes, __m512i start, __m512 scale,
                                                                 __m512 offset, const uint8_t *a, const float *a_scale,
                                                                 const float *a_offset, const int format) {
    const __m512i dot = _mm512_dpbusd_epi32(start, _mm512_load_si512((const void *)a), codes);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_load_ps(a_scale)), acc);
    if (format == FORMAT_Q4_1) acc = _mm512_fmadd_ps(offset, _mm512_load_ps(a_offset), acc);
    return acc;
}

/* ---- 1 to SMALL_ROWS rows ---- */

static inline __attribute__((always_inline)) void stream_features(const Activations *a, const uint8_t *w,
                                                                  const float *bias, float *y, int64_t first,
                                                                  int64_t last, int64_t out_features,
                                                                  int64_t in_features, const int format,
                                                                  const int ROWS) {
    const int64_t blocks = in_features / QBLOCK, row_bytes = blocks * block_bytes(format), pairs = a->pairs;
    for (int64_t o = first; o < last; ++o) {
        const uint8_t *row = w + o * row_bytes;
        __m512 acc[SMALL_ROWS];
        for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; ++p) {
            const WeightPair wp = weight_pair(row, p, blocks, format);
            for (int r = 0; r < ROWS; ++r)
                acc[r] = pair_product(acc[r], wp.codes, wp.start, wp.scale, wp.offset, a->codes + (r * pairs + p) * 64,
                                      a->scales + (r * pairs + p) * 16, a->offsets + (r * pairs + p) * 16, format);
        }
        for (int r = 0; r < ROWS; ++r) y[r * out_features + o] = _mm512_reduce_add_ps(acc[r]) + (bias ? bias[o] : 0.0f);
    }
}

#define STREAM_FORMAT(ROWS)                                                                                       \
    switch (format) {                                                                                             \
    case FORMAT_Q4_0: stream_features(a, w, bias, y, first, last, out_features, in_features, FORMAT_Q4_0, ROWS); break; \
    case FORMAT_Q4_1: stream_features(a, w, bias, y, first, last, out_features, in_features, FORMAT_Q4_1, ROWS); break; \
    default: stream_features(a, w, bias, y, first, last, out_features, in_features, FORMAT_Q8_0, ROWS); break;    \
    }

static void stream_range(const Activations *a, const uint8_t *w, const float *bias, float *y, int64_t rows,
                         int64_t first, int64_t last, int64_t out_features, int64_t in_features, int format) {
    switch (rows) {
    case 1: STREAM_FORMAT(1) break;
    case 2: STREAM_FORMAT(2) break;
    case 3: STREAM_FORMAT(3) break;
    default: STREAM_FORMAT(4) break;
    }
}

/* ---- more rows: a tile of unpacked weight pairs, reused by every row of a chunk ---- */

static void unpack_tile(const uint8_t *w, int format, int64_t first, int64_t count, int64_t in_features,
                        int64_t pairs, WeightPair *tile) {
    const int64_t blocks = in_features / QBLOCK, row_bytes = blocks * block_bytes(format);
    for (int64_t f = 0; f < TILE_OUT; ++f)
        for (int64_t p = 0; p < pairs; ++p) {
            WeightPair *out = tile + f * pairs + p;
            if (f >= count) {  /* a partial last tile: zero features keep the product's shape fixed */
                memset(out, 0, sizeof *out);
                continue;
            }
            const uint8_t *row = w + (first + f) * row_bytes;
            switch (format) {
            case FORMAT_Q4_0: *out = weight_pair(row, p, blocks, FORMAT_Q4_0); break;
            case FORMAT_Q4_1: *out = weight_pair(row, p, blocks, FORMAT_Q4_1); break;
            default: *out = weight_pair(row, p, blocks, FORMAT_Q8_0); break;
            }
        }
}

static inline __attribute__((always_inline)) void micro_product(const Activations *a, int64_t r0, const WeightPair *tile,
                                                                int64_t pairs, float dots[MICRO][MICRO],
                                                                const int format, const int ROWS) {
    __m512 acc[MICRO][MICRO];
    for (int r = 0; r < ROWS; ++r)
        for (int f = 0; f < MICRO; ++f) acc[r][f] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        for (int r = 0; r < ROWS; ++r) {
            const int64_t at = (r0 + r) * pairs + p;
            for (int f = 0; f < MICRO; ++f) {
                const WeightPair *wp = tile + f * pairs + p;
                acc[r][f] = pair_product(acc[r][f], wp->codes, wp->start, wp->scale, wp->offset, a->codes + at * 64,
                                         a->scales + at * 16, a->offsets + at * 16, format);
            }
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int f = 0; f < MICRO; ++f) dots[r][f] = _mm512_reduce_add_ps(acc[r][f]);
}

#define MICRO_ROWS(FORMAT)                                                                                        \
    switch (row_count) {                                                                                          \
    case 1: micro_product(a, r0, tf, pairs, dots, FORMAT, 1); break;                                              \
    case 2: micro_product(a, r0, tf, pairs, dots, FORMAT, 2); break;                                              \
    case 3: micro_product(a, r0, tf, pairs, dots, FORMAT, 3); break;                                              \
    default: micro_product(a, r0, tf, pairs, dots, FORMAT, 4); break;                                             \
    }

static void tile_product(const Activations *a, int64_t row_first, int64_t rows, const WeightPair *tile, int64_t first,
                         int64_t count, const float *bias, float *y, int64_t out_features, int format) {
    const int64_t pairs = a->pairs;
    for (int64_t r0 = row_first; r0 < row_first + rows; r0 += MICRO) {
        const int64_t row_count = row_first + rows - r0 < MICRO ? row_first + rows - r0 : MICRO;
        for (int64_t f0 = 0; f0 < count; f0 += MICRO) {
            float dots[MICRO][MICRO];
            const WeightPair *tf = tile + f0 * pairs;
            switch (format) {
            case FORMAT_Q4_0: MICRO_ROWS(FORMAT_Q4_0) break;
            case FORMAT_Q4_1: MICRO_ROWS(FORMAT_Q4_1) break;
            default: MICRO_ROWS(FORMAT_Q8_0) break;
            }
            const int64_t features = count - f0 < MICRO ? count - f0 : MICRO;
            for (int64_t r = 0; r < row_count; ++r)
                for (int64_t f = 0; f < features; ++f) {
                    const int64_t o = first + f0 + f;
                    y[(r0 + r) * out_features + o] = dots[r][f] + (bias ? bias[o] : 0.0f);
                }
        }
    }
}

#endif /* HAVE_INTEGER_DOT */

/* quantized_linear_f32's contract (x [rows, in] float32, w GGUF blocks, bias or NULL, y [rows, out])
 * with x rounded to int8 per block of 32 first. Returns 0, 1 for a shape or format it cannot take,
 * 2 when its scratch cannot be allocated, 3 when built without VNNI. */
int quantized_linear_int8_f32(const float *x, const uint8_t *w, int format, const float *bias, float *y,
                              int64_t rows, int64_t out_features, int64_t in_features, int num_threads) {
#if HAVE_INTEGER_DOT
    if (!block_bytes(format) || rows < 0 || out_features < 0 || in_features <= 0 || in_features % QBLOCK) return 1;
    if (rows == 0 || out_features == 0) return 0;
    const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    Activations a;
    if (quantize_activations(x, rows, in_features, &a, threads)) {
        free_activations(&a);
        return 2;
    }
    if (rows <= SMALL_ROWS) {
#pragma omp parallel num_threads(threads)
        {
            const int64_t count = omp_get_num_threads(), t = omp_get_thread_num();
            stream_range(&a, w, bias, y, rows, out_features * t / count, out_features * (t + 1) / count, out_features,
                         in_features, format);
        }
        free_activations(&a);
        return 0;
    }
    const int64_t tiles = (out_features + TILE_OUT - 1) / TILE_OUT;
    WeightPair *scratch = aligned_alloc(64, (size_t)threads * TILE_OUT * a.pairs * sizeof(WeightPair));
    if (!scratch) {
        free_activations(&a);
        return 2;
    }
#pragma omp parallel num_threads(threads)
    {
        WeightPair *tile = scratch + (size_t)omp_get_thread_num() * TILE_OUT * a.pairs;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
            const int64_t chunk = rows - r0 < ROW_CHUNK ? rows - r0 : ROW_CHUNK;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; ++t) {
                const int64_t first = t * TILE_OUT;
                const int64_t count = out_features - first < TILE_OUT ? out_features - first : TILE_OUT;
                unpack_tile(w, format, first, count, in_features, a.pairs, tile);
                tile_product(&a, r0, chunk, tile, first, count, bias, y, out_features, format);
            }
        }
    }
    free(scratch);
    free_activations(&a);
    return 0;
#else
    (void)x, (void)w, (void)format, (void)bias, (void)y, (void)rows, (void)out_features, (void)in_features;
    (void)num_threads;
    return 3;
#endif
}
