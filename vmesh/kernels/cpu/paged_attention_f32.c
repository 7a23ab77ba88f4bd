/* paged_attention_f32: paged attention over a float32 KV cache (paged_attention.h). */
#include "paged_attention.h"
#include "cross_calls.h"

#define KV_T float
#define KV_LOAD(p) (*(p))
#define KV_LOAD16 load16
#define KV_PREFETCH prefetch_slot
#define KV_FN(name) CONCAT(name, f32)
#define KV_PAIRS 0
#include "paged_attention_kv.h"
