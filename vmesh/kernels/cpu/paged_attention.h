/* Paged attention on CPU for single query tokens, read straight out of the paged KV pool.
 *
 * The torch path gathers every request's blocks into a padded dense copy, then runs SDPA on
 * it: each K/V byte is read twice and written once. Here each query token walks its
 * request's block table and reads every cached key and value of its context once, for all
 * the query heads that share a KV head (GQA). A decode is one such token; a short prefill
 * chunk is one per token, each with a context one longer than the last (causal).
 * vmesh/kernels/reference.py's paged_attention_ref defines the result.
 *
 * Layouts (float32, contiguous):
 *   query        [num_tokens, kv_heads * group, head_dim], rows query_stride floats apart
 *   key/value    [num_blocks, block_size, kv_heads, head_dim]
 *   block_tables [num_reqs, table_width] int32
 *   out          [num_tokens, kv_heads * group, head_dim]
 * Item i is query token token_rows[i] (a row of query/out), of the request in row
 * request_rows[i] of block_tables, attending to its first context_lens[i] cached tokens.
 * paged_attention_bf16 is the same over a bfloat16 cache (uint16_t elements): with AVX-512 BF16 and
 * head_dim 64 or 128 its scores and value sums are bfloat16 pair dots, as prefill_attention.c's
 * (paged_attention_pairs.h); otherwise queries, scores, softmax, sums and out stay float32 and
 * each key and value is widened as it is loaded.
 *
 * paged_attention_int8 is the same over the 8-bit cache (kv_int8.h: each KV head's row is head_dim
 * codes and a float32 scale, head_dim + 4 bytes): with AVX-512 VNNI and head_dim 64 or 128 on 16-bit
 * integer pair dots (paged_attention_words.h), otherwise widened and scaled as loaded.
 *
 * This header holds what the element types share; paged_attention_f32.c, paged_attention_bf16.c and
 * paged_attention_int8.c each instantiate paged_attention_kv.h once (translation units compiled in
 * parallel: one unit took most of the kernels' build).
 *
 * Built with -fopenmp; after `import torch` the soname libgomp.so.1 resolves to the copy
 * torch already loaded, so this shares torch's thread pool rather than adding a second one.
 */
#ifndef VMESH_PAGED_ATTENTION_COMMON_H
#define VMESH_PAGED_ATTENTION_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_limits.h"
#include "vec_math.h"

/* Blocks sit at random places in the pool, which defeats the hardware prefetcher at every
 * block boundary: while one block is read, the same slot of the next block is fetched.
 * Into L2 (locality 2), not L1: L1 tracks too few misses in flight to keep DRAM busy, and
 * the batch-64 decode runs ~1.35x faster from DRAM this way (measured 2026-11-29). */
static inline void prefetch_slot(const float *slot, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(slot + i, 0, 2);
}

/* Each of `rows` rows of seq_len scores becomes its softmax, in place. */
static inline void softmax_rows(float *scores, int64_t rows, int64_t seq_len) {
    for (int64_t hq = 0; hq < rows; ++hq) {
        float *s = scores + hq * seq_len;
        float max_score = -INFINITY, denom = 0.0f;
#pragma omp simd reduction(max : max_score)
        for (int64_t t = 0; t < seq_len; ++t) max_score = s[t] > max_score ? s[t] : max_score;
#pragma omp simd reduction(+ : denom)
        for (int64_t t = 0; t < seq_len; ++t) {
            s[t] = exp_f32(s[t] - max_score);
            denom += s[t];
        }
        const float inv = 1.0f / denom;
#pragma omp simd
        for (int64_t t = 0; t < seq_len; ++t) s[t] *= inv;
    }
}


/* ---- head_dim a multiple of 16: 16-float vectors, query tokens scored 16 context tokens at a time.
 * A dot product of one key with one query head ends in a horizontal sum, which is most of the
 * work when done per token; here 16 tokens' partial sums are folded into one vector in 15
 * shuffle-and-add steps. GCC and Clang lower these vectors to AVX-512, AVX2 or NEON. */

typedef int32_t idx16 __attribute__((vector_size(64)));
#define LANES 16
/* The vectorised path keeps up to SUB_HEADS query heads' queries or sums of up to MAX_CHUNKS
 * vectors each in registers, fewer heads at a time as head_dim grows. */
#define MAX_CHUNKS (MAX_HEAD_DIM / LANES)
#define SUB_HEADS 4


/* __builtin_shufflevector arrived in GCC 12; older GCCs have __builtin_shuffle with a mask vector. */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (idx16){__VA_ARGS__})
#endif

/* Lane t of the result is the sum of the lanes of a[t]. */
static inline vec16 fold16(const vec16 a[LANES]) {
    vec16 b[8], c[4], d[2];
    for (int j = 0; j < 8; ++j) /* token pairs, 8 partials each */
        b[j] = SHUFFLE(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(a[2 * j], a[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; ++j) /* four tokens, 4 partials each */
        c[j] = SHUFFLE(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; ++j) /* eight tokens, 2 partials each */
        d[j] = SHUFFLE(c[2 * j], c[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(c[2 * j], c[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}



/* A tile's scores from its partial sums: row hq's n tokens (of 16; the other partials are zeroed
 * first) become scale times their folded sums, at row + hq * row_stride. */
static inline void store_tile_scores(vec16 *partial, int64_t heads, int64_t n, float scale, float *row,
                                     int64_t row_stride) {
    if (n < LANES)
        for (int64_t hq = 0; hq < heads; ++hq)
            for (int64_t j = n; j < LANES; ++j) partial[hq * LANES + j] = (vec16){0};
    for (int64_t hq = 0; hq < heads; ++hq) {
        const vec16 tile = fold16(partial + hq * LANES) * scale;
        if (n == LANES) store16(row + hq * row_stride, tile);
        else memcpy(row + hq * row_stride, &tile, sizeof(float) * (size_t)n);
    }
}

static inline void prefetch_bf16_slot(const uint16_t *slot, int64_t elements) {
    for (int64_t i = 0; i < elements; i += 32) __builtin_prefetch(slot + i, 0, 2);
}

#ifdef __AVX512F__
#include <immintrin.h>
/* The 32 features starting at `out` in order, scaled, from sums in the order that interleaving two
 * tokens' 16-bit values within 128-bit lanes (VPUNPCKLWD / VPUNPCKHWD) leaves them: in 32-bit lane
 * k, lo holds feature 8 (k / 4) + k % 4 and hi feature 8 (k / 4) + 4 + k % 4. */
static inline void store_features(float *out, __m512 lo, __m512 hi, __m512 scale) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale));
    _mm512_storeu_ps(out + LANES, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale));
}
#endif

#define CONCAT_(a, b) a##_##b
#define CONCAT(a, b) CONCAT_(a, b)

#endif
