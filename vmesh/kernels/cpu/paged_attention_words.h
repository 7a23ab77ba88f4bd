/* Decode attention over the 8-bit cache (kv_int8.h) on 16-bit integer pair dots (VPDPWSSD), for
 * head_dim 64 or 128; paged_attention_kv.h includes it where KV_WORDS (kv_int8.h's INT8_WORDS:
 * AVX-512 BW and VNNI).
 *
 * Widening each code to float32 costs two instructions per 16 elements before any arithmetic. Here
 * a key's codes are sign-extended to 16 bits, 32 per register (one instruction), and one VPDPWSSD
 * multiplies them by a query head rounded to 16 bits (its largest magnitude to 32767: a relative
 * error of 2^-16, far below bfloat16's 2^-9) and sums pairs into 32-bit lanes; each token's 16
 * partial sums become float32, and a tile's 16 folded scores take their keys' and the query's
 * scales in one multiply. The softmax is float32.
 * For the values, a tile's 16 softmax weights of a head, each times its value row's scale, are
 * rounded to 16 bits against the tile's largest (2^-16 of it), two tokens' weights per 32-bit word,
 * and meet the two tokens' codes interleaved (as paged_attention_pairs.h interleaves bfloat16
 * values): one VPDPWSSD per two tokens and 16 features. The tile's integer sums (at most 16 x 32767
 * x 127, far inside int32) become float32 once and take the weights' scale. A NaN anywhere in a
 * head's weights (a NaN score, or a value row's NaN scale: kv_int8.h) makes its output NaN. */

/* q rounded to 16 bits: words[d] = round(q[d] / scale), scale = max |q| / 32767 (returned; NaN for
 * a non-finite q, 0 for a zero one). */
static inline float round_query_words(const float *q, int64_t head_dim, int16_t *words) {
    __m512 largest = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t d = 0; d < head_dim; d += LANES) {
        const __m512 x = _mm512_loadu_ps(q + d);
        largest = _mm512_max_ps(largest, _mm512_abs_ps(x));
        bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(3.4028235e38f), _CMP_NLE_UQ); /* NaN, inf */
    }
    const float top = _mm512_reduce_max_ps(largest);
    /* Below 32767 / FLT_MAX the inverse would be infinite: such a query scores 0. */
    const __m512 inverse = _mm512_set1_ps(!bad && top > 32767.0f / FLT_MAX ? 32767.0f / top : 0.0f);
    for (int64_t d = 0; d < head_dim; d += LANES)
        _mm256_storeu_si256((__m256i *)(words + d),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + d), inverse))));
    return bad ? __builtin_nanf("") : top / 32767.0f;
}

/* 32 codes at p, sign-extended to 16 bits. */
static inline __m512i load32_codes(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }

/* Partial scores of tile tokens 0..n-1 for `heads` query heads (16-bit rows q, head_dim apart) that
 * share the key at `offset` in each slot: partial[g * LANES + j] holds token j's 16 partial sums for
 * head g, unscaled (the scales multiply each tile's 16 folded scores at once: store_word_scores).
 * As score_heads, slot ahead[j] is fetched with token j. */
static inline __attribute__((always_inline)) void score_heads_words(
    const int16_t *q, const int8_t *const slots[LANES], int64_t offset, int64_t n, vec16 *partial,
    const int64_t heads, const int64_t word_vecs, const int8_t *const ahead[LANES], int64_t n_ahead,
    int64_t slot_len) {
    __m512i query[SUB_HEADS][MAX_CHUNKS / 2];
#pragma GCC unroll 4
    for (int64_t g = 0; g < heads; ++g)
#pragma GCC unroll 8
        for (int64_t c = 0; c < word_vecs; ++c) query[g][c] = _mm512_loadu_si512(q + (g * word_vecs + c) * 2 * LANES);
    for (int64_t j = 0; j < n; ++j) {
        if (j < n_ahead) prefetch_i8_slot(ahead[j], slot_len);
        const int8_t *k = slots[j] + offset;
        __m512i key[MAX_CHUNKS / 2];
#pragma GCC unroll 8
        for (int64_t c = 0; c < word_vecs; ++c) key[c] = load32_codes(k + c * 2 * LANES);
#pragma GCC unroll 4
        for (int64_t g = 0; g < heads; ++g) {
            __m512i sum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), query[g][0], key[0]);
#pragma GCC unroll 8
            for (int64_t c = 1; c < word_vecs; ++c) sum = _mm512_dpwssd_epi32(sum, query[g][c], key[c]);
            partial[g * LANES + j] = (vec16)_mm512_cvtepi32_ps(sum);
        }
    }
}

/* A tile's scores from score_heads_words's partial sums: for each of the `heads` query heads of one KV
 * head (rows at row, row_stride apart) its n tokens' folded sums times the tokens' key scales, the
 * head's query scale and `scale`. */
