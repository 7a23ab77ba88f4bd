/* GGUF blocks (gguf_blocks.h: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) on integer dot products (AVX-512 VNNI).
 *
 * quantized_linear.c expands every weight block to floats and multiplies in float32: 16 products
 * per instruction, plus the expansion. Here the activations are quantized instead, per row and per
 * block of 32 features, to int8 codes a in [-127, 127] with one float scale da each (max |x| / 127,
 * rounded to nearest, ties to even), and each pair of blocks is one VPDPBUSD: 64 int8 products
 * summed into 16 int32 lanes, 8 lanes per block, 4 per 16 features. Each lane's sum is then scaled by
 * dw * da in float32 and accumulated. A weight's sub-block of 32 (a 32-value format's block, an
 * eighth of a K-quant super-block) meets one activation block; Q6_K's sub-blocks of 16 each scale
 * their 4 lanes.
 *
 * VPDPBUSD multiplies unsigned bytes by signed bytes: the weights are the unsigned side, the
 * activations the signed one. The formats whose value is (q - K) dw (Q4_0: K = 8, Q5_0: 16, Q6_K:
 * 32; Q8_0's signed byte w is flipped to q = w + 128, K = 128) give sum(q a) = sum((q - K) a) +
 * K sum(a): the correction -K sum(a), per 16 features so that Q6_K's two scales of a block each get
 * their own, is the accumulator the lanes' dot starts from, taken once when the row is quantized,
 * so it costs nothing per weight. Q4_1's value q d + m and Q4_K's q (d s) - dmin m instead add an
 * offset (m, -dmin m) times da sum(a) per block: a short product over blocks, added per output.
 *
 * Exact apart from float32 rounding: each block's integer sum is exact, so the result equals
 * dequant(W) times the int8-rounded activations up to the order of float32 accumulation.
 *
 * Two paths, as in quantized_linear.c: up to STREAM_ROWS rows one streaming pass over the blocks
 * (each thread a run of output features, 4 side by side for one row and 2 for more; a block pair is
 * unpacked in registers and used by every row, the next features' bytes prefetched); with more rows each thread unpacks a tile of TILE_OUT features once per chunk of rows into a
 * scratch of ready vectors (codes and scales, pair by pair) and runs 3 rows x 4 features over it.
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

#include "gguf_blocks.h"
#include "kernel_limits.h"
#include "cross_calls.h"

int vmesh_integer_dot_available(void) { return HAVE_INTEGER_DOT; }

#if HAVE_INTEGER_DOT

#define TILE_OUT 16
#define MICRO_ROWS_N 3  /* rows x features of the micro product: 12 accumulators leave registers for */
#define MICRO 4         /* the features' codes and scales, which 4 x 4 spilled */
#define ROW_CHUNK 256

/* K of the formats whose value is (q - K) dw; 0 for those with an offset instead. */
static inline int code_offset(int format) {
    switch (format) {
    case FORMAT_Q4_0: return 8;
    case FORMAT_Q5_0: return 16;
    case FORMAT_Q6_K: return 32;
    case FORMAT_Q8_0: return 128;
    default: return 0;
    }
}

static inline int has_offset(int format) { return format == FORMAT_Q4_1 || format == FORMAT_Q4_K; }

