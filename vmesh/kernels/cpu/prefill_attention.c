/* Causal attention for prefill chunks on CPU, read straight out of the paged KV pool.
 *
 * paged_attention.h answers each query token alone: a token reads every key and value of its
 * context once, so a chunk of n tokens reads its context n times and does one multiply per
 * load, far below what the cores can compute. Here a tile of query tokens (all the query
 * heads of one KV head) meets a tile of keys at a time, flash-attention style: scores by an
 * outer-product microkernel over a transposed key tile, an online softmax per row, and the
 * weighted values accumulated in registers. Each key and value is loaded once per query tile
 * rather than once per query token, and the work is register-blocked matrix products.
 * vmesh/kernels/reference.py's paged_attention_ref defines the result.
 *
 * Layouts (float32, contiguous unless said otherwise):
 *   query        [num_tokens, kv_heads * group, head_dim], rows query_stride floats apart
 *   key/value    [num_blocks, block_size, kv_heads, head_dim]
 *   block_tables [num_reqs, table_width] int32
 *   out          [num_tokens, kv_heads * group, head_dim]
 * Chunk c is query rows chunk_starts[c] .. + chunk_lens[c] of the request in row
 * chunk_requests[c] of block_tables, whose context is chunk_seq_lens[c] tokens once the chunk
 * is written: its token i sits at position seq_len - len + i and sees positions 0 ..= that.
 * prefill_attention_bf16 is the same over a bfloat16 cache (uint16_t elements): with AVX-512 BF16
 * its scores are bfloat16 pair dots of the query rounded to bfloat16 and its value sums pair dots
 * of the softmax weights rounded to bfloat16, their exponentials computed only as precisely as that
 * rounding needs (below), otherwise its values are widened once per
 * key tile; the softmax, the sums and the output stay float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_limits.h"
#include "vec_math.h"
#include "cross_calls.h"
#include "bf16_pairs.h"
#include "kv_int8.h"

#define LANES PREFILL_LANES
#define KEY_VECS 4 /* vectors of scores per row and key tile */
#define KEY_TILE (KEY_VECS * LANES)
#define TILE_ROWS 192 /* query rows (token x head of a group) per work item, about */
#define QK_ROWS 6    /* rows per score microkernel: QK_ROWS * KEY_VECS accumulators */
#define PV_ROWS 4    /* rows per value microkernel: 16 accumulators at head_dim 64 */