static inline void store_word_scores(vec16 *partial, int64_t heads, int64_t n, const float *key_scales,
                                     const float *q_scale, float scale, float *row, int64_t row_stride) {
    if (n < LANES)
        for (int64_t hq = 0; hq < heads; ++hq)
            for (int64_t j = n; j < LANES; ++j) partial[hq * LANES + j] = (vec16){0};
    const vec16 keys = load16(key_scales);
    for (int64_t hq = 0; hq < heads; ++hq) {
        const vec16 tile = fold16(partial + hq * LANES) * keys * (q_scale[hq] * scale);
        if (n == LANES) store16(row + hq * row_stride, tile);
        else memcpy(row + hq * row_stride, &tile, sizeof(float) * (size_t)n);
    }
}

/* acc[g] (interleave order, float32) += the weighted values of tile tokens 0..n-1 for `heads` query
 * heads sharing the value at `offset` in each slot: row g's 16-bit weight words (word p: tokens 2p
 * and 2p + 1) at w + g * (LANES / 2), their scale w_scale[g]. A missing last token of an odd tile
 * has weight zero. */
static inline __attribute__((always_inline)) void accumulate_heads_words(
    float *acc, const uint32_t *w, const float *w_scale, const int8_t *const slots[LANES], int64_t offset, int64_t n,
    const int64_t heads, const int64_t word_vecs, const int8_t *const ahead[LANES], int64_t n_ahead,
    int64_t slot_len) {
    __m512i sum[SUB_HEADS][MAX_CHUNKS];
#pragma GCC unroll 4
    for (int64_t g = 0; g < heads; ++g)
#pragma GCC unroll 16
        for (int64_t c = 0; c < 2 * word_vecs; ++c) sum[g][c] = _mm512_setzero_si512();
    for (int64_t p = 0; 2 * p < n; ++p) {
        if (2 * p < n_ahead) prefetch_i8_slot(ahead[2 * p], slot_len);
        if (2 * p + 1 < n_ahead) prefetch_i8_slot(ahead[2 * p + 1], slot_len);
        const int8_t *even = slots[2 * p] + offset;
        const int8_t *odd = 2 * p + 1 < n ? slots[2 * p + 1] + offset : NULL;
        __m512i low[MAX_CHUNKS / 2], high[MAX_CHUNKS / 2];
#pragma GCC unroll 8
        for (int64_t c = 0; c < word_vecs; ++c) {
            const __m512i a = load32_codes(even + c * 2 * LANES);
            const __m512i b = odd ? load32_codes(odd + c * 2 * LANES) : _mm512_setzero_si512();
            low[c] = _mm512_unpacklo_epi16(a, b);
            high[c] = _mm512_unpackhi_epi16(a, b);
        }
#pragma GCC unroll 4
        for (int64_t g = 0; g < heads; ++g) {
            const __m512i weights = _mm512_set1_epi32((int32_t)w[g * (LANES / 2) + p]);
#pragma GCC unroll 8
            for (int64_t c = 0; c < word_vecs; ++c) {
                sum[g][2 * c] = _mm512_dpwssd_epi32(sum[g][2 * c], weights, low[c]);
                sum[g][2 * c + 1] = _mm512_dpwssd_epi32(sum[g][2 * c + 1], weights, high[c]);
            }
        }
    }
#pragma GCC unroll 4
    for (int64_t g = 0; g < heads; ++g) {
        const __m512 scale = _mm512_set1_ps(w_scale[g]);
#pragma GCC unroll 16
        for (int64_t c = 0; c < 2 * word_vecs; ++c) {
            float *a = acc + (g * 2 * word_vecs + c) * LANES;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[g][c]), scale, _mm512_loadu_ps(a)));
        }
    }
}

/* Row `p` (n softmax weights of a tile) times the tile's value scales, rounded to 16-bit pair words
 * (8; zeros past n); returns their scale, NaN if a weight is NaN. */
static inline float round_weight_words(const float *p, const float *value_scales, int64_t n, uint32_t *words) {
    const __mmask16 valid = n >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
    const __m512 weights = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, p), _mm512_maskz_loadu_ps(valid, value_scales));
    const __mmask16 bad = _mm512_cmp_ps_mask(weights, weights, _CMP_UNORD_Q);
    const float top = _mm512_reduce_max_ps(weights);
    /* Weights below 32767 / FLT_MAX (a tile far below the row's largest score) count as zeros. */
    const __m512 inverse = _mm512_set1_ps(!bad && top > 32767.0f / FLT_MAX ? 32767.0f / top : 0.0f);
    _mm256_storeu_si256((__m256i *)words, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(weights, inverse))));
    return bad ? __builtin_nanf("") : top / 32767.0f;
}

/* As attend_request_vec over the 8-bit cache, for head_dim = 32 * word_vecs: tiles of 16 context tokens
 * from `first`, KV head by KV head, the query heads of its group at once. `scratch` holds
 * part_kv_heads * group * (16 vectors + 2 head_dim + len rounded up to 32) floats, 64-byte aligned.
 * Inlined per head_dim. */
