/* y = x @ dequant(w)^T (+ bias) with w kept in a GGUF file's quantized blocks, on CPU.
 *
 * The formats (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) and their layouts: gguf_blocks.h. Every
 * dequantized value is exact in float32, so a value expanded here equals the one a float32
 * conversion of the file holds, bit for bit. Rows are expanded in sub-blocks of 32 values (a
 * K-quant super-block holds eight), each as two vectors of 16 floats.
 *
 * Activations, accumulation and output are float32. Built with -fopenmp (see paged_attention.h).
 *
 * Two paths:
 * - up to STREAM_ROWS rows (single streams, small decode batches) the layer is one pass over its
 *   quantized bytes: each thread takes a contiguous run of output features, expands each sub-block
 *   into two vectors of 16 floats in registers and multiplies it with every row of x at once.
 *   Decoding is bound by the bytes of weight read, and this reads a sixth to a quarter of float32's.
 * - with more rows, each thread expands a tile of TILE_OUT output features into a small float32
 *   scratch (row-major, so the expansion is plain vector stores), then runs a register-blocked
 *   product of 4 rows x 4 features over it: 16 accumulators, 8 loads per 16 FMAs. Rows go in
 *   chunks that stay in L2 while every tile passes over them; a tile is expanded once per chunk.
 * No float32 copy of a whole weight exists at any time. Without AVX-512 a portable expansion
 * (dequantize_sub_block) and plain loops compute the same values.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"
#include "kernel_limits.h"
#include "cross_calls.h"

#define TILE_OUT 16
#define MICRO 4          /* rows and features of the register-blocked product */
#define ROW_CHUNK 256    /* rows of x kept hot while every tile passes over them */

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    /* IEEE binary16 -> binary32, subnormals included (exact: every half is a float). */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa) {
        int shift = 0;
        uint32_t m = mantissa;
        while (!(m & 0x400u)) { m <<= 1; ++shift; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((m & 0x3ffu) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Sub-block b of a row: its 32 values, portable; the vector path below computes the same values. */
static inline void dequantize_sub_block(const uint8_t *row, int64_t b, const int format, float *out) {
    const uint8_t *block = sub_block_home(row, b, format);
    const int part = sub_block_part(b, format);
    if (format == FORMAT_Q8_0) {
        const float d = half_to_float(block);
        for (int j = 0; j < SUB_BLOCK; ++j) out[j] = (float)(int8_t)block[2 + j] * d;
    } else if (format == FORMAT_Q4_K) {
        int scale, min;
        q4k_scale_min(block + 4, part, &scale, &min);
        const float d = half_to_float(block) * (float)scale, m = -half_to_float(block + 2) * (float)min;
        const uint8_t *codes = block + 16 + 32 * (part / 2);
        const int shift = 4 * (part % 2);
        for (int j = 0; j < SUB_BLOCK; ++j) out[j] = __builtin_fmaf((float)((codes[j] >> shift) & 0x0f), d, m);
    } else if (format == FORMAT_Q6_K) {
        const int half = part / 4, run = part % 4;
        const uint8_t *low = block + 64 * half + 32 * (run % 2), *high = block + 128 + 32 * half;
        const float d = half_to_float(block + 208);
        for (int j = 0; j < SUB_BLOCK; ++j) {
            const int q = ((low[j] >> (4 * (run / 2))) & 0x0f) | (((high[j] >> (2 * run)) & 3) << 4);
            out[j] = (float)(q - 32) * (d * (float)(int8_t)block[192 + 2 * part + j / 16]);
        }
    } else {
        const float d = half_to_float(block);
        const float m = format == FORMAT_Q4_1 ? half_to_float(block + 2) : (format == FORMAT_Q5_0 ? -16.0f : -8.0f) * d;
        const uint8_t *codes = block + nibbles_at(format);
        uint32_t fifth = 0;
        if (format == FORMAT_Q5_0) memcpy(&fifth, block + 2, sizeof fifth);
        for (int j = 0; j < SUB_BLOCK / 2; ++j) {
            const int low = (codes[j] & 0x0f) | (int)((fifth >> j) & 1) << 4;
            const int high = (codes[j] >> 4) | (int)((fifth >> (j + 16)) & 1) << 4;
            out[j] = __builtin_fmaf((float)low, d, m);
            out[j + SUB_BLOCK / 2] = __builtin_fmaf((float)high, d, m);
        }
    }
}

#if defined(__AVX512F__)
static inline __m512 bytes_to_floats(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }

/* What a block's sub-blocks share, decoded once per block: Q4_K's scales and mins (q4k_scales_mins). */
static inline __attribute__((always_inline)) __m512 block_header(const uint8_t *block, const int format) {
    if (format != FORMAT_Q4_K) return _mm512_setzero_ps();
    return q4k_scales_mins(block + 4, half_to_float(block), half_to_float(block + 2));
}

/* Sub-block b of a row as two vectors: features 0-15 and 16-31, `header` its block's. FORMAT is a
 * constant at every call. */
static inline __attribute__((always_inline)) void sub_block_vectors(const uint8_t *row, int64_t b, const int format,
                                                                    __m512 header, __m512 *lo, __m512 *hi) {
    const uint8_t *block = sub_block_home(row, b, format);
    const int part = sub_block_part(b, format);
    const __m128i nibble = _mm_set1_epi8(0x0f);
    if (format == FORMAT_Q8_0) {
        const __m512 d = _mm512_set1_ps(half_to_float(block));
        const __m128i first = _mm_loadu_si128((const __m128i *)(block + 2));
        const __m128i second = _mm_loadu_si128((const __m128i *)(block + 18));
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)), d);
    } else if (format == FORMAT_Q4_K) {
        const __m512 d = _mm512_permutexvar_ps(_mm512_set1_epi32(part), header);
        const __m512 m = _mm512_permutexvar_ps(_mm512_set1_epi32(part + 8), header);
        const uint8_t *codes = block + 16 + 32 * (part / 2);
        const __m128i shift = _mm_cvtsi32_si128(4 * (part % 2));
        const __m128i first = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)codes), shift), nibble);
        const __m128i second =
            _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(codes + 16)), shift), nibble);
        *lo = _mm512_fmadd_ps(bytes_to_floats(first), d, m);
        *hi = _mm512_fmadd_ps(bytes_to_floats(second), d, m);
    } else if (format == FORMAT_Q6_K) {
        const int half = part / 4, run = part % 4;
        const uint8_t *low = block + 64 * half + 32 * (run % 2), *high = block + 128 + 32 * half;
        const __m128i low_shift = _mm_cvtsi32_si128(4 * (run / 2)), high_shift = _mm_cvtsi32_si128(2 * run);
        const float d = half_to_float(block + 208);
        const __m512i offset = _mm512_set1_epi32(32);
        __m512 *out[2] = {lo, hi};
        for (int t = 0; t < 2; ++t) {
            const __m128i l_bytes = _mm_loadu_si128((const __m128i *)(low + 16 * t));
            const __m128i h_bytes = _mm_loadu_si128((const __m128i *)(high + 16 * t));
            const __m128i l = _mm_and_si128(_mm_srl_epi16(l_bytes, low_shift), nibble);
            const __m128i h = _mm_and_si128(_mm_srl_epi16(h_bytes, high_shift), _mm_set1_epi8(3));
            const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_or_si128(l, _mm_slli_epi16(h, 4))), offset);
            const float scale = d * (float)(int8_t)block[192 + 2 * part + t];
            *out[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(scale));
        }
    } else {
        const float d_scalar = half_to_float(block);
        const __m512 d = _mm512_set1_ps(d_scalar);
        const __m512 m = _mm512_set1_ps(format == FORMAT_Q4_1 ? half_to_float(block + 2)
                                                              : (format == FORMAT_Q5_0 ? -16.0f : -8.0f) * d_scalar);
        const __m128i codes = _mm_loadu_si128((const __m128i *)(block + nibbles_at(format)));
        __m512i low = _mm512_cvtepu8_epi32(_mm_and_si128(codes, nibble));
        __m512i high = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(codes, 4), nibble));
        if (format == FORMAT_Q5_0) {
            uint32_t fifth;
            memcpy(&fifth, block + 2, sizeof fifth);
            const __m512i sixteen = _mm512_set1_epi32(16);
            low = _mm512_mask_add_epi32(low, (__mmask16)fifth, low, sixteen);
            high = _mm512_mask_add_epi32(high, (__mmask16)(fifth >> 16), high, sixteen);
        }
        *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), d, m);
        *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), d, m);
    }
}
#endif