/* Corrections per block of 32 in the tiled path: Q6_K's two scales each need their own. */
static inline int corrections_per_block(int format) { return format == FORMAT_Q6_K ? 2 : 1; }

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* Activations, quantized. Per row: `pairs` vectors of 64 signed codes; per pair 16 lanes of scales
 * (block 2p's da in lanes 0-7, 2p + 1's in 8-15), of accumulator starts (-K sum(a) over features
 * 0-15 of a block in its first lane, over 16-31 in its fifth: lanes 0, 4, 8 and 12, so that the
 * lanes' sum counts each once) and, for the offset formats, of da sum(a) (lanes 0 and 8).
 * The tiled path instead takes the corrections in float32 after its loop, from `padded` floats per
 * row (corrections_per_block per block, rounded up to 16): -K da sum(a) per block or half-block,
 * or the offset formats' da sum(a) per block. A missing last block is zeros throughout. */
typedef struct {
    int8_t *codes;
    float *scales, *offsets, *offsets_by_block;
    int32_t *starts;
    int64_t pairs, padded;
} Activations;

static void quantize_row(const float *x, int64_t blocks, const Activations *a, int64_t r, int correction,
                         int halves) {
    int8_t *codes = a->codes + r * a->pairs * 64;
    float *scales = a->scales + r * a->pairs * 16, *offsets = a->offsets + r * a->pairs * 16;
    int32_t *starts = a->starts + r * a->pairs * 16;
    float *by_block = a->offsets_by_block + r * a->padded;
    memset(codes, 0, (size_t)a->pairs * 64);
    memset(scales, 0, (size_t)a->pairs * 16 * sizeof(float));
    memset(offsets, 0, (size_t)a->pairs * 16 * sizeof(float));
    memset(starts, 0, (size_t)a->pairs * 16 * sizeof(int32_t));
    memset(by_block, 0, (size_t)a->padded * sizeof(float));
    for (int64_t b = 0; b < blocks; ++b) {
        const __m512 lo = _mm512_loadu_ps(x + b * SUB_BLOCK), hi = _mm512_loadu_ps(x + b * SUB_BLOCK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = amax / 127.0f, inverse = amax > 0.0f ? 1.0f / d : 0.0f;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inverse)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inverse)));
        const int sums[2] = {_mm512_reduce_add_epi32(qlo), _mm512_reduce_add_epi32(qhi)}, sum = sums[0] + sums[1];
        _mm_storeu_si128((__m128i *)(codes + b * SUB_BLOCK), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(codes + b * SUB_BLOCK + 16), _mm512_cvtepi32_epi8(qhi));
        const int64_t lane = (b / 2) * 16 + (b % 2) * 8;
        for (int j = 0; j < 8; ++j) scales[lane + j] = d;
        starts[lane] = -correction * sums[0];
        starts[lane + 4] = -correction * sums[1];
        offsets[lane] = d * (float)sum;
        if (halves == 2) {
            for (int t = 0; t < 2; ++t) by_block[2 * b + t] = -(float)correction * d * (float)sums[t];
        } else {
            by_block[b] = correction ? -(float)correction * d * (float)sum : d * (float)sum;
        }
    }
}

static int quantize_activations(const float *x, int64_t rows, int64_t in_features, int format, Activations *a,
                                int threads) {
    const int64_t blocks = in_features / SUB_BLOCK;
    const int halves = corrections_per_block(format);
    a->pairs = (blocks + 1) / 2;
    a->padded = (blocks * halves + 15) / 16 * 16;
    a->codes = aligned_alloc(64, (size_t)rows * a->pairs * 64);
    a->scales = aligned_alloc(64, (size_t)rows * a->pairs * 16 * sizeof(float));
    a->offsets = aligned_alloc(64, (size_t)rows * a->pairs * 16 * sizeof(float));
    a->starts = aligned_alloc(64, (size_t)rows * a->pairs * 16 * sizeof(int32_t));
    a->offsets_by_block = aligned_alloc(64, (size_t)rows * a->padded * sizeof(float));
    if (!a->codes || !a->scales || !a->offsets || !a->starts || !a->offsets_by_block) return 2;
    const int correction = code_offset(format);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 16)
    for (int64_t r = 0; r < rows; ++r) quantize_row(x + r * in_features, blocks, a, r, correction, halves);
    return 0;
}

static void free_activations(Activations *a) {
    free(a->codes);
    free(a->scales);
    free(a->offsets);
    free(a->starts);
    free(a->offsets_by_block);
}

/* One 32-value block's weights as unsigned bytes for VPDPBUSD (see the top); Q5_0's fifth bits are
 * added by weight_pair. */
