/* The part of prefill_attention.c that reads the KV cache, compiled once per cache element type
 * (see paged_attention_kv.h for the macros: KV_T, KV_LOAD, KV_LOAD16, KV_FN, KV_ROW, KV_SCALE;
 * KV_PAIRS 1: the scores and the value sums as bfloat16 pair dots, over a bfloat16 cache or over an
 * 8-bit one's rows converted to bfloat16 by KV_PAIR_ROW). */
#ifndef KV_ROW
#define KV_ROW(head_dim) (head_dim)
#define KV_SCALE(row, head_dim) 1.0f
#endif
/* With KV_PAIRS: a cache row as bfloat16 elements, in the cache (a bfloat16 one) or converted into
 * `staged` (an 8-bit one: int8_row_bf16). */
#ifndef KV_PAIR_ROW
#define KV_PAIR_ROW(row, staged, head_dim) (row)
#endif

/* acc[r] += sum_j p[r][j] v[j] over n keys, for PV_ROWS rows (or fewer) and the 4 (or fewer)
 * vectors of head_dim starting at vector c0. */
static inline __attribute__((always_inline)) void KV_FN(accumulate_rows)(
    const float *p, const float *const *v, int64_t n, int64_t rows, int64_t c0, int64_t chunks, const int64_t head_dim,
    float *acc) {
    vec16 a[PV_ROWS][4];
    const int64_t width = chunks - c0 < 4 ? chunks - c0 : 4;
    for (int64_t r = 0; r < PV_ROWS; ++r)
        for (int64_t c = 0; c < 4; ++c)
            a[r][c] = r < rows && c < width ? load16(acc + r * head_dim + (c0 + c) * LANES) : (vec16){0};
    for (int64_t j = 0; j < n; ++j) {
        vec16 vj[4];
        for (int64_t c = 0; c < 4; ++c) vj[c] = c < width ? load16(v[j] + (c0 + c) * LANES) : (vec16){0};
        for (int64_t r = 0; r < PV_ROWS; ++r) {
            if (r < rows) {
                const vec16 pj = splat16(p[r * KEY_TILE + j]);
                for (int64_t c = 0; c < 4; ++c) a[r][c] += pj * vj[c];
            }
        }
    }
    for (int64_t r = 0; r < rows && r < PV_ROWS; ++r)
        for (int64_t c = 0; c < width; ++c) store16(acc + r * head_dim + (c0 + c) * LANES, a[r][c]);
}

/* The float32 cache's value row as it is; a bfloat16 one widened into `staged`, an int8 one
 * widened and scaled. */
static inline __attribute__((always_inline)) const float *KV_FN(value_row)(const KV_T *row, float *staged,
                                                                          const int64_t head_dim) {
    if (sizeof(KV_T) == sizeof(float)) return (const float *)row;
    const float row_scale = KV_SCALE(row, head_dim);
    for (int64_t d = 0; d < head_dim; d += LANES) store16(staged + d, KV_LOAD16(row + d) * row_scale);
    return staged;
}

/* One work item: query tokens [i0, i1) of a chunk, the `group` query heads of KV head h. Under a
 * sliding window (window > 0) a token at position p sees keys p - window + 1 ..= p only: keys
 * before the first token's window are never read. */
