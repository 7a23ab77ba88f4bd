/* The part of paged attention (paged_attention.h) that reads the KV cache, compiled once per
 * cache element type: paged_attention_f32.c, paged_attention_bf16.c and paged_attention_int8.c
 * include it with KV_T (the element), KV_LOAD / KV_LOAD16 (one element / 16 elements widened to
 * float), KV_PREFETCH (a slot of that many elements) and KV_FN (the name of each function for that
 * type) defined, and optionally KV_ROW (elements per KV head's row of a slot, from head_dim) and
 * KV_SCALE (the factor of a row's elements: int8 codes' scale, kv_int8.h). Queries, scores and
 * sums are float32 in every variant. KV_PAIRS (bfloat16) and KV_WORDS (int8) select the integer or
 * bfloat16 dot-product paths of paged_attention_pairs.h and paged_attention_words.h. */
#ifndef KV_ROW
#define KV_ROW(head_dim) (head_dim)
#define KV_SCALE(row, head_dim) 1.0f
#endif

/* One request: the query heads of `part_kv_heads` consecutive KV heads (groups of `group`)
 * attend to cached tokens first .. seq_len - 1 (first > 0 under a sliding window); q, o and the
 * caches point at the first of those heads. Every slot of a block holds all KV heads side by
 * side, and a block is contiguous, so walking token by token over all heads streams whole
 * blocks. Inlined into a switch on head_dim so that the common sizes get fully unrolled inner
 * loops. Scores are indexed from `first`. */
static inline __attribute__((always_inline)) void KV_FN(attend_request)(
    const float *q, const KV_T *key_cache, const KV_T *value_cache, const int32_t *table, int64_t first,
    int64_t seq_len, int64_t block_size, int64_t kv_heads, int64_t part_kv_heads, int64_t group,
    const int64_t head_dim, float scale, float *scores /* [heads][seq_len - first] */,
    float *acc /* [heads][head_dim] */, float *o) {
    const int64_t heads = part_kv_heads * group, len = seq_len - first;
    const int64_t token_stride = kv_heads * KV_ROW(head_dim);
    const int64_t block_stride = block_size * token_stride;
    for (int64_t t = first; t < seq_len; ++t) {
        const int64_t b = t / block_size, slot = t % block_size;
        const KV_T *k = key_cache + (int64_t)table[b] * block_stride + slot * token_stride;
        /* The same slot of the next block, fetched while this one is read. */
        if (t + block_size < seq_len)
            KV_PREFETCH(key_cache + (int64_t)table[b + 1] * block_stride + slot * token_stride, token_stride);
        for (int64_t h = 0, hq = 0; h < part_kv_heads; ++h) {
            const KV_T *kh = k + h * KV_ROW(head_dim);
            const float key_scale = scale * KV_SCALE(kh, head_dim);
            for (int64_t g = 0; g < group; ++g, ++hq) {
                const float *qh = q + hq * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * KV_LOAD(kh + d);
                scores[hq * len + t - first] = dot * key_scale;
            }
        }
    }
    softmax_rows(scores, heads, len);
    memset(acc, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t t = first; t < seq_len; ++t) {
        const int64_t b = t / block_size, slot = t % block_size;
        const KV_T *v = value_cache + (int64_t)table[b] * block_stride + slot * token_stride;
        if (t + block_size < seq_len)
            KV_PREFETCH(value_cache + (int64_t)table[b + 1] * block_stride + slot * token_stride, token_stride);
        for (int64_t h = 0, hq = 0; h < part_kv_heads; ++h) {
            const KV_T *vh = v + h * KV_ROW(head_dim);
            const float value_scale = KV_SCALE(vh, head_dim);
            for (int64_t g = 0; g < group; ++g, ++hq) {
                const float p = scores[hq * len + t - first] * value_scale;
                float *a = acc + hq * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * KV_LOAD(vh + d);
            }
        }
    }
    memcpy(o, acc, sizeof(float) * (size_t)(heads * head_dim));
}


/* Pointers to the slots of the tile of up to 16 tokens starting at t0 (its length). One division
 * per tile, not per token: the walk steps to the next block where one ends. */