static inline __attribute__((always_inline)) __m256i block_codes(const uint8_t *block, const int format) {
    if (format == FORMAT_Q8_0)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(block + 2)), _mm256_set1_epi8((char)0x80));
    const __m128i packed = _mm_loadu_si128((const __m128i *)(block + nibbles_at(format)));
    const __m128i nibble = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble), _mm_and_si128(packed, nibble));
}

/* Block pair `pair` of a weight row: codes, dw per lane and, for the offset formats, the offset per lane. */
typedef struct {
    __m512i codes;
    __m512 scale, offset;
} WeightPair;

/* What a block's pairs share, decoded once per block: Q4_K's scales and mins (q4k_scales_mins). */
static inline __attribute__((always_inline)) __m512 block_header(const uint8_t *block, const int format) {
    if (format != FORMAT_Q4_K) return _mm512_setzero_ps();
    return q4k_scales_mins(block + 4, half(block), half(block + 2));
}

/* Pairs per block whose header weight_pair takes: a K-quant super-block's four, else one. */
static inline int pairs_per_header(int format) { return format == FORMAT_Q4_K ? 4 : 1; }

/* Sub-blocks 2q and 2q + 1 of a Q4_K super-block: run q of its nibble bytes. */
static inline __attribute__((always_inline)) WeightPair q4k_pair(const uint8_t *block, int q, __m512 header) {
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * q));
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    WeightPair w;
    w.codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, nibble)),
                                 _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble), 1);
    const __m512i first = _mm512_set1_epi32(2 * q), second = _mm512_set1_epi32(2 * q + 1);
    const __m512i lanes = _mm512_mask_blend_epi32(0xff00, first, second);
    w.scale = _mm512_permutexvar_ps(lanes, header);
    w.offset = _mm512_permutexvar_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(8)), header);
    return w;
}

/* Sub-blocks 2q and 2q + 1 of a Q6_K super-block: half q / 2, runs 2 (q % 2) and 2 (q % 2) + 1. */
static inline __attribute__((always_inline)) WeightPair q6k_pair(const uint8_t *block, int q) {
    const int half_index = q / 2, upper = q % 2;
    const __m512i low = _mm512_and_si512(
        _mm512_srl_epi16(_mm512_loadu_si512((const void *)(block + 64 * half_index)), _mm_cvtsi32_si128(4 * upper)),
        _mm512_set1_epi8(0x0f));
    /* The 32 pair bytes in both halves; runs 2 upper and 2 upper + 1 take bits 4 upper and 4 upper + 2. */
    const __m512i pairs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 128 + 32 * half_index)));
    const __m512i shifts = _mm512_set_epi64(4 * upper + 2, 4 * upper + 2, 4 * upper + 2, 4 * upper + 2, 4 * upper,
                                            4 * upper, 4 * upper, 4 * upper);
    const __m512i high = _mm512_and_si512(_mm512_srlv_epi64(pairs, shifts), _mm512_set1_epi8(3));
    WeightPair w;
    w.codes = _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
    /* Sub-blocks of 16: 4q .. 4q + 3, one per 4 lanes. */
    int32_t packed_scales;
    memcpy(&packed_scales, block + 192 + 4 * q, sizeof packed_scales);
    const __m128 scales = _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(packed_scales))),
                                     _mm_set1_ps(half(block + 208)));
    w.scale = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                    _mm512_castps128_ps512(scales));
    w.offset = _mm512_setzero_ps();
    return w;
}

