/* RoPE on the query and key heads of a fused QKV projection, then the new K and V written into
 * the paged KV pool: what the decoder's per-layer slice, rotate, concatenate, stack, cast and
 * index_copy_ do in torch, in one pass over the projection's rows.
 *
 * Layouts:
 *   qkv        [n, (heads + 2 * kv) * d]  float32 or bfloat16 (`is_bf16`): q heads, k heads, v heads;
 *                                         the q and k heads are rotated in place
 *   cos, sin   [positions, d]             the rope tables, in qkv's dtype
 *   positions  [n] int64                  row t's position (indexes the tables)
 *   slots      [n] int64                  row t's slot in the pool
 *   pool       [slots, 2, kv, d]          element type `pool_kind` (half.h): slot s holds K then V
 *
 * A head x rotates as torch's `x * cos + cat(-x[half:], x[:half]) * sin` does: in float32 the
 * two products and their sum may be fused (FMA, -ffast-math), so the result is within a few
 * float32 roundings of torch's; in bfloat16 each product and the sum round to bfloat16, as
 * torch's bfloat16 ops do, and the products of two bfloat16 values are exact in float32, so
 * the result is torch's, bit for bit. K and V are then rounded to the pool's type to nearest
 * even (torch's `.to()`), fp16 overflowing to infinity past 65504 as it does.
 * Rows are split over a team of `threads` (torch's intra-op thread count) when there are
 * enough of them. The caller checks the positions and slots are in range. Returns 0, or -1
 * when scratch memory could not be had.
 */
#include "half.h"
#include "kernels.h"

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define FERROX_F16C 1
#else
#define FERROX_F16C 0
#endif

/* float32 to IEEE fp16, rounding to nearest even; infinity past the largest finite, NaN kept a NaN. */
static inline uint16_t f16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t sign = (u >> 16) & 0x8000u, mag = u & 0x7fffffffu;
    if (mag > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((mag >> 13) & 0x3ffu));
    if (mag >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and up round to infinity */
    if (mag >= 0x38800000u) {                                  /* a normal fp16: exponent -14 or more */
        uint32_t r = mag - 0x38000000u;                        /* rebias the exponent by 127 - 15 */
        r += 0x0fffu + ((r >> 13) & 1u);                       /* nearest even on the 13 bits dropped */
        return (uint16_t)(sign | (r >> 13));
    }
    /* fp16 subnormals are multiples of 2^-24: scale (exact) and round to nearest even; 1024 is the
     * smallest normal's encoding, which is what a value that rounds up to 2^-14 must become. */
    float a;
    memcpy(&a, &mag, sizeof a);
    return (uint16_t)(sign | (uint16_t)rintf(a * 16777216.0f));
}

/* d floats stored as element type `kind` at dst (in elements). */
static inline void store_elems(const float *src, void *base, int64_t offset, int64_t d, int kind) {
    if (kind == ELEM_F32) {
        memcpy((float *)base + offset, src, sizeof(float) * (size_t)d);
        return;
    }
    uint16_t *dst = (uint16_t *)base + offset;
    int64_t e = 0;
    if (kind == ELEM_BF16) {
        for (; e < d; ++e) dst[e] = bf16_round(src[e]);
        return;
    }
#if FERROX_F16C
    for (; e + 8 <= d; e += 8)
        _mm_storeu_si128((__m128i *)(dst + e), _mm256_cvtps_ph(_mm256_loadu_ps(src + e), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; e < d; ++e) dst[e] = f16_round(src[e]);
}

/* One head in place: x <- x * cos + rotate_half(x) * sin, in the dtype's arithmetic. */
static inline void rotate(float *x, const float *c, const float *s, int64_t d, int is_bf16, float *out) {
    const int64_t half = d / 2;
    if (is_bf16) {
        for (int64_t e = 0; e < d; ++e) {
            const float other = e < half ? -x[e + half] : x[e - half];
            const uint16_t a = bf16_round(x[e] * c[e]), b = bf16_round(other * s[e]);
            const uint16_t sum = bf16_round(bf16_load(&a) + bf16_load(&b));
            out[e] = bf16_load(&sum);
        }
    } else {
#pragma omp simd
        for (int64_t e = 0; e < half; ++e) out[e] = x[e] * c[e] - x[e + half] * s[e];
#pragma omp simd
        for (int64_t e = half; e < d; ++e) out[e] = x[e] * c[e] + x[e - half] * s[e];
    }
    memcpy(x, out, sizeof(float) * (size_t)d);
}

int ferrox_rope_store(void *qkv, const void *cos, const void *sin, const int64_t *positions, const int64_t *slots,
                      void *pool, int64_t n, int64_t heads, int64_t kv, int64_t d, int is_bf16, int pool_kind,
                      int threads) {
    int failed = 0;
    const int64_t width = (heads + 2 * kv) * d, rotated = (heads + kv) * d;
#pragma omp parallel num_threads(n * width >= 65536 ? threads : 1) reduction(| : failed)
    {
        /* Per thread: one row widened to float32, the row's cos and sin, and one rotated head. */
        float *x = (float *)malloc(sizeof(float) * (size_t)(width + 3 * d + 1));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; ++t) {
            if (x == NULL) {
                failed = 1;
                continue;
            }
            float *c = x + width, *s = c + d, *out = s + d;
            row_f32(qkv, t * width, width, is_bf16, x);
            row_f32(cos, positions[t] * d, d, is_bf16, c);
            row_f32(sin, positions[t] * d, d, is_bf16, s);
            for (int64_t h = 0; h < heads + kv; ++h) rotate(x + h * d, c, s, d, is_bf16, out);
            if (is_bf16) {
                uint16_t *row = (uint16_t *)qkv + t * width;
                for (int64_t e = 0; e < rotated; ++e) row[e] = bf16_round(x[e]); /* exact: x holds bf16 values */
            } else {
                memcpy((float *)qkv + t * width, x, sizeof(float) * (size_t)rotated);
            }
            /* K then V: adjacent in the projection's row as in the pool's slot. */
            store_elems(x + heads * d, pool, slots[t] * 2 * kv * d, 2 * kv * d, pool_kind);
        }
        free(x);
    }
    return failed ? -1 : 0;
}
