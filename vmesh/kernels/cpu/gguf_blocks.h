/* The GGUF block formats that quantized_linear.c and integer_linear.c read, stated once: their
 * GGML type ids, their geometry, and where each run of 32 consecutive values of a row lives.
 * vmesh/kernels/cpu_native.py's QUANTIZED_FORMATS is the same table for Python (ctypes cannot read this).
 *
 * A weight [out, in] is stored row by row, each row's input features in consecutive blocks:
 *   Q4_0 (32 values, 18 bytes): d, 16 bytes of nibbles;                value = (q - 8) d
 *   Q4_1 (32 values, 20 bytes): d, m, 16 bytes of nibbles;             value = q d + m
 *   Q5_0 (32 values, 22 bytes): d, 32 fifth bits, 16 bytes of nibbles; value = (q - 16) d
 *   Q8_0 (32 values, 34 bytes): d, 32 signed bytes;                    value = q d
 *   Q4_K (256 values, 144 bytes): d, dmin, 12 bytes of 6-bit scales s and mins m for its eight
 *       sub-blocks of 32, 128 bytes of nibbles;                       value = q (d s) - dmin m
 *   Q6_K (256 values, 210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 signed
 *       byte scales s for its sixteen sub-blocks of 16, d;             value = (q - 32) (d s)
 * d, m, dmin are float16. In Q4_0/Q4_1/Q5_0 byte j holds feature j in its low nibble and j + 16 in
 * its high one (Q5_0's fifth bit of feature j is bit j of its little-endian 32-bit word). Q4_K's
 * nibble bytes go in runs of 32: run r holds sub-block 2r in its low nibbles, 2r + 1 in its high
 * ones. Q6_K's halves of 128 values h each take 64 low-nibble bytes (h * 64...) and 32 bytes of
 * 2-bit pairs (128 + h * 32...): its four runs of 32 values k are the low nibbles of bytes
 * 0-31, of 32-63, the high nibbles of 0-31, of 32-63, each with bits 2k, 2k + 1 of the pair byte.
 *
 * Both kernels work in runs of 32 values, "sub-blocks": a 32-value format's block, or one eighth
 * of a K-quant super-block. Every dequantized value is exact in float32 (at most 23 significant
 * bits: a float16 times a 6-bit scale times a 6-bit code), so a kernel's expansion equals the
 * gguf package's dequantize bit for bit. */
#ifndef VMESH_GGUF_BLOCKS_H
#define VMESH_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

enum { FORMAT_Q4_0 = 2, FORMAT_Q4_1 = 3, FORMAT_Q5_0 = 6, FORMAT_Q8_0 = 8, FORMAT_Q4_K = 12, FORMAT_Q6_K = 14 };
#define SUB_BLOCK 32 /* values per sub-block: one activation block of integer_linear.c */

/* CALL(F, ROWS) with `format` as the compile-time constant F, so that each kernel is specialised
 * per format (callers refuse unknown formats first; Q8_0 is the remaining arm). */
#define FOR_EACH_FORMAT(format, CALL, ROWS)                                                                       \
    switch (format) {                                                                                             \
    case FORMAT_Q4_0: CALL(FORMAT_Q4_0, ROWS); break;                                                             \
    case FORMAT_Q4_1: CALL(FORMAT_Q4_1, ROWS); break;                                                             \
    case FORMAT_Q5_0: CALL(FORMAT_Q5_0, ROWS); break;                                                             \
    case FORMAT_Q4_K: CALL(FORMAT_Q4_K, ROWS); break;                                                             \
    case FORMAT_Q6_K: CALL(FORMAT_Q6_K, ROWS); break;                                                             \
    default: CALL(FORMAT_Q8_0, ROWS); break;                                                                      \
    }

static inline int block_values(int format) {
    return format == FORMAT_Q4_K || format == FORMAT_Q6_K ? 256 : 32;
}

/* 0 for a format neither kernel reads. */
static inline int block_bytes(int format) {
    switch (format) {
    case FORMAT_Q4_0: return 18;
    case FORMAT_Q4_1: return 20;
    case FORMAT_Q5_0: return 22;
    case FORMAT_Q8_0: return 34;
    case FORMAT_Q4_K: return 144;
    case FORMAT_Q6_K: return 210;
    default: return 0;
    }
}

/* Whether a kernel takes this format and width. */
static inline int readable_shape(int format, int64_t in_features) {
    return block_bytes(format) && in_features > 0 && in_features % block_values(format) == 0;
}

static inline int64_t row_bytes(int format, int64_t in_features) {
    return in_features / block_values(format) * block_bytes(format);
}

/* Where the 16 nibble bytes of a Q4_0, Q4_1 or Q5_0 block start. */
static inline int nibbles_at(int format) { return format == FORMAT_Q4_0 ? 2 : format == FORMAT_Q4_1 ? 4 : 6; }

/* The block holding sub-block b of a row, and b's place in it (0 for 32-value formats). */
static inline const uint8_t *sub_block_home(const uint8_t *row, int64_t b, int format) {
    const int per_block = block_values(format) / SUB_BLOCK;
    return row + b / per_block * block_bytes(format);
}

static inline int sub_block_part(int64_t b, int format) { return (int)(b % (block_values(format) / SUB_BLOCK)); }

/* Q4_K: the 6-bit scale and min of sub-block j (0-7) from the 12 bytes that pack them: bytes 0-3
 * hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 take their low 4
 * bits from bytes 8-11 (scales low nibble, mins high) and their top 2 from the top bits of bytes 0-3
 * (scales) and 4-7 (mins). */
static inline void q4k_scale_min(const uint8_t *packed, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = packed[j] & 63;
        *min = packed[j + 4] & 63;
    } else {
        *scale = (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4);
        *min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
}

#if defined(__AVX512F__)
/* Q4_K: a super-block's eight scales times d in lanes 0-7 and eight mins times -dmin in 8-15, from
 * the same 12 bytes, four sub-blocks at a time (q4k_scale_min's layout, byte by byte in 32-bit
 * words). Needs <immintrin.h>, which the kernels include first. */
static inline __m512 q4k_scales_mins(const uint8_t *packed, float d, float dmin) {
    uint32_t w[3];
    memcpy(w, packed, sizeof w);
    const uint32_t scales_low = w[0] & 0x3f3f3f3fu, mins_low = w[1] & 0x3f3f3f3fu;
    const uint32_t scales_high = (w[2] & 0x0f0f0f0fu) | ((w[0] >> 2) & 0x30303030u);
    const uint32_t mins_high = ((w[2] >> 4) & 0x0f0f0f0fu) | ((w[1] >> 2) & 0x30303030u);
    const __m128i six_bits = _mm_set_epi32((int)mins_high, (int)mins_low, (int)scales_high, (int)scales_low);
    const __m512 factors = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d), _mm512_set1_ps(-dmin));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(six_bits)), factors);
}
#endif

#endif