static inline int64_t KV_FN(tile_slots)(const KV_T *cache, const int32_t *table, int64_t t0, int64_t seq_len,
                                 int64_t block_size, int64_t block_stride, int64_t token_stride,
                                 const KV_T *slots[LANES]) {
    const int64_t n = seq_len - t0 < LANES ? (seq_len > t0 ? seq_len - t0 : 0) : LANES;
    if (n == 0) return 0;
    int64_t b = t0 / block_size, slot = t0 - b * block_size;
    const KV_T *block = cache + (int64_t)table[b] * block_stride;
    for (int64_t j = 0; j < n; ++j, ++slot) {
        if (slot == block_size) block = cache + (int64_t)table[++b] * block_stride, slot = 0;
        slots[j] = block + slot * token_stride;
    }
    return n;
}

/* Partial scores of tile tokens 0..n-1 for `heads` query heads (rows q, head_dim 16 * chunks apart)
 * that share the key at `offset` in each slot: partial[g * LANES + j] holds token j's 16 partial dot
 * products for head g. Each key is loaded and widened once for all the heads, and their queries
 * stay in registers across the tile: with `heads` and `chunks` constants the loops unroll completely.
 * With token j, slot ahead[j] (j < n_ahead, slot_len elements) is fetched: one slot per token keeps
 * compute going while memory is read, where fetching a tile at once stalls on the CPU's few
 * outstanding misses (float32 at 64 x 320 decodes: 13 % slower that way, measured 2026-12-02). */
static inline __attribute__((always_inline)) void KV_FN(score_heads)(
    const float *q, const KV_T *const slots[LANES], int64_t offset, int64_t n, vec16 *partial, const int64_t heads,
    const int64_t chunks, const KV_T *const ahead[LANES], int64_t n_ahead, int64_t slot_len) {
    vec16 query[SUB_HEADS][MAX_CHUNKS];
#pragma GCC unroll 4
    for (int64_t g = 0; g < heads; ++g)
#pragma GCC unroll 16
        for (int64_t c = 0; c < chunks; ++c) query[g][c] = load16(q + (g * chunks + c) * LANES);
    for (int64_t j = 0; j < n; ++j) {
        if (j < n_ahead) KV_PREFETCH(ahead[j], slot_len);
        const KV_T *k = slots[j] + offset;
        vec16 key[MAX_CHUNKS];
#pragma GCC unroll 16
        for (int64_t c = 0; c < chunks; ++c) key[c] = KV_LOAD16(k + c * LANES);
        const float key_scale = KV_SCALE(k, chunks * LANES);
#pragma GCC unroll 4
        for (int64_t g = 0; g < heads; ++g) {
            vec16 sum = query[g][0] * key[0];
#pragma GCC unroll 16
            for (int64_t c = 1; c < chunks; ++c) sum += query[g][c] * key[c];
            partial[g * LANES + j] = sum * key_scale;
        }
    }
}

/* acc[g] += sum over tile tokens j of p[g * p_stride + j] * value_j, for `heads` query heads sharing
 * the value at `offset` in each slot; as score_heads, each value is widened once, the sums stay in
 * registers across the tile, and slots ahead are fetched one per token. */
static inline __attribute__((always_inline)) void KV_FN(accumulate_heads)(
    float *acc, const float *p, int64_t p_stride, const KV_T *const slots[LANES], int64_t offset, int64_t n,
    const int64_t heads, const int64_t chunks, const KV_T *const ahead[LANES], int64_t n_ahead, int64_t slot_len) {
    vec16 sum[SUB_HEADS][MAX_CHUNKS];
#pragma GCC unroll 4
    for (int64_t g = 0; g < heads; ++g)
#pragma GCC unroll 16
        for (int64_t c = 0; c < chunks; ++c) sum[g][c] = load16(acc + (g * chunks + c) * LANES);
    for (int64_t j = 0; j < n; ++j) {
        if (j < n_ahead) KV_PREFETCH(ahead[j], slot_len);
        const KV_T *v = slots[j] + offset;
        vec16 value[MAX_CHUNKS];
#pragma GCC unroll 16
        for (int64_t c = 0; c < chunks; ++c) value[c] = KV_LOAD16(v + c * LANES);
        const float value_scale = KV_SCALE(v, chunks * LANES);
#pragma GCC unroll 4
        for (int64_t g = 0; g < heads; ++g) {
            const float weight = p[g * p_stride + j] * value_scale;
#pragma GCC unroll 16
            for (int64_t c = 0; c < chunks; ++c) sum[g][c] += weight * value[c];
        }
    }
#pragma GCC unroll 4
    for (int64_t g = 0; g < heads; ++g)
#pragma GCC unroll 16
        for (int64_t c = 0; c < chunks; ++c) store16(acc + (g * chunks + c) * LANES, sum[g][c]);
}

