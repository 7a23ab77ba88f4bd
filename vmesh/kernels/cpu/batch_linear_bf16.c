/* batch_linear_bf16: y = x @ W.T + bias for a bfloat16 weight in oneDNN's AVX-512 packed layout,
 * for more rows than small_batch_linear.c's streaming pass takes, on AVX-512 BF16 pair dot
 * products (VDPBF16PS: 16 output features x 2 inputs per instruction, summed in float32).
 *
 * The layout is AB16b64a2b, which services/worker/linear.py checks value by value at load: blocks
 * of 64 output features, each [padded_in / 2][64][2], an input pair's two weights side by side.
 * One input pair of one block is therefore four vectors of 16 features x 2 weights, exactly
 * VDPBF16PS's second operand, and a row's pair of inputs, broadcast, its first.
 *
 * Work: a tile is up to TILE_ROWS rows x one block of 64 features, its 4 x TILE_ROWS float32
 * sums held in registers over the whole input; a block's weights (padded_in x 128 bytes, at most
 * a few hundred KB) are read a slice at a time, each slice staying in L1 while every tile of a
 * group of rows reads it. Rows are cut into tiles of near-equal height (32 rows: 5, 5, 6, 5, 5, 6),
 * and the (block, group of tiles) units are shared out in contiguous runs; a layer of few blocks
 * is cut into more groups, so that no thread idles (each group then reads its block again).
 *
 * x is bfloat16 or float32 (the mixed model hands attention's float32 output to its o
 * projection), rounded to bfloat16 to nearest even as torch's conversion does; y is the float32
 * sum plus the bias, rounded the same way. Returns 0, 1 for a bad size, 2 when out of memory, 3
 * when built without AVX-512 BF16 (vmesh_batch_linear_bf16_available says which). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#define BLOCK_FEATURES 64
#define TILE_ROWS 6
/* Tiles per unit of work, pairs of inputs per slice of a block (64 pairs: 16 KB of weights), and
 * the units each thread should have at least. */
#define GROUP_TILES 8
#define SLICE_PAIRS 64
#define UNITS_PER_THREAD 4

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>

int vmesh_batch_linear_bf16_available(void) { return 1; }

/* torch's float32 -> bfloat16 rounding (vec_math.h's f32_to_bf16) on 16 lanes. */
static inline __m256i round_to_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(rounded);
}

/* Pairs [first, end) of `rows` rows (a constant once inlined) x one block, onto the float32 sums
 * in `partial` ([rows][64]; zero when first is 0). After the last pair (end == pairs) y[r][0..valid)
 * gets the sums plus the bias, rounded; before it the sums go back to `partial`. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x_pairs, int64_t pairs, int64_t first,
                                                       int64_t end, const uint16_t *w, const uint16_t *ahead,
                                                       int64_t ahead_pairs, float *partial,
                                                       const uint16_t *bias, uint16_t *y, int64_t out_features,
                                                       int64_t valid, const int rows) {
    __m512 sum[TILE_ROWS][4];
    for (int r = 0; r < rows; ++r)
        for (int g = 0; g < 4; ++g)
            sum[r][g] = first == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + r * BLOCK_FEATURES + g * 16);
    for (int64_t p = first; p < end; ++p) {
        if (p - first < ahead_pairs) /* the next slice into L2, one pair (4 lines) per pair read */
            for (int line = 0; line < 4; ++line)
                _mm_prefetch((const char *)(ahead + (p - first) * 2 * BLOCK_FEATURES + line * 32), _MM_HINT_T1);
        const uint16_t *wp = w + p * 2 * BLOCK_FEATURES;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
        for (int r = 0; r < rows; ++r) {
            int32_t pair; /* the row's two inputs as one lane, read bytewise (x is bfloat16 elements) */
            memcpy(&pair, x_pairs + 2 * (r * pairs + p), sizeof pair);
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
            sum[r][0] = _mm512_dpbf16_ps(sum[r][0], xr, w0);
            sum[r][1] = _mm512_dpbf16_ps(sum[r][1], xr, w1);
            sum[r][2] = _mm512_dpbf16_ps(sum[r][2], xr, w2);
            sum[r][3] = _mm512_dpbf16_ps(sum[r][3], xr, w3);
        }
    }
    if (end < pairs) {
        for (int r = 0; r < rows; ++r)
            for (int g = 0; g < 4; ++g) _mm512_storeu_ps(partial + r * BLOCK_FEATURES + g * 16, sum[r][g]);
        return;
    }
    for (int g = 0; g < 4 && g * 16 < valid; ++g) {
        const __mmask16 lanes = valid >= (g + 1) * 16 ? (__mmask16)0xffff : (__mmask16)((1u << (valid - g * 16)) - 1);
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias + g * 16)), 16))
                              : _mm512_setzero_ps();
        for (int r = 0; r < rows; ++r)
            _mm256_mask_storeu_epi16(y + r * out_features + g * 16, lanes, round_to_bf16(_mm512_add_ps(sum[r][g], b)));
    }
}

#define TILE_CASE(n) \
    case n: tile(x_pairs, pairs, first, end, w, ahead, ahead_pairs, partial, bias, y, out_features, valid, n); break;

