/* What the attention kernels over a bfloat16 cache share when the CPU has AVX-512 BF16 (VDPBF16PS):
 * a row rounded to bfloat16 pairs, the short base-2 exponential of softmax weights about to be
 * rounded to bfloat16, and lane masks. BF16_PAIRS is 1 where these exist (the same condition as
 * batch_linear_bf16.c), else 0 and the callers keep their float32 arithmetic. */
#ifndef VMESH_BF16_PAIRS_H
#define VMESH_BF16_PAIRS_H

#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_PAIRS 1

/* pairs[p] = x[2p], x[2p + 1] rounded to bfloat16 (nearest, ties to even), for head_dim / 2 pairs. */
static inline void round_pairs(const float *x, uint32_t *pairs, int64_t head_dim) {
    int64_t d = 0;
    for (; d + 2 * 16 <= head_dim; d += 2 * 16)
        _mm512_storeu_si512(pairs + d / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + d + 16),
                                                                         _mm512_loadu_ps(x + d)));
    if (d < head_dim) /* one vector of 16 left (head_dim is a multiple of 16) */
        _mm256_storeu_si256((__m256i *)(pairs + d / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + d)));
}

#define LOG2E 1.44269504088896341f
#define LN2 0.693147180559945309f
#define BF16_PAIR_OF_ONES 0x3F803F80 /* two bfloat16 1.0s: a pair dot with it sums a vector's pairs */

/* Lanes lo .. hi - 1 of a vector's 16 (bounds clamped to 0 .. 16): which keys of it a row sees. */
static inline __mmask16 lanes_between(int64_t lo, int64_t hi) {
    lo = lo < 0 ? 0 : lo, hi = hi > 16 ? 16 : hi;
    return hi <= lo ? 0 : (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

/* 2^t for t <= 0, as softmax weights about to be rounded to bfloat16: t = n + f with n an integer
 * and |f| <= 1/2; 2^f by the degree-5 series of e^(f ln 2) (relative error at most ~3.3e-6, far
 * inside bfloat16's 2^-9) and 2^n by VSCALEFPS. t is raised to -125 first: 2^-125 is still a normal
 * float, so no lane makes a subnormal, and masked lanes (-inf) come out finite for the caller to
 * zero; a NaN stays NaN (VMAXPS returns its second operand when either is NaN), so a NaN or
 * infinite score still makes the row's output NaN. About half of exp16's instructions, which in the
 * float32 path make the weights' full precision. */
static inline __m512 exp2_weights(__m512 t) {
    t = _mm512_max_ps(_mm512_set1_ps(-125.0f), t);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910071f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718055994531f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#else
#define BF16_PAIRS 0
#endif

#endif
