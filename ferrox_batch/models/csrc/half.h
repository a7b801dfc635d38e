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

#endif