/* ---- 1 to STREAM_ROWS rows: one streaming pass over the quantized bytes ---- */

static inline __attribute__((always_inline)) void stream_features(const float *x, const uint8_t *w, const float *bias,
                                                                  float *y, int64_t first, int64_t last,
                                                                  int64_t out_features, int64_t in_features,
                                                                  const int format, const int ROWS) {
    const int64_t blocks = in_features / SUB_BLOCK, bytes = row_bytes(format, in_features);
    const int per_block = block_values(format) / SUB_BLOCK;
    (void)per_block; /* the vector loop's */
    for (int64_t o = first; o < last; ++o) {
        const uint8_t *row = w + o * bytes;
        float sums[STREAM_ROWS];
#if defined(__AVX512F__)
        __m512 acc[STREAM_ROWS][2];
        for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t first_sub = 0; first_sub < blocks; first_sub += per_block) {
            const __m512 header = block_header(sub_block_home(row, first_sub, format), format);
            for (int64_t b = first_sub; b < first_sub + per_block; ++b) {
                __m512 lo, hi;
                sub_block_vectors(row, b, format, header, &lo, &hi);
                for (int r = 0; r < ROWS; ++r) {
                    const float *xb = x + r * in_features + b * SUB_BLOCK;
                    acc[r][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[r][1]);
                }
            }
        }
        for (int r = 0; r < ROWS; ++r) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#else
        for (int r = 0; r < ROWS; ++r) sums[r] = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
            float values[SUB_BLOCK];
            dequantize_sub_block(row, b, format, values);
            for (int r = 0; r < ROWS; ++r) {
                const float *xb = x + r * in_features + b * SUB_BLOCK;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int j = 0; j < SUB_BLOCK; ++j) acc += values[j] * xb[j];
                sums[r] += acc;
            }
        }