static inline __attribute__((always_inline)) void KV_FN(attend_tile)(
    const float *query, int64_t query_stride, const KV_T *key_cache, const KV_T *value_cache,
    const int32_t *table, int64_t first_row, int64_t first_position, int64_t i0, int64_t i1, int64_t h,
    int64_t kv_heads, int64_t group, const int64_t head_dim, int64_t block_size, float scale, int64_t window,
    float *out, float *scratch) {
    const int64_t rows = (i1 - i0) * group, chunks = head_dim / LANES, heads = kv_heads * group;
    const int64_t token_stride = kv_heads * KV_ROW(head_dim), block_stride = block_size * token_stride;
    float *q = scratch;                       /* [rows][head_dim], scaled (KV_PAIRS: its pairs) */
    float *acc = q + rows * head_dim;         /* [rows][head_dim] */
    float *scores = acc + rows * head_dim;    /* [rows][KEY_TILE] */
    float *kt = scores + rows * KEY_TILE;     /* [head_dim][KEY_TILE] */
    float *row_max = kt + head_dim * KEY_TILE; /* [rows] */
    float *row_sum = row_max + rows;          /* [rows] */
    float *vt = row_sum + rows;               /* [KEY_TILE][head_dim]: a tile's values as floats */
                                              /* (KV_PAIRS: their key-pair words, half of it) */
#if KV_PAIRS
    uint32_t *q_pairs = (uint32_t *)q;                           /* [rows][head_dim / 2], in q's place */
    uint32_t *kt_pairs = (uint32_t *)kt;                          /* [head_dim / 2][KEY_TILE] */
    uint32_t *vt_pairs = (uint32_t *)vt;                          /* [KEY_TILE / 2][head_dim], in vt's place */
    const int64_t pairs = head_dim / 2;
    const uint16_t *v_rows[KEY_TILE];
    /* An 8-bit cache's rows as bfloat16, in the halves of kt and vt that the pair words leave free. */
    uint16_t *k_staged = (uint16_t *)(kt + head_dim * KEY_TILE / 2);
    uint16_t *v_staged = (uint16_t *)(vt + head_dim * KEY_TILE / 2); /* [KEY_TILE][head_dim] */
    (void)k_staged, (void)v_staged;
#endif
    for (int64_t i = i0; i < i1; ++i)
        for (int64_t g = 0; g < group; ++g) {
            const float *src = query + (first_row + i) * query_stride + (h * group + g) * head_dim;
#if KV_PAIRS
            round_pairs(src, q_pairs + ((i - i0) * group + g) * pairs, head_dim);
#else
            float *dst = q + ((i - i0) * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = src[d] * scale;
#endif
        }
    memset(acc, 0, sizeof(float) * (size_t)(rows * head_dim));
    for (int64_t r = 0; r < rows; ++r) row_max[r] = -INFINITY, row_sum[r] = 0.0f;

    const int64_t key_end = first_position + i1; /* the last token sees up to here */
    const int64_t key_begin = window > 0 && first_position + i0 >= window ? first_position + i0 - window + 1 : 0;
    /* The value rows the tile's keys pair with, as floats: in the cache itself when it holds
     * floats, else widened once per key tile into vt (not once per group of rows that reads them);
     * with KV_PAIRS, interleaved by key pairs into vt's place instead, once per key tile too. */
#if !KV_PAIRS
    const float *v_slots[KEY_TILE];
#endif
    for (int64_t t0 = key_begin; t0 < key_end; t0 += KEY_TILE) {
        const int64_t n = key_end - t0 < KEY_TILE ? key_end - t0 : KEY_TILE;
        for (int64_t j = 0; j < n; ++j) {
            const int64_t t = t0 + j;
            const int64_t offset = (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride +
                                   h * KV_ROW(head_dim);
            const KV_T *k = key_cache + offset;
#if KV_PAIRS
            v_rows[j] = KV_PAIR_ROW(value_cache + offset, v_staged + j * head_dim, head_dim);
            const uint16_t *key_words = KV_PAIR_ROW(k, k_staged, head_dim);
            for (int64_t p = 0; p < pairs; ++p)
                memcpy(kt_pairs + p * KEY_TILE + j, key_words + 2 * p, sizeof(uint32_t));
#else
            v_slots[j] = KV_FN(value_row)(value_cache + offset, vt + j * head_dim, head_dim);
            const float key_scale = KV_SCALE(k, head_dim);
            for (int64_t d = 0; d < head_dim; ++d) kt[d * KEY_TILE + j] = KV_LOAD(k + d) * key_scale;
#endif
        }
#if KV_PAIRS
        interleave_value_pairs(v_rows, n, head_dim, vt_pairs);
        for (int64_t j = n; j < KEY_TILE; ++j)
            for (int64_t p = 0; p < pairs; ++p) kt_pairs[p * KEY_TILE + j] = 0;
#else
        for (int64_t j = n; j < KEY_TILE; ++j)
            for (int64_t d = 0; d < head_dim; ++d) kt[d * KEY_TILE + j] = 0.0f;
#endif
        /* Whole blocks with a constant row count, so that the accumulators stay in registers. */
        int64_t r = 0;
#if KV_PAIRS
        for (; r + QK_ROWS <= rows; r += QK_ROWS)
            score_pairs(q_pairs + r * pairs, kt_pairs, QK_ROWS, pairs, scale * LOG2E, scores + r * KEY_TILE);
        if (r < rows)
            score_pairs(q_pairs + r * pairs, kt_pairs, rows - r, pairs, scale * LOG2E, scores + r * KEY_TILE);
#else
        for (; r + QK_ROWS <= rows; r += QK_ROWS)
            score_rows(q + r * head_dim, kt, QK_ROWS, head_dim, scores + r * KEY_TILE);
        if (r < rows) score_rows(q + r * head_dim, kt, rows - r, head_dim, scores + r * KEY_TILE);
#endif
        /* Online softmax: rescale what each row holds when its maximum grows. */
        for (r = 0; r < rows; ++r) {
            const int64_t position = first_position + i0 + r / group;
            float *s = scores + r * KEY_TILE;
            const int64_t visible = position - t0 + 1 < n ? position - t0 + 1 : n; /* keys this row sees */
            /* The tile's first key this row sees (its window's start, when that falls in the tile). */
            const int64_t lowest = window > 0 && position - window + 1 > t0 ? position - window + 1 - t0 : 0;
            if (visible <= 0 || lowest >= visible) {
                memset(s, 0, sizeof(float) * KEY_TILE);
                continue;
            }
#if KV_PAIRS /* scores in base 2 (score_pairs scaled them by log2 e); the weights summed as rounded */
            __mmask16 seen[KEY_VECS];
            __m512 v[KEY_VECS], most = _mm512_set1_ps(-INFINITY);
            for (int64_t c = 0; c < KEY_VECS; ++c) {
                seen[c] = lanes_between(lowest - c * LANES, visible - c * LANES);
                v[c] = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), seen[c], s + c * LANES);
                most = _mm512_max_ps(most, v[c]);
            }
            const float tile_max = _mm512_reduce_max_ps(most);
            const float new_max = tile_max > row_max[r] ? tile_max : row_max[r];
            const __m512 shift = _mm512_set1_ps(new_max), ones = (__m512)_mm512_set1_epi32(BF16_PAIR_OF_ONES);
            __m512 total = _mm512_setzero_ps();
            for (int64_t c = 0; c < KEY_VECS; c += 2) { /* the row's weight pairs, in the first half of its scores */
                const __m512bh rounded = _mm512_cvtne2ps_pbh(
                    _mm512_maskz_mov_ps(seen[c + 1], exp2_weights(_mm512_sub_ps(v[c + 1], shift))),
                    _mm512_maskz_mov_ps(seen[c], exp2_weights(_mm512_sub_ps(v[c], shift))));
                _mm512_storeu_si512((uint32_t *)s + c * LANES / 2, (__m512i)rounded);
                total = _mm512_dpbf16_ps(total, rounded, (__m512bh)ones);
            }
            const float tile_sum = _mm512_reduce_add_ps(total), base = LN2; /* e^(base x): 2^x */
#else
            idx16 seen[KEY_VECS];
            vec16 v[KEY_VECS], most = splat16(-INFINITY);
            for (int64_t c = 0; c < KEY_VECS; ++c) {
                seen[c] = (lane_index + (int32_t)(c * LANES) < (int32_t)visible) &
                          (lane_index + (int32_t)(c * LANES) >= (int32_t)lowest);
                v[c] = select16(seen[c], load16(s + c * LANES), splat16(-INFINITY));
                most = select16(v[c] > most, v[c], most);
            }
            const float tile_max = max_lane(most);
            const float new_max = tile_max > row_max[r] ? tile_max : row_max[r];
            vec16 total = (vec16){0};
            for (int64_t c = 0; c < KEY_VECS; ++c) {
                const vec16 e = select16(seen[c], exp16(v[c] - new_max), (vec16){0});
                store16(s + c * LANES, e);
                total += e;
            }
            const float tile_sum = sum_lanes(total), base = 1.0f;
#endif
            if (new_max > row_max[r]) {
                const float alpha = row_max[r] == -INFINITY ? 0.0f : exp_f32((row_max[r] - new_max) * base);
                row_sum[r] *= alpha;
                float *a = acc + r * head_dim;
                for (int64_t c = 0; c < chunks; ++c) store16(a + c * LANES, load16(a + c * LANES) * alpha);
                row_max[r] = new_max;
            }
            row_sum[r] += tile_sum;
        }
#if KV_PAIRS /* row r's weight pairs sit at the start of its KEY_TILE floats: a stride of KEY_TILE words */
#define ACCUMULATE(count, c0)                                                                                     \
    accumulate_pairs((const uint32_t *)(scores + r * KEY_TILE), vt_pairs, n, count, c0, chunks, head_dim,        \
                     acc + r * head_dim)
#else
#define ACCUMULATE(count, c0)                                                                                     \
    KV_FN(accumulate_rows)(scores + r * KEY_TILE, v_slots, n, count, c0, chunks, head_dim, acc + r * head_dim)
#endif
        for (r = 0; r + PV_ROWS <= rows; r += PV_ROWS)
            for (int64_t c0 = 0; c0 < chunks; c0 += 4) ACCUMULATE(PV_ROWS, c0);
        for (int64_t c0 = 0; r < rows && c0 < chunks; c0 += 4) ACCUMULATE(rows - r, c0);
#undef ACCUMULATE
    }
    for (int64_t i = i0; i < i1; ++i)
        for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (i - i0) * group + g;
            const float inv = 1.0f / row_sum[r];
            float *dst = out + ((first_row + i) * heads + h * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[r * head_dim + d] * inv;
        }
}