/* `header`: block_header of the block holding the pair. */
static inline __attribute__((always_inline)) WeightPair weight_pair(const uint8_t *row, int64_t pair, int64_t blocks,
                                                                    const int format, __m512 header) {
    if (format == FORMAT_Q4_K) return q4k_pair(row + pair / 4 * block_bytes(format), (int)(pair % 4), header);
    if (format == FORMAT_Q6_K) return q6k_pair(row + pair / 4 * block_bytes(format), (int)(pair % 4));
    const int bytes = block_bytes(format);
    const uint8_t *first = row + 2 * pair * bytes, *second = first + bytes;
    const int has_second = 2 * pair + 1 < blocks;
    WeightPair w;
    w.codes = _mm512_inserti64x4(_mm512_castsi256_si512(block_codes(first, format)),
                                 has_second ? block_codes(second, format) : _mm256_setzero_si256(), 1);
    if (format == FORMAT_Q5_0) {
        uint32_t fifth_first, fifth_second = 0;
        memcpy(&fifth_first, first + 2, sizeof fifth_first);
        if (has_second) memcpy(&fifth_second, second + 2, sizeof fifth_second);
        const __mmask64 fifth = (__mmask64)fifth_second << 32 | fifth_first;
        w.codes = _mm512_or_si512(w.codes, _mm512_maskz_mov_epi8(fifth, _mm512_set1_epi8(16)));
    }
    /* Both blocks' heads (d, then Q4_1's m) as halves in one conversion: [d0, m0, d1, m1]. */
    uint32_t head_first, head_second = 0;
    memcpy(&head_first, first, sizeof head_first);
    if (has_second) memcpy(&head_second, second, sizeof head_second);
    const __m512 heads = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_set_epi32(0, 0, (int)head_second, (int)head_first)));
    w.scale = _mm512_permutexvar_ps(_mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0), heads);
    w.offset = format == FORMAT_Q4_1
                   ? _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1), heads)
                   : _mm512_setzero_ps();
    return w;
}

/* What each of a row's `padded` tiled-path corrections multiplies (see Activations): per block its
 * d (K formats) or offset (Q4_1's m, Q4_K's -dmin m), per half-block for Q6_K (d s); zeros past the end. */
static void correction_weights(const uint8_t *row, int64_t blocks, int format, int64_t padded, float *out) {
    const int bytes = block_bytes(format);
    memset(out, 0, (size_t)padded * sizeof(float));
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = sub_block_home(row, b, format);
        const int part = sub_block_part(b, format);
        if (format == FORMAT_Q4_K) {
            int scale, min;
            q4k_scale_min(block + 4, part, &scale, &min);
            out[b] = -half(block + 2) * (float)min;
        } else if (format == FORMAT_Q6_K) {
            for (int t = 0; t < 2; ++t) out[2 * b + t] = half(block + 208) * (float)(int8_t)block[192 + 2 * part + t];
        } else {
            out[b] = half(row + b * bytes + (format == FORMAT_Q4_1 ? 2 : 0));
        }
    }
}

/* ---- 1 to STREAM_ROWS rows ---- */

/* Output features that share each pass over the activations: with one row a feature's
 * accumulator is one chain of dependent FMAs (latency bound, ~4 cycles a pair), so four
 * independent features go side by side; with more rows the rows' chains are independent already,
 * and two features halve the activation loads, which bound those rows. */
#define STREAM_FEATURES 4
static inline int stream_features_for(int rows) { return rows == 1 ? 4 : 2; }

/* Features o .. o + FEATURES - 1 for ROWS rows. Each feature's sum is formed in the same order
 * whatever FEATURES is, so the result does not depend on it. */
