/* The limits of kernel_limits.h, for the Python loader to read instead of restating them. */
#include <stdint.h>

#include "kernel_limits.h"

void vmesh_kernel_limits(int64_t *max_heads, int64_t *max_head_dim, int64_t *prefill_head_dim_multiple,
                         int64_t *stream_rows) {
    *max_heads = MAX_HEADS;
    *max_head_dim = MAX_HEAD_DIM;
    *prefill_head_dim_multiple = PREFILL_LANES;
    *stream_rows = STREAM_ROWS;
}
