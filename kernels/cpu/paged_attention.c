/* Paged attention on CPU for single query tokens, read straight out of the paged KV pool.
 *
 * The torch path gathers every request's blocks into a padded dense copy, then runs SDPA on
 * it: each K/V byte is read twice and written once. Here each query token walks its
 * request's block table and reads every cached key and value of its context once, for all
 * the query heads that share a KV head (GQA). A decode is one such token; a short prefill
 * chunk is one per token, each with a context one longer than the last (causal).
 * kernels/reference.py's paged_attention_ref defines the result.
 *
 * Layouts (float32, contiguous):
 *   query        [num_tokens, kv_heads * group, head_dim], rows query_stride floats apart
 *   key/value    [num_blocks, block_size, kv_heads, head_dim]
 *   block_tables [num_reqs, table_width] int32
 *   out          [num_tokens, kv_heads * group, head_dim]
 * Item i is query token token_rows[i] (a row of query/out), of the request in row
 * request_rows[i] of block_tables, attending to its first context_lens[i] cached tokens.
 *
 * Built with -fopenmp; after `import torch` the soname libgomp.so.1 resolves to the copy
 * torch already loaded, so this shares torch's thread pool rather than adding a second one.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#define MAX_HEADS 256
#define MAX_HEAD_DIM 256

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

/* One request: the query heads of `part_kv_heads` consecutive KV heads (groups of `group`)
 * attend to seq_len cached tokens; q, o and the caches point at the first of those heads.
 * Every slot of a block holds all KV heads side by side, and a block is contiguous, so
 * walking token by token over all heads streams whole blocks. Inlined into a switch on
 * head_dim so that the common sizes get fully unrolled inner loops. */
static inline __attribute__((always_inline)) void attend_request(
    const float *q, const float *key_cache, const float *value_cache, const int32_t *table, int64_t seq_len,
    int64_t block_size, int64_t kv_heads, int64_t part_kv_heads, int64_t group, const int64_t head_dim,
    float scale, float *scores /* [heads][seq_len] */, float *acc /* [heads][head_dim] */, float *o) {
    const int64_t heads = part_kv_heads * group;
    const int64_t token_stride = kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    for (int64_t start = 0, b = 0; start < seq_len; start += block_size, ++b) {
        const float *k = key_cache + (int64_t)table[b] * block_stride;
        const float *next = start + block_size < seq_len ? key_cache + (int64_t)table[b + 1] * block_stride : k;
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        for (int64_t t = 0; t < n; ++t, k += token_stride) {
            prefetch_slot(next + t * token_stride, token_stride);
            for (int64_t h = 0, hq = 0; h < part_kv_heads; ++h) {
                const float *kh = k + h * head_dim;
                for (int64_t g = 0; g < group; ++g, ++hq) {
                    const float *qh = q + hq * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
                    scores[hq * seq_len + start + t] = dot * scale;
                }
            }
        }
    }
    softmax_rows(scores, heads, seq_len);
    memset(acc, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t start = 0, b = 0; start < seq_len; start += block_size, ++b) {
        const float *v = value_cache + (int64_t)table[b] * block_stride;
        const float *next = start + block_size < seq_len ? value_cache + (int64_t)table[b + 1] * block_stride : v;
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        for (int64_t t = 0; t < n; ++t, v += token_stride) {
            prefetch_slot(next + t * token_stride, token_stride);
            for (int64_t h = 0, hq = 0; h < part_kv_heads; ++h) {
                const float *vh = v + h * head_dim;
                for (int64_t g = 0; g < group; ++g, ++hq) {
                    const float p = scores[hq * seq_len + start + t];
                    float *a = acc + hq * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
                }
            }
        }
    }
    memcpy(o, acc, sizeof(float) * (size_t)(heads * head_dim));
}

/* ---- head_dim a multiple of 16: 16-float vectors, query tokens scored 16 context tokens at a time.
 * A dot product of one key with one query head ends in a horizontal sum, which is most of the
 * work when done per token; here 16 tokens' partial sums are folded into one vector in 15
 * shuffle-and-add steps. GCC and Clang lower these vectors to AVX-512, AVX2 or NEON. */

typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t idx16 __attribute__((vector_size(64)));
#define LANES 16

static inline vec16 load16(const float *p) {
    vec16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, vec16 v) { memcpy(p, &v, sizeof v); }

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

