/* The 8-bit KV cache (`--kv-cache-dtype int8`): what its writer (fused_ops.c) and its readers (the
 * attention kernels' int8 variants) share.
 *
 * Each KV head's row of a slot is head_dim int8 codes followed by that row's float32 scale, in the
 * cache's own bytes: a slot is kv_heads * (head_dim + KV_INT8_SCALE_BYTES) bytes and the value of
 * code c is c * scale. A row's scale is its largest magnitude / 127 (symmetric, per token and KV
 * head, so one outlier token or head costs no other its precision). Keeping the scale inside the
 * row keeps the cache one tensor per layer: blocks are walked, copied and freed as before.
 * Decode attention reads the cache from memory at a rate the cores' arithmetic outpaces, and these
 * rows are 0.53x of a bfloat16 cache's at head_dim 64. */
#ifndef VMESH_KV_INT8_H
#define VMESH_KV_INT8_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <string.h>

#include "vec_math.h"

#define KV_INT8_SCALE_BYTES 4

/* Decode attention over the cache on 16-bit integer pair dots (paged_attention_words.h). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT8_WORDS 1
#else
#define INT8_WORDS 0
#endif

static inline float int8_row_scale(const int8_t *row, int64_t head_dim) {
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

/* x[0..head_dim) -> its codes and scale at row: each code round(x * (127 / largest)), the product
 * rounded to float32 first and then to nearest even, exactly as vmesh/kernels/reference.py's
 * quantize_kv_int8_ref (so no fused multiply-add: the rounding is an instruction of its own). A row
 * with a NaN or an infinity gets zero codes and a NaN scale, so that attention over it is NaN rather
 * than finite garbage; a row below 127 / FLT_MAX in magnitude (no finite inverse) is all zeros. */
static inline void quantize_row_int8(const float *x, int64_t head_dim, int8_t *row) {
    float largest = 0.0f;
    int finite = 1;
#pragma omp simd reduction(max : largest) reduction(& : finite)
    for (int64_t i = 0; i < head_dim; ++i) {
        const float magnitude = x[i] < 0.0f ? -x[i] : x[i];
        largest = magnitude > largest ? magnitude : largest;
        finite &= magnitude <= FLT_MAX; /* false for NaN and infinity */
    }
    const float scale = finite ? largest / 127.0f : __builtin_nanf("");
    const float inverse = finite && largest > 127.0f / FLT_MAX ? 127.0f / largest : 0.0f;
    memcpy(row + head_dim, &scale, sizeof scale);
    if (!finite) {
        memset(row, 0, (size_t)head_dim);
        return;
    }
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 inverses = _mm512_set1_ps(inverse);
    for (; i + 16 <= head_dim; i += 16) /* |x * inverse| <= 127: no saturation */
        _mm_storeu_si128((__m128i *)(row + i),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inverses))));
#endif
    for (; i < head_dim; ++i) row[i] = (int8_t)nearbyintf(x[i] * inverse);
}

/* 16 codes widened to float32. (GCC lowers a generic vector conversion from int8 lane by lane, at
 * ~4x the cost of the whole kernel over a float32 cache: hence the intrinsics, and a loop it does
 * vectorise elsewhere.) */
static inline vec16 load16_i8(const int8_t *p) {
#ifdef __AVX512F__
    const __m512 widened = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    vec16 v;
    memcpy(&v, &widened, sizeof v);
    return v;
#else
    float widened[16];
    for (int i = 0; i < 16; ++i) widened[i] = (float)p[i];
    return load16(widened);
#endif
}

static inline void prefetch_i8_slot(const int8_t *slot, int64_t elements) {
    for (int64_t i = 0; i < elements; i += 64) __builtin_prefetch(slot + i, 0, 2);
}

#endif
