/* MXFP4 (GGML type 39, 17 bytes per 32 weights), the format gpt-oss's experts are published in, as
 * llama.cpp lays it out (`block_mxfp4`):
 *
 *   e uint8 @0 (an E8M0 exponent); qs[16] @1: w[j] from the low nibble of qs[j], w[j + 16] from its high
 *   nibble, as Q4_0's.                            w = KV[nibble] * 2^(e - 128)
 *
 * The nibble is an FP4 (E2M1) code: bit 3 the sign, then the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. KV is
 * llama.cpp's `kvalues_mxfp4`, those magnitudes doubled so they are integers, and the scale is halved to
 * match: 2^(e - 128) where E8M0 means 2^(e - 127). llama.cpp forms it from bits (`ggml_e8m0_to_fp32_half`),
 * the float32 subnormals 2^-128 and 2^-127 for e = 0 and 1, and reads e = 255 (NaN in E8M0) as one more
 * power of two, 2^127, as gguf-py and transformers' `ldexp` also do; so does `mxfp4_half`.
 *
 * Every weight is a product of an integer of at most 4 significant bits and a power of two, exact in
 * float32 (a subnormal scale too: 12 * 2^-128 keeps its bits above 2^-149), or an infinity where it
 * overflows (|KV| >= 2^(256 - e), for e >= 253), as the reference's own product does. So any way of
 * forming it gives gguf's float32 value bit for bit.
 *
 * For integer dot products (quant_packed.h) the codes map to u = KV + 12 in [0, 24] with zero point 12:
 * MXFP4_U is that table, what `vpshufb` looks the stored nibbles up in. */
#ifndef FERROX_QUANT_MXFP4_H
#define FERROX_QUANT_MXFP4_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The doubled FP4 values, by code. */
#define MXFP4_KV 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
/* KV + 12, by code: the unsigned integers the int8 kernel multiplies (zero point 12). */
#define MXFP4_U 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
#define MXFP4_ZERO 12

static const float mxfp4_kv_f32[16] = {MXFP4_KV};
static const int8_t mxfp4_kv_i8[16] = {MXFP4_KV};
static const uint8_t mxfp4_u8[16] = {MXFP4_U};

/* 2^(e - 128), bit for bit as llama.cpp's ggml_e8m0_to_fp32_half forms it. */
static inline float mxfp4_half(uint8_t e) {
    const uint32_t bits = e < 2 ? (uint32_t)0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

static inline void decode_mxfp4(const uint8_t *b, float *restrict out) {
    const float d = mxfp4_half(b[0]);
    const uint8_t *qs = b + 1;
    for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)mxfp4_kv_i8[qs[j] & 15];
        out[j + 16] = d * (float)mxfp4_kv_i8[qs[j] >> 4];
    }
}

#if defined(__AVX2__)
/* The 16 nibbles of qs, low then high, looked up as the signed KV bytes: w[0 .. 16) and w[16 .. 32). */
static inline void mxfp4_kv_bytes(const uint8_t *qs, __m128i *lo, __m128i *hi) {
    const __m128i table = _mm_loadu_si128((const __m128i *)mxfp4_kv_i8), m15 = _mm_set1_epi8(15);
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    *lo = _mm_shuffle_epi8(table, _mm_and_si128(v, m15));
    *hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), m15));
}

/* mxfp4_half of 8 exponents (int32 lanes), from bits as the scalar does. */
static inline __m256 mxfp4_half8(__m256i e) {
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
}
#endif

#if defined(__AVX512F__)
/* mxfp4_half of 16 exponents (int32 lanes). */
static inline __m512 mxfp4_half16(__m512i e) {
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 small = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, tiny));
}
#endif

#endif