/* The query heads of one KV head, in sets of up to `sub` (a constant), each set one call of `op`
 * with its head count a constant too. */
#define FOR_HEAD_SETS(group, sub, op)                                                                                  \
    for (int64_t g0 = 0; g0 < (group); g0 += (sub)) {                                                              \
        const int64_t set = (group) - g0 < (sub) ? (group) - g0 : (sub);                                           \
        switch (set) {                                                                                             \
        case 1: op(g0, 1); break;                                                                                  \
        case 2: op(g0, 2); break;                                                                                  \
        case 3: op(g0, 3); break;                                                                                  \
        default: op(g0, 4); break;                                                                                 \
        }                                                                                                          \
    }

/* As attend_request, for head_dim = 16 * chunks (chunks <= MAX_CHUNKS). Tiles of 16 context tokens
 * from `first`: each tile's slots (all KV heads) are read while in L1, KV head by KV head, for the
 * query heads of its group at once (score_heads, accumulate_heads). Inlined per head_dim. */
static inline __attribute__((always_inline)) void KV_FN(attend_request_vec)(
    const float *q, const KV_T *key_cache, const KV_T *value_cache, const int32_t *table, int64_t first,
    int64_t seq_len, int64_t block_size, int64_t kv_heads, int64_t part_kv_heads, int64_t group,
    const int64_t head_dim, float scale, float *scores /* [heads][seq_len - first] */,
    float *acc /* [heads][head_dim] */, vec16 *partial, float *o) {
    const int64_t heads = part_kv_heads * group, chunks = head_dim / LANES, len = seq_len - first;
    const int64_t token_stride = kv_heads * KV_ROW(head_dim), block_stride = block_size * token_stride;
    /* Sets of query heads whose queries (or sums) and one key (or value) fit in the registers. */
    const int64_t sub = chunks <= 4 ? 4 : chunks <= 8 ? 2 : 1;
    /* Blocks sit at random places in the pool, and the hardware prefetcher stops at each
     * block's end: while a tile is computed, the next one is fetched, a slot at a time (with the
     * first set of query heads). */
    const KV_T *slots[LANES], *next[LANES];
    int64_t n = KV_FN(tile_slots)(key_cache, table, first, seq_len, block_size, block_stride, token_stride, slots);
    for (int64_t t0 = first; t0 < seq_len; t0 += LANES) {
        const int64_t n_next = KV_FN(tile_slots)(key_cache, table, t0 + LANES, seq_len, block_size, block_stride,
                                          token_stride, next);
        for (int64_t h = 0; h < part_kv_heads; ++h) {
#define SCORE(g0, set)                                                                                               \
    KV_FN(score_heads)(q + (h * group + (g0)) * head_dim, slots, h * KV_ROW(head_dim), n,                                  \
                       partial + (h * group + (g0)) * LANES, set, chunks, next, h == 0 && (g0) == 0 ? n_next : 0, \
                       token_stride)
            FOR_HEAD_SETS(group, sub, SCORE)
#undef SCORE
        }
        store_tile_scores(partial, heads, n, scale, scores + t0 - first, len);
        memcpy(slots, next, sizeof slots);
        n = n_next;
    }
    n = KV_FN(tile_slots)(value_cache, table, first, seq_len, block_size, block_stride, token_stride, slots);
    for (int64_t j = 0; j < n; ++j) KV_PREFETCH(slots[j], token_stride);
    softmax_rows(scores, heads, len);
    memset(acc, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t t0 = first; t0 < seq_len; t0 += LANES) {
        const int64_t n_next = KV_FN(tile_slots)(value_cache, table, t0 + LANES, seq_len, block_size, block_stride,
                                          token_stride, next);
        for (int64_t h = 0; h < part_kv_heads; ++h) {
#define ACCUMULATE(g0, set)                                                                                          \
    KV_FN(accumulate_heads)(acc + (h * group + (g0)) * head_dim, scores + (h * group + (g0)) * len + t0 - first, len, \
                            slots, h * KV_ROW(head_dim), n, set, chunks, next, h == 0 && (g0) == 0 ? n_next : 0,     \
                            token_stride)
            FOR_HEAD_SETS(group, sub, ACCUMULATE)
#undef ACCUMULATE
        }
        memcpy(slots, next, sizeof slots);
        n = n_next;
    }
    memcpy(o, acc, sizeof(float) * (size_t)(heads * head_dim));
}
#if KV_PAIRS
#include "paged_attention_pairs.h"
#endif
#ifndef KV_WORDS
#define KV_WORDS 0
#endif
#if KV_WORDS
#include "paged_attention_words.h"
#endif
#undef FOR_HEAD_SETS

