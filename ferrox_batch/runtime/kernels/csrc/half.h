/* The KV pool's element types, widened to float32 exactly: float32, bfloat16 or IEEE fp16.
 * fp16 is widened with integer bit operations (subnormals, infinities and NaN included), so the
 * generic path needs no F16C; the AVX2 path (paged_decode.c) uses F16C where the compiler has it. */
#ifndef FERROX_HALF_H
#define FERROX_HALF_H

#include "bf16.h"

enum { ELEM_F32 = 0, ELEM_BF16 = 1, ELEM_F16 = 2 };

static inline float f16_load(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1fu) {
        u = sign | 0x7f800000u | (man << 13); /* infinity or NaN */
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign; /* signed zero */
    } else { /* subnormal: value man * 2^-24, normalised */
        int shift = 0;
        while (!(man & 0x400u)) {
            man <<= 1;
            ++shift;
        }
        u = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* d elements of an array of element type `kind`, from `offset` (in elements), as float32. */
static inline void elems_f32(const void *base, int64_t offset, int64_t d, int kind, float *dst) {
    if (kind == ELEM_F16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int64_t j = 0; j < d; ++j) dst[j] = f16_load(src[j]);
    } else {
        row_f32(base, offset, d, kind == ELEM_BF16, dst);
    }
}

#if defined(__AVX2__)
#include <immintrin.h>

/* Eight pool elements of type `kind` from `offset` (in elements), widened to float32 in a register:
 * F16C for fp16 (callers keep fp16 pools off this path where the compiler lacks it), a shift for
 * bfloat16. */
static inline __m256 load8(const void *base, int64_t offset, int kind) {
    if (kind == ELEM_F32) return _mm256_loadu_ps((const float *)base + offset);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + offset));
#if defined(__F16C__)
    if (kind == ELEM_F16) return _mm256_cvtph_ps(h);
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); /* bfloat16 */
}
#endif

#endif