#endif
        for (int r = 0; r < ROWS; ++r) y[r * out_features + o] = sums[r] + (bias ? bias[o] : 0.0f);
    }
}

#define STREAM(FORMAT, ROWS) stream_features(x, w, bias, y, first, last, out_features, in_features, FORMAT, ROWS)
#define STREAM_FORMAT(ROWS) FOR_EACH_FORMAT(format, STREAM, ROWS)

static void stream_range(const float *x, const uint8_t *w, const float *bias, float *y, int64_t rows, int64_t first,
                         int64_t last, int64_t out_features, int64_t in_features, int format) {
    switch (rows) {
    case 1: STREAM_FORMAT(1) break;
    case 2: STREAM_FORMAT(2) break;
    case 3: STREAM_FORMAT(3) break;
    case 4: STREAM_FORMAT(4) break;
    case 5: STREAM_FORMAT(5) break;
    default: STREAM_FORMAT(6) break;
    }
}
_Static_assert(STREAM_ROWS == 6, "stream_range lists the row counts up to STREAM_ROWS");

/* ---- more rows: expand a tile of features, then a register-blocked product ---- */

/* One row of `blocks` sub-blocks as float32. */
static inline __attribute__((always_inline)) void expand_row(const uint8_t *row, int64_t blocks, const int format,
                                                             float *out) {
#if defined(__AVX512F__)
    const int per_block = block_values(format) / SUB_BLOCK;
    for (int64_t first_sub = 0; first_sub < blocks; first_sub += per_block) {
        const __m512 header = block_header(sub_block_home(row, first_sub, format), format);
        for (int64_t b = first_sub; b < first_sub + per_block; ++b) {
            __m512 lo, hi;
            sub_block_vectors(row, b, format, header, &lo, &hi);
            _mm512_storeu_ps(out + b * SUB_BLOCK, lo);
            _mm512_storeu_ps(out + b * SUB_BLOCK + 16, hi);
        }
    }
#else
    for (int64_t b = 0; b < blocks; ++b) dequantize_sub_block(row, b, format, out + b * SUB_BLOCK);
#endif
}

/* Features first .. first + count - 1 as float32 rows of in_features. */
static void expand_rows(const uint8_t *w, int format, int64_t first, int64_t count, int64_t in_features,
                        float *tile) {
    const int64_t blocks = in_features / SUB_BLOCK, bytes = row_bytes(format, in_features);
    for (int64_t j = 0; j < count; ++j) {
        const uint8_t *row = w + (first + j) * bytes;
        float *out = tile + j * in_features;
        switch (format) {
        case FORMAT_Q4_0: expand_row(row, blocks, FORMAT_Q4_0, out); break;
        case FORMAT_Q4_1: expand_row(row, blocks, FORMAT_Q4_1, out); break;
        case FORMAT_Q5_0: expand_row(row, blocks, FORMAT_Q5_0, out); break;
        case FORMAT_Q4_K: expand_row(row, blocks, FORMAT_Q4_K, out); break;
        case FORMAT_Q6_K: expand_row(row, blocks, FORMAT_Q6_K, out); break;
        default: expand_row(row, blocks, FORMAT_Q8_0, out); break;
        }
    }
}

static void expand_tile(const uint8_t *w, int format, int64_t first, int64_t count, int64_t in_features,
                        float *tile) {
    expand_rows(w, format, first, count, in_features, tile);
    /* The last tile of a layer may be partial: zero features keep the product's shape fixed. */
    memset(tile + count * in_features, 0, (size_t)(TILE_OUT - count) * in_features * sizeof(float));
}