/* Not (vec16){0} + x: under strict floating point that is an addition (0 + -0 is +0). */
static inline vec16 splat16(float x) { return (vec16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

typedef int32_t idx16 __attribute__((vector_size(64)));
static const idx16 lane_index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* Lane j: a[j] where mask[j] is all ones, else b[j] (masks come from vector comparisons). */
static inline vec16 select16(idx16 mask, vec16 a, vec16 b) {
    idx16 ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    const idx16 picked = (ia & mask) | (ib & ~mask);
    vec16 out;
    memcpy(&out, &picked, sizeof out);
    return out;
}

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, ...) __builtin_shufflevector(a, a, __VA_ARGS__)
#else
#define SHUFFLE(a, ...) __builtin_shuffle(a, (idx16){__VA_ARGS__})
#endif

/* Horizontal max and sum in four halving steps: a chain of 15 scalar operations per row
 * would cost more than the row's share of the matrix products. */
static inline float max_lane(vec16 v) {
    v = select16(v > SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7), v,
                 SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = select16(v > SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11), v,
                 SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    const float a = v[0] > v[1] ? v[0] : v[1], b = v[2] > v[3] ? v[2] : v[3];
    return a > b ? a : b;
}

static inline float sum_lanes(vec16 v) {
    v += SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    return (v[0] + v[1]) + (v[2] + v[3]);
}

/* vec_math.h's exp_f32, sixteen lanes at once. */
static inline vec16 exp16(vec16 x) {
    x = select16(x < -87.0f, splat16(-87.0f), select16(x > 88.0f, splat16(88.0f), x));
    const vec16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vec16 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vec16 p = splat16(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const idx16 exponent_bits = (__builtin_convertvector(n, idx16) + 127) << 23;
    vec16 two_to_n;
    memcpy(&two_to_n, &exponent_bits, sizeof two_to_n);
    return p * two_to_n;
}

/* scores[r][0..KEY_TILE) = q[r] . keys[0..KEY_TILE), rows r0 .. r0 + QK_ROWS (or fewer). */
static inline __attribute__((always_inline)) void score_rows(const float *q, const float *kt, int64_t rows,
                                                             const int64_t head_dim, float *scores) {
    vec16 acc[QK_ROWS][KEY_VECS];
    for (int64_t r = 0; r < QK_ROWS; ++r)
        for (int64_t c = 0; c < KEY_VECS; ++c) acc[r][c] = (vec16){0};
    for (int64_t d = 0; d < head_dim; ++d) {
        vec16 k[KEY_VECS];
        for (int64_t c = 0; c < KEY_VECS; ++c) k[c] = load16(kt + d * KEY_TILE + c * LANES);
        for (int64_t r = 0; r < QK_ROWS; ++r) {
            if (r < rows) {
                const vec16 qd = splat16(q[r * head_dim + d]);
                for (int64_t c = 0; c < KEY_VECS; ++c) acc[r][c] += qd * k[c];
            }
        }
    }
    for (int64_t r = 0; r < rows && r < QK_ROWS; ++r)
        for (int64_t c = 0; c < KEY_VECS; ++c) store16(scores + r * KEY_TILE + c * LANES, acc[r][c]);
}

#if BF16_PAIRS
/* Over a bfloat16 cache the scores are bfloat16 pair dots (VDPBF16PS): each key's elements 2p and
 * 2p + 1 are one 32-bit word of the cache, so the key tile is a transpose of words, and a query
 * row in bfloat16 pairs meets 16 keys per instruction two elements at a time: half the
 * instructions of widening the keys to float32 for an FMA per element. The products are exact and
 * summed in float32, and the scale multiplies the sums. The query is rounded to bfloat16: a no-op for
 * the bfloat16 model's, which rotary_write_kv_bf16 rounds (as every attention path of that mode
 * does), so the scores are float32 arithmetic's but for summation order and the instructions'
 * flushing of subnormals. (bf16_pairs.h). */

/* scores[r][0..KEY_TILE) = scale q[r] . keys[0..KEY_TILE) from pair words: q [rows][pairs], kt
 * [pairs][KEY_TILE]. (The caller's scale includes log2 e: its softmax is in base 2.) */
static inline __attribute__((always_inline)) void score_pairs(const uint32_t *q, const uint32_t *kt, int64_t rows,
                                                              const int64_t pairs, float scale, float *scores) {
    __m512 acc[QK_ROWS][KEY_VECS];
    for (int64_t r = 0; r < QK_ROWS; ++r)
        for (int64_t c = 0; c < KEY_VECS; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh k[KEY_VECS];
        for (int64_t c = 0; c < KEY_VECS; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kt + p * KEY_TILE + c * LANES);
        for (int64_t r = 0; r < QK_ROWS; ++r) {
            if (r < rows) {
                const __m512bh qp = (__m512bh)_mm512_set1_epi32((int32_t)q[r * pairs + p]);
                for (int64_t c = 0; c < KEY_VECS; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qp, k[c]);
            }
        }
    }
    for (int64_t r = 0; r < rows && r < QK_ROWS; ++r)
        for (int64_t c = 0; c < KEY_VECS; ++c)
            _mm512_storeu_ps(scores + r * KEY_TILE + c * LANES, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(scale)));
}

/* The value sums as pair dots too: the softmax weights rounded to bfloat16 (much as transformers'
 * bfloat16 attention rounds them before the value product), two keys' weights per 32-bit word, meet
 * a value tile interleaved by key pairs, vt[p][d] = (v[2p][d], v[2p + 1][d]): one instruction
 * per two keys and 16 features where the float32 sums take two. The row sums divide by the
 * rounded weights' own sum, so each output stays a convex combination of the values. */

/* vt[p][0..head_dim) for the key pairs of n keys (a missing last key's values are zeros): each
 * word holds key 2p's and key 2p + 1's value of one feature. */
static inline void interleave_value_pairs(const uint16_t *const *rows, int64_t n, const int64_t head_dim,
                                          uint32_t *vt) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t p = 0; 2 * p < n; ++p) {
        const uint16_t *even = rows[2 * p], *odd = 2 * p + 1 < n ? rows[2 * p + 1] : NULL;
        for (int64_t d = 0; d < head_dim; d += LANES) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(even + d));
            const __m256i b = odd ? _mm256_loadu_si256((const __m256i *)(odd + d)) : _mm256_setzero_si256();
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
            _mm512_storeu_si512(vt + p * head_dim + d, _mm512_permutexvar_epi16(order, both));
        }
    }
}