/* Pointers to the slots of the tile of up to 16 tokens starting at t0 (its length). */
static inline int64_t tile_slots(const float *cache, const int32_t *table, int64_t t0, int64_t seq_len,
                                 int64_t block_size, int64_t block_stride, int64_t token_stride,
                                 const float *slots[LANES]) {
    const int64_t n = seq_len - t0 < LANES ? (seq_len > t0 ? seq_len - t0 : 0) : LANES;
    for (int64_t j = 0; j < n; ++j) {
        const int64_t t = t0 + j;
        slots[j] = cache + (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride;
    }
    return n;
}

/* As attend_request, for head_dim = 16 * chunks. Tiles of 16 context tokens: each tile's slots
 * (all KV heads) are read once, while in L1, for every query head. Inlined per head_dim. */
static inline __attribute__((always_inline)) void attend_request_vec(
    const float *q, const float *key_cache, const float *value_cache, const int32_t *table, int64_t seq_len,
    int64_t block_size, int64_t kv_heads, int64_t part_kv_heads, int64_t group, const int64_t head_dim,
    float scale, float *scores /* [heads][seq_len] */, float *acc /* [heads][head_dim] */, vec16 *partial,
    float *o) {
    const int64_t heads = part_kv_heads * group, chunks = head_dim / LANES;
    const int64_t token_stride = kv_heads * head_dim, block_stride = block_size * token_stride;
    /* Blocks sit at random places in the pool, and the hardware prefetcher stops at each
     * block's end: while a tile is computed, the next one is fetched, a slot at a time. */
    const float *slots[LANES], *next[LANES];
    int64_t n = tile_slots(key_cache, table, 0, seq_len, block_size, block_stride, token_stride, slots);
    for (int64_t t0 = 0; t0 < seq_len; t0 += LANES) {
        const int64_t n_next = tile_slots(key_cache, table, t0 + LANES, seq_len, block_size, block_stride,
                                          token_stride, next);
        /* Token by token, every head: memory is read in order, as the prefetchers like it. */
        for (int64_t j = 0; j < n; ++j) {
            if (j < n_next) prefetch_slot(next[j], token_stride);
            for (int64_t hq = 0; hq < heads; ++hq) {
                const float *qh = q + hq * head_dim, *k = slots[j] + (hq / group) * head_dim;
                vec16 sum = load16(qh) * load16(k);
                for (int64_t c = 1; c < chunks; ++c) sum += load16(qh + c * LANES) * load16(k + c * LANES);
                partial[hq * LANES + j] = sum;
            }
        }
        if (n < LANES)
            for (int64_t hq = 0; hq < heads; ++hq)
                for (int64_t j = n; j < LANES; ++j) partial[hq * LANES + j] = (vec16){0};
        for (int64_t hq = 0; hq < heads; ++hq) {
            const vec16 tile = fold16(partial + hq * LANES) * scale;
            if (n == LANES) store16(scores + hq * seq_len + t0, tile);
            else memcpy(scores + hq * seq_len + t0, &tile, sizeof(float) * (size_t)n);
        }
        memcpy(slots, next, sizeof slots);
        n = n_next;
    }
    n = tile_slots(value_cache, table, 0, seq_len, block_size, block_stride, token_stride, slots);
    for (int64_t j = 0; j < n; ++j) prefetch_slot(slots[j], token_stride);
    softmax_rows(scores, heads, seq_len);
    memset(acc, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t t0 = 0; t0 < seq_len; t0 += LANES) {
        const int64_t n_next = tile_slots(value_cache, table, t0 + LANES, seq_len, block_size, block_stride,
                                          token_stride, next);
        for (int64_t j = 0; j < n; ++j) {
            if (j < n_next) prefetch_slot(next[j], token_stride);
            for (int64_t hq = 0; hq < heads; ++hq) {
                const float p = scores[hq * seq_len + t0 + j];
                const float *v = slots[j] + (hq / group) * head_dim;
                float *a = acc + hq * head_dim;
                for (int64_t c = 0; c < chunks; ++c) store16(a + c * LANES, load16(a + c * LANES) + p * load16(v + c * LANES));
            }
        }
        memcpy(slots, next, sizeof slots);
        n = n_next;
    }
    memcpy(o, acc, sizeof(float) * (size_t)(heads * head_dim));
}

/* Returns 0 on success, 1 if a size is out of the supported range, 2 if memory ran out. */
int paged_attention_f32(const float *query, int64_t query_stride, const float *key_cache, const float *value_cache,
                        const int32_t *block_tables, int64_t table_width, const int64_t *request_rows,
                        const int64_t *token_rows, const int32_t *context_lens, int64_t num_items, int64_t kv_heads,
                        int64_t group, int64_t head_dim, int64_t block_size, float scale, float *out, int num_threads) {
    if (group < 1 || kv_heads * group > MAX_HEADS || head_dim < 1 || head_dim > MAX_HEAD_DIM) return 1;
    const int64_t heads = kv_heads * group;
    int failed = 0;

    /* Many tokens: one work item per token, streaming whole blocks. Fewer tokens than
     * threads would idle cores, so then each (token, KV head) pair is an item. */
    const int64_t parts = num_items < 2 * num_threads ? kv_heads : 1;
    const int64_t heads_per_part = kv_heads / parts;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t work = 0; work < num_items * parts; ++work) {
        const int64_t item = work / parts, h0 = (work % parts) * heads_per_part;
        const int64_t seq_len = context_lens[item];
        const int32_t *table = block_tables + request_rows[item] * table_width;
        const float *q = query + token_rows[item] * query_stride + h0 * group * head_dim;
        float *o = out + (token_rows[item] * heads + h0 * group) * head_dim;
        const float *k = key_cache + h0 * head_dim, *v = value_cache + h0 * head_dim;
        const int64_t part_heads = heads_per_part * group;
        /* Per head: 16 vectors of partial dot products, then head_dim sums, then seq_len scores. */
        const size_t floats = (size_t)part_heads * (size_t)(LANES * LANES + head_dim + seq_len);
        float *scratch = aligned_alloc(sizeof(vec16), (floats * sizeof(float) + sizeof(vec16) - 1) /
                                                          sizeof(vec16) * sizeof(vec16));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 2;
            continue;
        }
        vec16 *partial = (vec16 *)scratch;
        float *acc = scratch + part_heads * LANES * LANES, *scores = acc + part_heads * head_dim;
#define ATTEND_VEC(dim)                                                                                              \
    attend_request_vec(q, k, v, table, seq_len, block_size, kv_heads, heads_per_part, group, dim, scale, scores, acc, \
                       partial, o)
        switch (head_dim) {
        case 64: ATTEND_VEC(64); break;
        case 128: ATTEND_VEC(128); break;
        default:
            if (head_dim % LANES == 0) ATTEND_VEC(head_dim);
            else attend_request(q, k, v, table, seq_len, block_size, kv_heads, heads_per_part, group, head_dim, scale,
                                scores, acc, o);
        }
#undef ATTEND_VEC
        free(scratch);
    }
    return failed;
}
