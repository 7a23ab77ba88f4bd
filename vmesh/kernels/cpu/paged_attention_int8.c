/* paged_attention_int8: paged attention over an 8-bit KV cache (kv_int8.h), float32 queries,
 * arithmetic and output (paged_attention.h). Each key's dot product with a query, and each value's
 * softmax weight, is multiplied by its row's scale once: the codes are widened as they are loaded. */
#include "paged_attention.h"
#include "kv_int8.h"
#include "cross_calls.h"

#define KV_T int8_t
#define KV_LOAD(p) ((float)*(p))
#define KV_LOAD16 load16_i8
#define KV_PREFETCH prefetch_i8_slot
#define KV_FN(name) CONCAT(name, int8)
#define KV_PAIRS 0
#define KV_WORDS INT8_WORDS
#define KV_ROW(head_dim) ((head_dim) + KV_INT8_SCALE_BYTES)
#define KV_SCALE(row, head_dim) int8_row_scale(row, head_dim)
#include "paged_attention_kv.h"

/* Whether decode attention over this cache runs on 16-bit integer pair dots (paged_attention_words.h)
 * for head_dim 64 and 128: vmesh/kernels/cpu_native.py's int8_words. */
int vmesh_int8_words_available(void) { return INT8_WORDS; }
