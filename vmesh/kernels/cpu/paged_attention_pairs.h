/* Decode attention over a bfloat16 cache as bfloat16 pair dots (VDPBF16PS), for head_dim 64 or
 * 128; paged_attention_kv.h includes it where KV_PAIRS (bf16_pairs.h's BF16_PAIRS).
 *
 * Widening a key to float32 costs as many instructions as its FMAs with the query heads of a
 * GQA group of three: here a key is used as the cache holds it, 32 elements per register, and
 * one VDPBF16PS multiplies 32 of them by a query head's bfloat16 pairs. The query is rounded to
 * bfloat16, a no-op for the bfloat16 model's (rotary_write_kv_bf16 rounds it, as every attention
 * path of that mode does), so the scores are exact products summed in float32, as before but
 * for summation order. The softmax is in base 2 (scores scaled by log2 e) and its weights are
 * rounded to bfloat16, as prefill_attention.c's are and as transformers' bfloat16 attention
 * rounds them before the value product; two tokens' weights make one 32-bit word, which meets
 * the two tokens' values interleaved (VPUNPCKLWD / VPUNPCKHWD): one instruction per two tokens
 * and 16 features where widening and FMAs took four. The output divides by the rounded weights'
 * own sum, so it stays a convex combination of the values.
 *
 * The interleave works within 128-bit lanes: the low words of 32 features give, in 32-bit lane
 * k, feature 8 (k / 4) + k % 4, the high words feature 8 (k / 4) + 4 + k % 4. The sums keep that
 * order and are put back in feature order once per head at the end. */

/* Partial scores of tile tokens 0..n-1 for `heads` query heads (pair rows q, head_dim / 2 words
 * apart) that share the key at `offset` in each slot: partial[g * LANES + j] holds token j's 16
 * partial sums for head g. As score_heads, slot ahead[j] is fetched with token j. */
static inline __attribute__((always_inline)) void score_heads_pairs(
    const uint32_t *q, const uint16_t *const slots[LANES], int64_t offset, int64_t n, vec16 *partial,
    const int64_t heads, const int64_t pair_vecs, const uint16_t *const ahead[LANES], int64_t n_ahead,
    int64_t slot_len) {
    __m512bh query[SUB_HEADS][MAX_CHUNKS / 2];
#pragma GCC unroll 4
    for (int64_t g = 0; g < heads; ++g)
#pragma GCC unroll 8
        for (int64_t c = 0; c < pair_vecs; ++c)
            query[g][c] = (__m512bh)_mm512_loadu_si512(q + (g * pair_vecs + c) * LANES);
    for (int64_t j = 0; j < n; ++j) {
        if (j < n_ahead) prefetch_bf16_slot(ahead[j], slot_len);
        const uint16_t *k = slots[j] + offset;
        __m512bh key[MAX_CHUNKS / 2];
#pragma GCC unroll 8
        for (int64_t c = 0; c < pair_vecs; ++c) key[c] = (__m512bh)_mm512_loadu_si512(k + c * 2 * LANES);
#pragma GCC unroll 4
        for (int64_t g = 0; g < heads; ++g) {
            __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[g][0], key[0]);
#pragma GCC unroll 8
            for (int64_t c = 1; c < pair_vecs; ++c) sum = _mm512_dpbf16_ps(sum, query[g][c], key[c]);
            partial[g * LANES + j] = (vec16)sum;
        }
    }
}

/* acc[g] (interleave order) += the weighted values of tile tokens 0..n-1 for `heads` query heads
 * sharing the value at `offset` in each slot; row g's weight words (word p: tokens 2p and 2p + 1)
 * at w + g * w_stride. A missing last token of an odd tile has weight and value zero. */