static inline __attribute__((always_inline)) void attend_request_words(
    const float *q, const int8_t *key_cache, const int8_t *value_cache, const int32_t *table, int64_t first,
    int64_t seq_len, int64_t block_size, int64_t kv_heads, int64_t part_kv_heads, int64_t group,
    const int64_t head_dim, float scale, float *scratch, float *o) {
    const int64_t heads = part_kv_heads * group, word_vecs = head_dim / (2 * LANES), len = seq_len - first;
    if (len <= 0) { /* no context: zeros, as the float32 path's empty sums */
        memset(o, 0, sizeof(float) * (size_t)(heads * head_dim));
        return;
    }
    const int64_t row = head_dim + KV_INT8_SCALE_BYTES;
    const int64_t token_stride = kv_heads * row, block_stride = block_size * token_stride;
    vec16 *partial = (vec16 *)scratch;
    float *acc = scratch + heads * LANES * LANES, *scores = acc + heads * head_dim;
    int16_t *q_words = (int16_t *)(scores + heads * ((len + 31) / 32 * 32)); /* heads x head_dim, in 2 head_dim floats' room */
    float q_scale[MAX_HEADS];
    for (int64_t hq = 0; hq < heads; ++hq) q_scale[hq] = round_query_words(q + hq * head_dim, head_dim, q_words + hq * head_dim);
    /* Sets of query heads whose words (or sums) and one key (or value) fit in the registers. */
    const int64_t score_sub = word_vecs <= 4 ? 4 : 2, value_sub = word_vecs <= 2 ? 4 : word_vecs <= 4 ? 2 : 1;

    const int8_t *slots[LANES], *next[LANES];
    float row_scales[LANES] = {0};
    int64_t n = tile_slots_int8(key_cache, table, first, seq_len, block_size, block_stride, token_stride, slots);
    for (int64_t t0 = first; t0 < seq_len; t0 += LANES) {
        const int64_t n_next =
            tile_slots_int8(key_cache, table, t0 + LANES, seq_len, block_size, block_stride, token_stride, next);
        for (int64_t h = 0; h < part_kv_heads; ++h) {
#define SCORE(g0, set)                                                                                               \
    score_heads_words(q_words + (h * group + (g0)) * head_dim, slots, h * row, n,                                   \
                      partial + (h * group + (g0)) * LANES, set, word_vecs, next, h == 0 && (g0) == 0 ? n_next : 0, \
                      token_stride)
            FOR_HEAD_SETS(group, score_sub, SCORE)
#undef SCORE
            for (int64_t j = 0; j < n; ++j) row_scales[j] = int8_row_scale(slots[j] + h * row, head_dim);
            store_word_scores(partial + h * group * LANES, group, n, row_scales, q_scale + h * group, scale,
                              scores + h * group * len + t0 - first, len);
        }
        memcpy(slots, next, sizeof slots);
        n = n_next;
    }
    n = tile_slots_int8(value_cache, table, first, seq_len, block_size, block_stride, token_stride, slots);
    for (int64_t j = 0; j < n; ++j) prefetch_i8_slot(slots[j], token_stride);
    softmax_rows(scores, heads, len);
    memset(acc, 0, sizeof(float) * (size_t)(heads * head_dim));
    uint32_t words[MAX_HEADS * LANES / 2]; /* a KV head's query heads' weight words */
    float w_scale[MAX_HEADS];
    for (int64_t t0 = first; t0 < seq_len; t0 += LANES) {
        const int64_t n_next =
            tile_slots_int8(value_cache, table, t0 + LANES, seq_len, block_size, block_stride, token_stride, next);
        for (int64_t h = 0; h < part_kv_heads; ++h) {
            for (int64_t j = 0; j < n; ++j) row_scales[j] = int8_row_scale(slots[j] + h * row, head_dim);
            for (int64_t g = 0; g < group; ++g)
                w_scale[g] = round_weight_words(scores + (h * group + g) * len + t0 - first, row_scales, n,
                                                words + g * (LANES / 2));
#define ACCUMULATE(g0, set)                                                                                          \
    accumulate_heads_words(acc + (h * group + (g0)) * head_dim, words + (g0) * (LANES / 2), w_scale + (g0), slots,    \
                           h * row, n, set, word_vecs, next, h == 0 && (g0) == 0 ? n_next : 0, token_stride)
            FOR_HEAD_SETS(group, value_sub, ACCUMULATE)
#undef ACCUMULATE
        }
        memcpy(slots, next, sizeof slots);
        n = n_next;
    }
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t hq = 0; hq < heads; ++hq)
        for (int64_t c = 0; c < word_vecs; ++c) {
            const float *sums = acc + hq * head_dim + c * 2 * LANES;
            store_features(o + hq * head_dim + c * 2 * LANES, _mm512_loadu_ps(sums), _mm512_loadu_ps(sums + LANES), one);
        }
}
