/* Math shared by the CPU kernels, written so that GCC and Clang vectorise it in `omp simd` loops. */
#ifndef VMESH_VEC_MATH_H
#define VMESH_VEC_MATH_H

#include <stdint.h>
#include <string.h>

/* exp(x) for the float range (libm's expf does not vectorise without -ffast-math):
 * x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial (relative error ~2e-7),
 * 2^n put straight into the exponent bits. n is rounded by adding and subtracting 1.5 * 2^23
 * because floorf and rintf do not vectorise under strict floating point either. Inputs
 * below -87 give exp(-87) rather than 0: far below what a softmax or SiLU can resolve. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = __builtin_fmaf(n, -0.693359375f, x);
    r = __builtin_fmaf(n, 2.12194440e-4f, r);
    float p = 1.0f / 720.0f;
    p = __builtin_fmaf(p, r, 1.0f / 120.0f);
    p = __builtin_fmaf(p, r, 1.0f / 24.0f);
    p = __builtin_fmaf(p, r, 1.0f / 6.0f);
    p = __builtin_fmaf(p, r, 0.5f);
    p = __builtin_fmaf(p, r, 1.0f);
    p = __builtin_fmaf(p, r, 1.0f);
    const int32_t exponent_bits = ((int32_t)n + 127) << 23;
    float two_to_n;
    memcpy(&two_to_n, &exponent_bits, sizeof two_to_n);
    return p * two_to_n;
}

/* bfloat16 is the upper half of a float32's bits: widening is exact, and narrowing rounds to
 * nearest even as torch's .to(torch.bfloat16) does (a NaN becomes torch's quiet NaN), so that a
 * kernel's bfloat16 output equals torch's rounding of the same float. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7fc0u : (uint16_t)rounded;
}

/* 16 floats as one vector (GCC and Clang lower it to AVX-512, AVX2 or NEON): the attention
 * kernels' unit. memcpy loads and stores: no alignment is assumed. */
typedef float vec16 __attribute__((vector_size(64)));

static inline vec16 load16(const float *p) {
    vec16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, vec16 v) { memcpy(p, &v, sizeof v); }

/* A bfloat16 cache: 16 elements widened to float32 (the upper half of a float's bits). */
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline vec16 load16_bf16(const uint16_t *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    const u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
    vec16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

#endif