static inline __attribute__((always_inline)) void accumulate_heads_pairs(
    float *acc, const uint32_t *w, int64_t w_stride, const uint16_t *const slots[LANES], int64_t offset, int64_t n,
    const int64_t heads, const int64_t pair_vecs, const uint16_t *const ahead[LANES], int64_t n_ahead,
    int64_t slot_len) {
    __m512 sum[SUB_HEADS][MAX_CHUNKS];
#pragma GCC unroll 4
    for (int64_t g = 0; g < heads; ++g)
#pragma GCC unroll 16
        for (int64_t c = 0; c < 2 * pair_vecs; ++c) sum[g][c] = _mm512_loadu_ps(acc + (g * 2 * pair_vecs + c) * LANES);
    for (int64_t p = 0; 2 * p < n; ++p) {
        if (2 * p < n_ahead) prefetch_bf16_slot(ahead[2 * p], slot_len);
        if (2 * p + 1 < n_ahead) prefetch_bf16_slot(ahead[2 * p + 1], slot_len);
        const uint16_t *even = slots[2 * p] + offset;
        const uint16_t *odd = 2 * p + 1 < n ? slots[2 * p + 1] + offset : NULL;
        __m512bh low[MAX_CHUNKS / 2], high[MAX_CHUNKS / 2];
#pragma GCC unroll 8
        for (int64_t c = 0; c < pair_vecs; ++c) {
            const __m512i a = _mm512_loadu_si512(even + c * 2 * LANES);
            const __m512i b = odd ? _mm512_loadu_si512(odd + c * 2 * LANES) : _mm512_setzero_si512();
            low[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
            high[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
#pragma GCC unroll 4
        for (int64_t g = 0; g < heads; ++g) {
            const __m512bh weights = (__m512bh)_mm512_set1_epi32((int32_t)w[g * w_stride + p]);
#pragma GCC unroll 8
            for (int64_t c = 0; c < pair_vecs; ++c) {
                sum[g][2 * c] = _mm512_dpbf16_ps(sum[g][2 * c], weights, low[c]);
                sum[g][2 * c + 1] = _mm512_dpbf16_ps(sum[g][2 * c + 1], weights, high[c]);
            }
        }
    }
#pragma GCC unroll 4
    for (int64_t g = 0; g < heads; ++g)
#pragma GCC unroll 16
        for (int64_t c = 0; c < 2 * pair_vecs; ++c) _mm512_storeu_ps(acc + (g * 2 * pair_vecs + c) * LANES, sum[g][c]);
}

/* A row of len base-2 scores becomes its softmax weights rounded to bfloat16, as pair words in
 * place (word p: tokens 2p and 2p + 1, zeros past len; the row must have room for a multiple of
 * 32 floats). Returns the rounded weights' sum. A NaN score makes NaN weights (exp2_weights keeps
 * it), and with them a NaN output, as the float32 path does. */
static inline float softmax_pairs(float *s, int64_t len) {
    __m512 highest = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += LANES)
        highest = _mm512_max_ps(highest, _mm512_mask_loadu_ps(highest, lanes_between(0, len - t), s + t));
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(highest));
    const __m512bh ones = (__m512bh)_mm512_set1_epi32(BF16_PAIR_OF_ONES);
    __m512 total = _mm512_setzero_ps();
    /* Word t / 2 + i is written after floats t .. t + 31 are read: the writes trail the reads. */
    for (int64_t t = 0; t < len; t += 2 * LANES) {
        const __mmask16 first = lanes_between(0, len - t), second = lanes_between(0, len - t - LANES);
        const __m512 a = _mm512_maskz_mov_ps(first, exp2_weights(_mm512_sub_ps(_mm512_maskz_loadu_ps(first, s + t), shift)));
        const __m512 b = _mm512_maskz_mov_ps(
            second, exp2_weights(_mm512_sub_ps(_mm512_maskz_loadu_ps(second, s + t + LANES), shift)));
        const __m512bh rounded = _mm512_cvtne2ps_pbh(b, a);
        _mm512_storeu_si512((uint32_t *)s + t / 2, (__m512i)rounded);
        total = _mm512_dpbf16_ps(total, rounded, ones);
    }
    return _mm512_reduce_add_ps(total);
}

/* As attend_request_vec over a bfloat16 cache, for head_dim = 32 * pair_vecs: tiles of 16 context
 * tokens from `first`, KV head by KV head, the query heads of its group at once. `scratch` holds
 * part_kv_heads * group * (16 vectors + 2 head_dim + len rounded up to 32) floats, 64-byte aligned.
 * Inlined per head_dim. */
static inline __attribute__((always_inline)) void attend_request_pairs(
    const float *q, const uint16_t *key_cache, const uint16_t *value_cache, const int32_t *table, int64_t first,
    int64_t seq_len, int64_t block_size, int64_t kv_heads, int64_t part_kv_heads, int64_t group,
    const int64_t head_dim, float scale, float *scratch, float *o) {
    const int64_t heads = part_kv_heads * group, pair_vecs = head_dim / (2 * LANES), len = seq_len - first;
    if (len <= 0) { /* no context: zeros, as the float32 path's empty sums */
        memset(o, 0, sizeof(float) * (size_t)(heads * head_dim));
        return;
    }
    const int64_t stride = (len + 2 * LANES - 1) / (2 * LANES) * (2 * LANES); /* a score row, in floats */
    const int64_t token_stride = kv_heads * head_dim, block_stride = block_size * token_stride;
    vec16 *partial = (vec16 *)scratch;
    float *acc = scratch + heads * LANES * LANES, *scores = acc + heads * head_dim;
    uint32_t *q_pairs = (uint32_t *)(scores + heads * stride);
    for (int64_t hq = 0; hq < heads; ++hq) round_pairs(q + hq * head_dim, q_pairs + hq * head_dim / 2, head_dim);
    /* Sets of query heads whose pairs (or sums) and one key (or value) fit in the registers. */
    const int64_t score_sub = pair_vecs <= 4 ? 4 : 2, value_sub = pair_vecs <= 2 ? 4 : pair_vecs <= 4 ? 2 : 1;
    const float score_scale = scale * LOG2E;

    const uint16_t *slots[LANES], *next[LANES];
    int64_t n = tile_slots_bf16(key_cache, table, first, seq_len, block_size, block_stride, token_stride, slots);
    for (int64_t t0 = first; t0 < seq_len; t0 += LANES) {
        const int64_t n_next =
            tile_slots_bf16(key_cache, table, t0 + LANES, seq_len, block_size, block_stride, token_stride, next);
        for (int64_t h = 0; h < part_kv_heads; ++h) {
#define SCORE(g0, set)                                                                                               \
    score_heads_pairs(q_pairs + (h * group + (g0)) * head_dim / 2, slots, h * head_dim, n,                         \
                      partial + (h * group + (g0)) * LANES, set, pair_vecs, next, h == 0 && (g0) == 0 ? n_next : 0, \
                      token_stride)
            FOR_HEAD_SETS(group, score_sub, SCORE)
#undef SCORE
        }
        store_tile_scores(partial, heads, n, score_scale, scores + t0 - first, stride);
        memcpy(slots, next, sizeof slots);
        n = n_next;
    }
    n = tile_slots_bf16(value_cache, table, first, seq_len, block_size, block_stride, token_stride, slots);
    for (int64_t j = 0; j < n; ++j) prefetch_bf16_slot(slots[j], token_stride);
    float inverse_sums[MAX_HEADS];
    for (int64_t hq = 0; hq < heads; ++hq) inverse_sums[hq] = 1.0f / softmax_pairs(scores + hq * stride, len);
    memset(acc, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t t0 = first; t0 < seq_len; t0 += LANES) {
        const int64_t n_next =
            tile_slots_bf16(value_cache, table, t0 + LANES, seq_len, block_size, block_stride, token_stride, next);
        const uint32_t *words = (const uint32_t *)scores + (t0 - first) / 2;
        for (int64_t h = 0; h < part_kv_heads; ++h) {
#define ACCUMULATE(g0, set)                                                                                          \
    accumulate_heads_pairs(acc + (h * group + (g0)) * head_dim, words + (h * group + (g0)) * stride, stride, slots,   \
                           h * head_dim, n, set, pair_vecs, next, h == 0 && (g0) == 0 ? n_next : 0, token_stride)
            FOR_HEAD_SETS(group, value_sub, ACCUMULATE)
#undef ACCUMULATE
        }
        memcpy(slots, next, sizeof slots);
        n = n_next;
    }
    for (int64_t hq = 0; hq < heads; ++hq) {
        const __m512 inverse = _mm512_set1_ps(inverse_sums[hq]);
        for (int64_t c = 0; c < pair_vecs; ++c) {
            const float *sums = acc + hq * head_dim + c * 2 * LANES;
            store_features(o + hq * head_dim + c * 2 * LANES, _mm512_loadu_ps(sums), _mm512_loadu_ps(sums + LANES),
                           inverse);
        }
    }
}
