/* The attention kernels' size limits, stated once: paged_attention.c and prefill_attention.c
 * refuse shapes beyond them, and vmesh_kernel_limits (kernel_limits.c) hands them to
 * kernels/cpu_native.py, which sends such shapes to the torch path instead. */
#ifndef VMESH_KERNEL_LIMITS_H
#define VMESH_KERNEL_LIMITS_H

#define MAX_HEADS 256    /* query heads per token: the per-token kernel's score rows */
#define MAX_HEAD_DIM 256
/* prefill_attention.c computes in vectors of this many floats (its LANES): its head_dim must be
 * a multiple of it. */
#define PREFILL_LANES 16

#endif