/* Returns 0 on success, 1 if a size is out of the supported range (head_dim must be a
 * multiple of 16), 2 if memory ran out. window > 0: a sliding window of that many positions. */
int KV_FN(prefill_attention)(const float *query, int64_t query_stride, const KV_T *key_cache,
                             const KV_T *value_cache, const int32_t *block_tables, int64_t table_width,
                             const int64_t *chunk_requests, const int64_t *chunk_starts, const int32_t *chunk_lens,
                             const int32_t *chunk_seq_lens, int64_t num_chunks, int64_t kv_heads, int64_t group,
                             int64_t head_dim, int64_t block_size, float scale, int64_t window, float *out,
                             int num_threads) {
    if (group < 1 || kv_heads * group > MAX_HEADS || head_dim < LANES || head_dim > MAX_HEAD_DIM ||
        head_dim % LANES)
        return 1;
    const int64_t tile_tokens = group >= TILE_ROWS ? 1 : TILE_ROWS / group;
    /* Work items: (chunk, query tile, KV head); first_item[c] is chunk c's first. */
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(num_chunks + 1));
    if (first_item == NULL) return 2;
    first_item[0] = 0;
    for (int64_t c = 0; c < num_chunks; ++c)
        first_item[c + 1] = first_item[c] + (chunk_lens[c] + tile_tokens - 1) / tile_tokens * kv_heads;
    const int64_t num_items = first_item[num_chunks];
    const int64_t rows = tile_tokens * group;
    /* q (or its bfloat16 pairs), acc, scores, kt, row_max, row_sum, vt. */
    const size_t floats = (size_t)(2 * rows * head_dim + rows * KEY_TILE + 2 * head_dim * KEY_TILE + 2 * rows);
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 2;
        }
        /* Backwards: the last chunk's tiles first, and within every chunk its last tiles (those
         * that see the most keys) before its first, so the long items do not come last. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t work = num_items - 1; work >= 0; --work) {
            if (scratch == NULL) continue;
            int64_t c = 0;
            while (first_item[c + 1] <= work) ++c;
            const int64_t local = work - first_item[c], tile = local / kv_heads, h = local % kv_heads;
            const int64_t len = chunk_lens[c], i0 = tile * tile_tokens;
            const int64_t i1 = i0 + tile_tokens < len ? i0 + tile_tokens : len;
            const int32_t *table = block_tables + chunk_requests[c] * table_width;
            const int64_t first_position = chunk_seq_lens[c] - len;
#define ATTEND_TILE(dim)                                                                                          \
    KV_FN(attend_tile)(query, query_stride, key_cache, value_cache, table, chunk_starts[c], first_position, i0, i1, h,   \
                kv_heads, group, dim, block_size, scale, window, out, scratch)
            switch (head_dim) {
            case 64: ATTEND_TILE(64); break;
            case 128: ATTEND_TILE(128); break;
            default: ATTEND_TILE(head_dim);
            }
#undef ATTEND_TILE
        }
        free(scratch);
    }
    free(first_item);
    return failed;
}

/* Each instantiation states its own: none leaks into the next. */
#undef KV_ROW
#undef KV_SCALE
#undef KV_PAIR_ROW
