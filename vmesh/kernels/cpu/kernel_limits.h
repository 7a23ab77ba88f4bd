/* The kernels' size limits, stated once: paged_attention.h and prefill_attention.c refuse shapes
 * beyond them (and fused_ops.c's 8-bit bfloat16 KV writer widens a row in MAX_HEAD_DIM floats), the
 * linear kernels switch paths at STREAM_ROWS, and vmesh_kernel_limits
 * (kernel_limits.c) hands them to vmesh/kernels/cpu_native.py, which sends such shapes to the torch path
 * (or picks the linear path) instead. */
#ifndef VMESH_KERNEL_LIMITS_H
#define VMESH_KERNEL_LIMITS_H

#define MAX_HEADS 256    /* query heads per token: the per-token kernel's score rows */
#define MAX_HEAD_DIM 256
/* prefill_attention.c computes in vectors of this many floats (its LANES): its head_dim must be
 * a multiple of it. */
#define PREFILL_LANES 16
/* Up to this many rows a linear layer is one streaming pass over its weights (small_batch_linear.c,
 * quantized_linear.c, integer_linear.c): a speculative decode step verifies 1 + k rows per request,
 * and k <= 5 keeps a single stream on that pass. At 7-8 rows the passes measured no better than the
 * batch paths (benchmarks/README.md, speculative decoding). */
#define STREAM_ROWS 6

#endif
