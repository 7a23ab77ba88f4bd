/* paged_attention_bf16: paged attention over a bfloat16 KV cache, float32 queries, arithmetic
 * and output (paged_attention.h). */
#include "paged_attention.h"
#include "bf16_pairs.h"
#include "cross_calls.h"

#define KV_T uint16_t
#define KV_LOAD(p) bf16_to_f32(*(p))
#define KV_LOAD16 load16_bf16
#define KV_PREFETCH prefetch_bf16_slot
#define KV_FN(name) CONCAT(name, bf16)
#define KV_PAIRS BF16_PAIRS
#include "paged_attention_kv.h"
