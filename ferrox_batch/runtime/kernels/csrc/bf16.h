/* bfloat16 <-> float32 for the CPU kernels: loads widen exactly; stores round to nearest even,
 * as torch does, so a kernel's bf16 output equals torch's rounding of the same float. */
#ifndef FERROX_BF16_H
#define FERROX_BF16_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* d elements of a float32 or bfloat16 array, from `offset` (in elements), as float32. */
static inline void row_f32(const void *base, int64_t offset, int64_t d, int is_bf16, float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) {
            uint32_t u = (uint32_t)src[j] << 16;
            float f;
            memcpy(&f, &u, sizeof f);
            dst[j] = f;
        }
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)d * sizeof(float));
    }
}

#endif
