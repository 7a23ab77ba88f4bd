/* A grammar's packed token bitmask applied to float32 logits: the tokens whose bit is clear get
 * -inf. Bit i of word j of a row allows token 32 * j + i (xgrammar's and llguidance's layout).
 *
 * Why here: unpacking the bits with tensor ops costs several passes over a [rows, vocab] tensor
 * (tens of ms for 32 rows of a 49k vocabulary on 2 cores), and xgrammar's CPU kernel took 5-7 ms
 * for the same, a few per cent of a decode step. A JSON grammar's mask is mostly whole words: all
 * allowed inside a free string, all refused between structural tokens. Those words cost one
 * compare (or a few vector stores); only mixed words test bits, eight lanes at a time.
 * One thread: 32 rows of 49k logits take ~0.4 ms, less than an OpenMP fork and join costs on a
 * busy machine (measured 4 ms with two threads at load 6).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

static void mask_row(float *logits, const int32_t *words, int64_t vocab) {
    const int64_t whole_words = vocab / 32;
    for (int64_t w = 0; w < whole_words; ++w) {
        const uint32_t bits = (uint32_t)words[w];
        if (bits == 0xFFFFFFFFu) continue;
        float *out = logits + 32 * w;
        if (bits == 0) {
#pragma omp simd
            for (int i = 0; i < 32; ++i) out[i] = -INFINITY;
            continue;
        }
#pragma omp simd
        for (int i = 0; i < 32; ++i) out[i] = ((bits >> i) & 1u) ? out[i] : -INFINITY;
    }
    const uint32_t last = whole_words * 32 < vocab ? (uint32_t)words[whole_words] : 0xFFFFFFFFu;
    for (int64_t t = whole_words * 32; t < vocab; ++t) {
        if (!((last >> (t - whole_words * 32)) & 1u)) logits[t] = -INFINITY;
    }
}

/* For each of the num_rows entries of rows (NULL: rows 0 .. num_rows - 1), logits row r (`vocab`
 * floats, rows logits_stride apart) masked by bitmask row r (ceil(vocab / 32) words, rows
 * bitmask_stride apart). The caller checks that every row lies in both tensors. */
void apply_token_bitmask_f32(float *logits, int64_t logits_stride, const int32_t *bitmask, int64_t bitmask_stride,
                             const int64_t *rows, int64_t num_rows, int64_t vocab, int num_threads) {
    (void)num_threads;  /* every kernel takes it (cpu_native.py binds it); this one stays on one thread */
    for (int64_t i = 0; i < num_rows; ++i) {
        const int64_t r = rows == NULL ? i : rows[i];
        mask_row(logits + r * logits_stride, bitmask + r * bitmask_stride, vocab);
    }
}