static void tile_rows(const uint16_t *x_pairs, int64_t pairs, int64_t first, int64_t end, const uint16_t *w,
                      const uint16_t *ahead, int64_t ahead_pairs, float *partial, const uint16_t *bias, uint16_t *y, int64_t out_features, int64_t valid,
                      int64_t rows) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
    default: break;
    }
}
#undef TILE_CASE

int batch_linear_bf16(const void *x, int x_bf16, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t rows,
                      int64_t out_features, int64_t in_features, int64_t padded_in, int num_threads) {
    if (rows == 0) return 0;
    if (rows < 0 || out_features < 1 || in_features < 1 || padded_in < in_features || padded_in % 2) return 1;
    const int64_t pairs = padded_in / 2;
    /* The rows as bfloat16 pairs, zero past in_features: one broadcast per pair in the tile. A
     * bfloat16 x that needs no padding is read as it is. */
    uint16_t *x_half = NULL;
    if (!x_bf16 || padded_in != in_features) {
        x_half = aligned_alloc(64, ((size_t)(rows * padded_in) * sizeof(uint16_t) + 63) / 64 * 64);
        if (x_half == NULL) return 2;
        for (int64_t r = 0; r < rows; ++r) {
            uint16_t *dst = x_half + r * padded_in;
            if (x_bf16) {
                memcpy(dst, (const uint16_t *)x + r * in_features, (size_t)in_features * sizeof(uint16_t));
            } else {
                const float *src = (const float *)x + r * in_features;
                int64_t i = 0;
                for (; i + 16 <= in_features; i += 16)
                    _mm256_storeu_si256((__m256i *)(dst + i), round_to_bf16(_mm512_loadu_ps(src + i)));
                for (; i < in_features; ++i) dst[i] = f32_to_bf16(src[i]);
            }
            memset(dst + in_features, 0, (size_t)(padded_in - in_features) * sizeof(uint16_t));
        }
    }
    const uint16_t *x_pairs = x_half ? x_half : (const uint16_t *)x;
    const int64_t blocks = (out_features + BLOCK_FEATURES - 1) / BLOCK_FEATURES;
    const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    /* A unit is one block for a group of at most GROUP_TILES tiles; at least UNITS_PER_THREAD units
     * a thread where the rows allow, so that a layer of few blocks still shares out evenly. */
    int64_t groups = (tiles + GROUP_TILES - 1) / GROUP_TILES;
    const int64_t wanted = (UNITS_PER_THREAD * num_threads + blocks - 1) / blocks;
    if (groups < wanted) groups = wanted < tiles ? wanted : tiles;
    const int64_t units = blocks * groups;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        float partial[GROUP_TILES * TILE_ROWS * BLOCK_FEATURES] __attribute__((aligned(64)));
        for (int64_t unit = units * t / threads; unit < units * (t + 1) / threads; ++unit) {
            const int64_t block = unit / groups, group = unit % groups;
            const int64_t first_tile = tiles * group / groups, end_tile = tiles * (group + 1) / groups;
            const uint16_t *block_w = w + block * padded_in * BLOCK_FEATURES;
            const uint16_t *block_bias = bias ? bias + block * BLOCK_FEATURES : NULL;
            const int64_t valid = out_features - block * BLOCK_FEATURES;
            /* A slice of the block's pairs stays in L1 while every tile of the group reads it; the
             * first tile fetches the slice this thread reads next: the block's next one, else the
             * first of the next unit's block (this one again for its next group; blocks are
             * contiguous, so the next block's first pair follows this block's last). */
            for (int64_t first = 0; first < pairs; first += SLICE_PAIRS) {
                const int64_t end = first + SLICE_PAIRS < pairs ? first + SLICE_PAIRS : pairs;
                const int64_t next = end < pairs ? block * pairs + end : group + 1 < groups ? block * pairs
                                                                                            : (block + 1) * pairs;
                const int64_t left = blocks * pairs - next;
                const int64_t ahead_pairs = left < SLICE_PAIRS ? left : SLICE_PAIRS;
                for (int64_t k = first_tile; k < end_tile; ++k) {
                    const int64_t row = rows * k / tiles, height = rows * (k + 1) / tiles - row;
                    tile_rows(x_pairs + 2 * row * pairs, pairs, first, end, block_w, w + next * 2 * BLOCK_FEATURES,
                              k == first_tile ? ahead_pairs : 0,
                              partial + (k - first_tile) * TILE_ROWS * BLOCK_FEATURES, block_bias,
                              y + row * out_features + block * BLOCK_FEATURES, out_features, valid, height);
                }
            }
        }
    }
    free(x_half);
    return 0;
}

#else

int vmesh_batch_linear_bf16_available(void) { return 0; }

int batch_linear_bf16(const void *x, int x_bf16, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t rows,
                      int64_t out_features, int64_t in_features, int64_t padded_in, int num_threads) {
    (void)x, (void)x_bf16, (void)w, (void)bias, (void)y, (void)rows, (void)out_features, (void)in_features;
    (void)padded_in, (void)num_threads;
    return 3;
}

#endif