/* Returns 0 on success, 1 if a size is out of the supported range, 2 if memory ran out.
 * window > 0: each item sees only its last `window` context tokens (a sliding window); 0: all. */
int KV_FN(paged_attention)(const float *query, int64_t query_stride, const KV_T *key_cache,
                           const KV_T *value_cache, const int32_t *block_tables, int64_t table_width,
                           const int64_t *request_rows, const int64_t *token_rows, const int32_t *context_lens,
                           int64_t num_items, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
                           float scale, int64_t window, float *out, int num_threads) {
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
        const int64_t first = window > 0 && seq_len > window ? seq_len - window : 0;
        const int32_t *table = block_tables + request_rows[item] * table_width;
        const float *q = query + token_rows[item] * query_stride + h0 * group * head_dim;
        float *o = out + (token_rows[item] * heads + h0 * group) * head_dim;
        const KV_T *k = key_cache + h0 * KV_ROW(head_dim), *v = value_cache + h0 * KV_ROW(head_dim);
        const int64_t part_heads = heads_per_part * group;
        /* Per head: 16 vectors of partial dot products, then head_dim sums, then seq_len scores
         * (rounded up to 32), then the query's bfloat16 pairs where KV_PAIRS. */
        const size_t floats =
            (size_t)part_heads * (size_t)(LANES * LANES + 2 * head_dim + (seq_len - first + 31) / 32 * 32);
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
    KV_FN(attend_request_vec)(q, k, v, table, first, seq_len, block_size, kv_heads, heads_per_part, group, dim, scale, scores, acc, \
                       partial, o)
#if KV_PAIRS
#define ATTEND_PAIRS(dim)                                                                                            \
    attend_request_pairs(q, k, v, table, first, seq_len, block_size, kv_heads, heads_per_part, group, dim, scale,     \
                         scratch, o)
        /* 64 and 128 (measured): at 256 a group's value sums alone would fill the registers. */
        if (head_dim == 64 || head_dim == 128) {
            if (head_dim == 64) ATTEND_PAIRS(64);
            else ATTEND_PAIRS(128);
            free(scratch);
            continue;
        }
#undef ATTEND_PAIRS
#endif
#if KV_WORDS
#define ATTEND_WORDS(dim)                                                                                            \
    attend_request_words(q, k, v, table, first, seq_len, block_size, kv_heads, heads_per_part, group, dim, scale,     \
                         scratch, o)
        /* 64 and 128 (measured), as the pair dots: at 256 a head's sums and a value pair would fill
         * the registers. */
        if (head_dim == 64 || head_dim == 128) {
            if (head_dim == 64) ATTEND_WORDS(64);
            else ATTEND_WORDS(128);
            free(scratch);
            continue;
        }
#undef ATTEND_WORDS
#endif
        switch (head_dim) {
        case 64: ATTEND_VEC(64); break;
        case 128: ATTEND_VEC(128); break;
        case 256: ATTEND_VEC(256); break;
        default:
            if (head_dim % LANES == 0) ATTEND_VEC(head_dim);
            else KV_FN(attend_request)(q, k, v, table, first, seq_len, block_size, kv_heads, heads_per_part, group, head_dim, scale,
                                scores, acc, o);
        }
#undef ATTEND_VEC
        free(scratch);
    }
    return failed;
}

/* Each instantiation states its own: none leaks into the next. */
#undef KV_ROW
#undef KV_SCALE
#undef KV_WORDS