static inline __attribute__((always_inline)) void stream_group(const Activations *a, const uint8_t *w,
                                                               const float *bias, float *y, int64_t o,
                                                               int64_t out_features, int64_t blocks, int64_t bytes,
                                                               const int format, const int ROWS, const int FEATURES) {
    const int64_t pairs = a->pairs;
    const uint8_t *row[STREAM_FEATURES];
    __m512 acc[STREAM_FEATURES][STREAM_ROWS], header[STREAM_FEATURES];
    for (int f = 0; f < FEATURES; ++f) {
        row[f] = w + (o + f) * bytes;
        header[f] = _mm512_setzero_ps();
        for (int r = 0; r < ROWS; ++r) acc[f][r] = _mm512_setzero_ps();
    }
    /* The next group's bytes, a share per pair: with several rows read side by side the
     * hardware prefetchers fell behind on a layer streamed from memory. */
    const uint8_t *next = w + (o + FEATURES) * bytes, *end = w + out_features * bytes;
    const int64_t next_lines = (FEATURES * bytes + 63) / 64;
    for (int64_t p = 0; p < pairs; ++p) {
        for (int64_t line = p * next_lines / pairs; line < (p + 1) * next_lines / pairs; ++line)
            if (next + line * 64 < end) _mm_prefetch((const char *)(next + line * 64), _MM_HINT_T0);
        WeightPair wp[STREAM_FEATURES];
        for (int f = 0; f < FEATURES; ++f) {
            if (p % pairs_per_header(format) == 0)
                header[f] = block_header(row[f] + p / 4 * block_bytes(format), format);
            wp[f] = weight_pair(row[f], p, blocks, format, header[f]);
        }
        for (int r = 0; r < ROWS; ++r) {
            const int64_t at = r * pairs + p;
            /* The offset formats' starts are all zero (no -K sum(a) correction): not loaded. */
            const __m512i start = has_offset(format) ? _mm512_setzero_si512()
                                                     : _mm512_load_si512((const void *)(a->starts + at * 16));
            const __m512i codes = _mm512_load_si512((const void *)(a->codes + at * 64));
            const __m512 scales = _mm512_load_ps(a->scales + at * 16);
            const __m512 offsets = has_offset(format) ? _mm512_load_ps(a->offsets + at * 16) : _mm512_setzero_ps();
            for (int f = 0; f < FEATURES; ++f) {
                const __m512i dot = _mm512_dpbusd_epi32(start, wp[f].codes, codes);
                const __m512 scale = _mm512_mul_ps(wp[f].scale, scales);
                acc[f][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[f][r]);
                if (has_offset(format)) acc[f][r] = _mm512_fmadd_ps(wp[f].offset, offsets, acc[f][r]);
            }
        }
    }
    for (int f = 0; f < FEATURES; ++f)
        for (int r = 0; r < ROWS; ++r)
            y[r * out_features + o + f] = _mm512_reduce_add_ps(acc[f][r]) + (bias ? bias[o + f] : 0.0f);
}

static inline __attribute__((always_inline)) void stream_features(const Activations *a, const uint8_t *w,
                                                                  const float *bias, float *y, int64_t first,
                                                                  int64_t last, int64_t out_features,
                                                                  int64_t in_features, const int format,
                                                                  const int ROWS) {
    const int64_t blocks = in_features / SUB_BLOCK, bytes = row_bytes(format, in_features);
    const int features = stream_features_for(ROWS);
    int64_t o = first;
    if (features == 4)
        for (; o + 4 <= last; o += 4) stream_group(a, w, bias, y, o, out_features, blocks, bytes, format, ROWS, 4);
    else
        for (; o + 2 <= last; o += 2) stream_group(a, w, bias, y, o, out_features, blocks, bytes, format, ROWS, 2);
    for (; o < last; ++o) stream_group(a, w, bias, y, o, out_features, blocks, bytes, format, ROWS, 1);
}

#define STREAM(FORMAT, ROWS) stream_features(a, w, bias, y, first, last, out_features, in_features, FORMAT, ROWS)
#define STREAM_FORMAT(ROWS) FOR_EACH_FORMAT(format, STREAM, ROWS)