/* acc[r] += sum_p w[r][p] . vt[p] over the pairs of n keys, for PV_ROWS rows (or fewer) and the 4
 * (or fewer) vectors of head_dim starting at vector c0; row r's weight pairs at w + r KEY_TILE. */
static inline __attribute__((always_inline)) void accumulate_pairs(const uint32_t *w, const uint32_t *vt, int64_t n,
                                                                   int64_t rows, int64_t c0, int64_t chunks,
                                                                   const int64_t head_dim, float *acc) {
    __m512 a[PV_ROWS][4];
    const int64_t width = chunks - c0 < 4 ? chunks - c0 : 4;
    for (int64_t r = 0; r < PV_ROWS; ++r)
        for (int64_t c = 0; c < 4; ++c)
            a[r][c] = r < rows && c < width ? _mm512_loadu_ps(acc + r * head_dim + (c0 + c) * LANES)
                                            : _mm512_setzero_ps();
    for (int64_t p = 0; 2 * p < n; ++p) {
        __m512bh vp[4];
        for (int64_t c = 0; c < 4; ++c)
            vp[c] = c < width ? (__m512bh)_mm512_loadu_si512(vt + p * head_dim + (c0 + c) * LANES)
                              : (__m512bh)_mm512_setzero_si512();
        for (int64_t r = 0; r < PV_ROWS; ++r) {
            if (r < rows) {
                const __m512bh wp = (__m512bh)_mm512_set1_epi32((int32_t)w[r * KEY_TILE + p]);
                for (int64_t c = 0; c < 4; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], wp, vp[c]);
            }
        }
    }
    for (int64_t r = 0; r < rows && r < PV_ROWS; ++r)
        for (int64_t c = 0; c < width; ++c) _mm512_storeu_ps(acc + r * head_dim + (c0 + c) * LANES, a[r][c]);
}
#endif

#define CONCAT_(a, b) a##_##b
#define CONCAT(a, b) CONCAT_(a, b)

/* float32 cache: prefill_attention_f32. */
#define KV_T float
#define KV_LOAD(p) (*(p))
#define KV_LOAD16 load16
#define KV_FN(name) CONCAT(name, f32)
#define KV_PAIRS 0
#include "prefill_attention_kv.h"
#undef KV_PAIRS
#undef KV_T
#undef KV_LOAD
#undef KV_LOAD16
#undef KV_FN

/* bfloat16 cache, float32 queries (bfloat16 pairs for the scores where BF16_PAIRS), output and
 * softmax: prefill_attention_bf16. */
#define KV_T uint16_t
#define KV_LOAD(p) bf16_to_f32(*(p))
#define KV_LOAD16 load16_bf16
#define KV_FN(name) CONCAT(name, bf16)
#define KV_PAIRS BF16_PAIRS
#include "prefill_attention_kv.h"
#undef KV_PAIRS
#undef KV_T
#undef KV_LOAD
#undef KV_LOAD16
#undef KV_FN

/* 8-bit cache (kv_int8.h), float32 queries and output: with AVX-512 BF16 each key and value row of a
 * key tile is converted to bfloat16 once (its codes times its scale, rounded: 2^-9 relative, as a
 * bfloat16 cache's rounding) and the bfloat16 cache's pair-dot path runs on them; otherwise they are
 * widened and scaled to float32 once per key tile, and the float32 cache's path runs:
 * prefill_attention_int8. */
#if BF16_PAIRS
/* A row's codes times its scale, rounded to bfloat16, into staged (head_dim elements). */
static inline const uint16_t *int8_row_bf16(const int8_t *row, int64_t head_dim, uint16_t *staged) {
    const vec16 scale = splat16(int8_row_scale(row, head_dim));
    for (int64_t d = 0; d < head_dim; d += LANES) {
        const vec16 values = load16_i8(row + d) * scale;
        _mm256_storeu_si256((__m256i *)(staged + d), (__m256i)_mm512_cvtneps_pbh((__m512)values));
    }
    return staged;
}
#define KV_PAIR_ROW(row, staged, head_dim) int8_row_bf16(row, head_dim, staged)
#endif
#define KV_T int8_t
#define KV_LOAD(p) ((float)*(p))
#define KV_LOAD16 load16_i8
#define KV_FN(name) CONCAT(name, int8)
#define KV_PAIRS BF16_PAIRS
#define KV_ROW(head_dim) ((head_dim) + KV_INT8_SCALE_BYTES)
#define KV_SCALE(row, head_dim) int8_row_scale(row, head_dim)
#include "prefill_attention_kv.h"