/* dots[r][f] = x row r . tile feature f, for ROWS rows and MICRO features (in_features % 32 == 0). */
static inline __attribute__((always_inline)) void micro_product(const float *x, const float *tile,
                                                                int64_t in_features, float dots[MICRO][MICRO],
                                                                const int ROWS) {
#if defined(__AVX512F__)
    __m512 acc[MICRO][MICRO];
    for (int r = 0; r < ROWS; ++r)
        for (int f = 0; f < MICRO; ++f) acc[r][f] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in_features; k += 16) {
        __m512 wv[MICRO];
        for (int f = 0; f < MICRO; ++f) wv[f] = _mm512_loadu_ps(tile + f * in_features + k);
        for (int r = 0; r < ROWS; ++r) {
            const __m512 xv = _mm512_loadu_ps(x + r * in_features + k);
            for (int f = 0; f < MICRO; ++f) acc[r][f] = _mm512_fmadd_ps(xv, wv[f], acc[r][f]);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int f = 0; f < MICRO; ++f) dots[r][f] = _mm512_reduce_add_ps(acc[r][f]);
#else
    for (int r = 0; r < ROWS; ++r)
        for (int f = 0; f < MICRO; ++f) {
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < in_features; ++k) acc += x[r * in_features + k] * tile[f * in_features + k];
            dots[r][f] = acc;
        }
#endif
}

static void tile_product(const float *x, int64_t rows, const float *tile, int64_t first, int64_t count,
                         const float *bias, float *y, int64_t out_features, int64_t in_features) {
    for (int64_t r0 = 0; r0 < rows; r0 += MICRO) {
        const int64_t row_count = rows - r0 < MICRO ? rows - r0 : MICRO;
        const float *xr = x + r0 * in_features;
        for (int64_t f0 = 0; f0 < count; f0 += MICRO) {
            float dots[MICRO][MICRO];
            const float *tf = tile + f0 * in_features;
            switch (row_count) {
            case 1: micro_product(xr, tf, in_features, dots, 1); break;
            case 2: micro_product(xr, tf, in_features, dots, 2); break;
            case 3: micro_product(xr, tf, in_features, dots, 3); break;
            default: micro_product(xr, tf, in_features, dots, 4); break;
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

/* x [rows, in] float32, w [out, row_bytes] in `format` (gguf_blocks.h), bias [out] or NULL, y [rows, out].
 * Returns 0, 1 for a shape or format it cannot take, 2 when its scratch cannot be allocated. */
int quantized_linear_f32(const float *x, const uint8_t *w, int format, const float *bias, float *y, int64_t rows,
                         int64_t out_features, int64_t in_features, int num_threads) {
    if (!readable_shape(format, in_features) || rows < 0 || out_features < 0) return 1;
    if (rows == 0 || out_features == 0) return 0;
    if (rows <= STREAM_ROWS) {
#pragma omp parallel num_threads(num_threads)
        {
            const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
            stream_range(x, w, bias, y, rows, out_features * t / threads, out_features * (t + 1) / threads,
                         out_features, in_features, format);
        }
        return 0;
    }
    const int64_t tiles = (out_features + TILE_OUT - 1) / TILE_OUT;
    const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    float *scratch = aligned_alloc(64, (size_t)threads * TILE_OUT * in_features * sizeof(float));
    if (!scratch) return 2;
#pragma omp parallel num_threads(threads)
    {
        float *tile = scratch + (size_t)omp_get_thread_num() * TILE_OUT * in_features;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
            const int64_t chunk = rows - r0 < ROW_CHUNK ? rows - r0 : ROW_CHUNK;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; ++t) {
                const int64_t first = t * TILE_OUT;
                const int64_t count = out_features - first < TILE_OUT ? out_features - first : TILE_OUT;
                expand_tile(w, format, first, count, in_features, tile);
                tile_product(x + r0 * in_features, chunk, tile, first, count, bias, y + r0 * out_features,
                             out_features, in_features);
            }
        }
    }
    free(scratch);
    return 0;
}

/* out[i] = dequant(w)[ids[i]]: the rows an embedding lookup needs, from a table held quantized.
 * Returns 1 for a bad format or shape, or an id outside [0, out_features). */
int quantized_rows_f32(const uint8_t *w, int format, const int64_t *ids, int64_t count, int64_t out_features,
                       int64_t in_features, float *out, int num_threads) {
    if (!readable_shape(format, in_features) || count < 0) return 1;
    for (int64_t i = 0; i < count; ++i)
        if (ids[i] < 0 || ids[i] >= out_features) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count > 16)
    for (int64_t i = 0; i < count; ++i) expand_rows(w, format, ids[i], 1, in_features, out + i * in_features);
    return 0;
}