static void stream_range(const Activations *a, const uint8_t *w, const float *bias, float *y, int64_t rows,
                         int64_t first, int64_t last, int64_t out_features, int64_t in_features, int format) {
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

/* ---- more rows: a tile of unpacked weight pairs, reused by every row of a chunk ---- */

/* Pair-major, so that the 4 features of a micro product are adjacent: codes [pairs][TILE_OUT][64],
 * scales [pairs][TILE_OUT][16]; and per feature [TILE_OUT][padded] what the row's corrections
 * multiply (correction_weights). */
typedef struct {
    uint8_t *codes;
    float *scales, *offsets_by_block;
} Tile;

static void unpack_tile(const uint8_t *w, int format, int64_t first, int64_t count, int64_t in_features,
                        const Activations *a, const Tile *tile) {
    const int64_t blocks = in_features / SUB_BLOCK, bytes = row_bytes(format, in_features);
    for (int64_t f = 0; f < TILE_OUT; ++f) {
        const uint8_t *row = w + (first + (f < count ? f : 0)) * bytes;
        __m512 header = _mm512_setzero_ps();
        for (int64_t p = 0; p < a->pairs; ++p) {
            WeightPair wp = {_mm512_setzero_si512(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            /* a partial last tile: zero features keep the product's shape fixed */
            if (f < count) {
                switch (format) {
                case FORMAT_Q4_0: wp = weight_pair(row, p, blocks, FORMAT_Q4_0, header); break;
                case FORMAT_Q4_1: wp = weight_pair(row, p, blocks, FORMAT_Q4_1, header); break;
                case FORMAT_Q5_0: wp = weight_pair(row, p, blocks, FORMAT_Q5_0, header); break;
                case FORMAT_Q4_K:
                    if (p % 4 == 0) header = block_header(row + p / 4 * block_bytes(format), FORMAT_Q4_K);
                    wp = weight_pair(row, p, blocks, FORMAT_Q4_K, header);
                    break;
                case FORMAT_Q6_K: wp = weight_pair(row, p, blocks, FORMAT_Q6_K, header); break;
                default: wp = weight_pair(row, p, blocks, FORMAT_Q8_0, header); break;
                }
            }
            _mm512_store_si512((void *)(tile->codes + (p * TILE_OUT + f) * 64), wp.codes);
            _mm512_store_ps(tile->scales + (p * TILE_OUT + f) * 16, wp.scale);
        }
        float *by_block = tile->offsets_by_block + f * a->padded;
        if (f < count)
            correction_weights(row, blocks, format, a->padded, by_block);
        else
            memset(by_block, 0, (size_t)a->padded * sizeof(float));
    }
}

static inline __attribute__((always_inline)) void micro_product(const Activations *a, int64_t r0, const Tile *tile,
                                                                int64_t f0, float dots[MICRO_ROWS_N][MICRO],
                                                                const int ROWS) {
    const int64_t pairs = a->pairs;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[MICRO_ROWS_N][MICRO];
    for (int r = 0; r < ROWS; ++r)
        for (int f = 0; f < MICRO; ++f) acc[r][f] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512i wv[MICRO];
        __m512 sv[MICRO];
        for (int f = 0; f < MICRO; ++f) {
            wv[f] = _mm512_load_si512((const void *)(tile->codes + (p * TILE_OUT + f0 + f) * 64));
            sv[f] = _mm512_load_ps(tile->scales + (p * TILE_OUT + f0 + f) * 16);
            /* In registers from here: gcc would otherwise reload both for every row (4 loads a product). */
            __asm__("" : "+v"(wv[f]), "+v"(sv[f]));
        }
        for (int r = 0; r < ROWS; ++r) {
            const int64_t at = (r0 + r) * pairs + p;
            __m512i av = _mm512_load_si512((const void *)(a->codes + at * 64));
            __m512 da = _mm512_load_ps(a->scales + at * 16);
            __asm__("" : "+v"(av), "+v"(da));
            for (int f = 0; f < MICRO; ++f)
                acc[r][f] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, wv[f], av)),
                                            _mm512_mul_ps(sv[f], da), acc[r][f]);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int f = 0; f < MICRO; ++f)
            for (int64_t b = 0; b < a->padded; b += 16)
                acc[r][f] = _mm512_fmadd_ps(_mm512_load_ps(tile->offsets_by_block + (f0 + f) * a->padded + b),
                                            _mm512_load_ps(a->offsets_by_block + (r0 + r) * a->padded + b), acc[r][f]);
    for (int r = 0; r < ROWS; ++r)
        for (int f = 0; f < MICRO; ++f) dots[r][f] = _mm512_reduce_add_ps(acc[r][f]);
}

static void tile_product(const Activations *a, int64_t row_first, int64_t rows, const Tile *tile, int64_t first,
                         int64_t count, const float *bias, float *y, int64_t out_features) {
    for (int64_t r0 = row_first; r0 < row_first + rows; r0 += MICRO_ROWS_N) {
        const int64_t left = row_first + rows - r0, row_count = left < MICRO_ROWS_N ? left : MICRO_ROWS_N;
        for (int64_t f0 = 0; f0 < count; f0 += MICRO) {
            float dots[MICRO_ROWS_N][MICRO];
            /* The tile is format-free from here: codes, scales and the per-block corrections. */
            switch (row_count) {
            case 1: micro_product(a, r0, tile, f0, dots, 1); break;
            case 2: micro_product(a, r0, tile, f0, dots, 2); break;
            default: micro_product(a, r0, tile, f0, dots, 3); break;
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

static int tiled_product(const Activations *a, const uint8_t *w, int format, const float *bias, float *y, int64_t rows,
                         int64_t out_features, int64_t in_features, int threads) {
    const int64_t tiles = (out_features + TILE_OUT - 1) / TILE_OUT;
    const size_t codes = (size_t)a->pairs * TILE_OUT * 64, scales = (size_t)a->pairs * TILE_OUT * 16 * sizeof(float);
    const size_t offsets = (size_t)TILE_OUT * a->padded * sizeof(float), per_thread = codes + scales + offsets;
    uint8_t *scratch = aligned_alloc(64, (size_t)threads * per_thread);
    if (!scratch) return 2;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *mine = scratch + (size_t)omp_get_thread_num() * per_thread;
        const Tile tile = {mine, (float *)(mine + codes), (float *)(mine + codes + scales)};
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
            const int64_t chunk = rows - r0 < ROW_CHUNK ? rows - r0 : ROW_CHUNK;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; ++t) {
                const int64_t first = t * TILE_OUT;
                const int64_t count = out_features - first < TILE_OUT ? out_features - first : TILE_OUT;
                unpack_tile(w, format, first, count, in_features, a, &tile);
                tile_product(a, r0, chunk, &tile, first, count, bias, y, out_features);
            }
        }
    }
    free(scratch);
    return 0;
}

#endif /* HAVE_INTEGER_DOT */

/* quantized_linear_f32's contract (x [rows, in] float32, w GGUF blocks, bias or NULL, y [rows, out])
 * with x rounded to int8 per block of 32 first. Returns 0, 1 for a shape or format it cannot take,
 * 2 when its scratch cannot be allocated, 3 when built without VNNI. */
int quantized_linear_int8_f32(const float *x, const uint8_t *w, int format, const float *bias, float *y,
                              int64_t rows, int64_t out_features, int64_t in_features, int num_threads) {
#if HAVE_INTEGER_DOT
    if (!readable_shape(format, in_features) || rows < 0 || out_features < 0) return 1;
    if (rows == 0 || out_features == 0) return 0;
    const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    Activations a;
    int status = quantize_activations(x, rows, in_features, format, &a, threads);
    if (!status && rows <= STREAM_ROWS) {
#pragma omp parallel num_threads(threads)
        {
            const int64_t count = omp_get_num_threads(), t = omp_get_thread_num();
            stream_range(&a, w, bias, y, rows, out_features * t / count, out_features * (t + 1) / count, out_features,
                         in_features, format);
        }
    } else if (!status) {
        status = tiled_product(&a, w, format, bias, y, rows, out_features, in_features, threads);
    }
    free_activations(&a);
    return status;
#else
    (void)x, (void)w, (void)format, (void)bias, (void)y, (void)rows, (void)out_features, (void)in_features;
    (void)num_threads;
    return 3;
#endif
}
