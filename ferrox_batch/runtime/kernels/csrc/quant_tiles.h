/* The quantized linear's register tiles (quant_gemm.c): sums of x rows against NT decoded weight rows, in
 * the dot form (few rows) and the row form (whole groups of x rows, transposed). Which loops a build has
 * is QUANT_PATH, from what the compiler targets; quant_gemm.c's comment describes each path. Included
 * by quant_gemm.c only. */
#ifndef FERROX_QUANT_TILES_H
#define FERROX_QUANT_TILES_H

#include <stdint.h>
#include <string.h>

#include "quant_segments.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define QUANT_PATH 2
#elif defined(__AVX2__) && defined(__FMA__)
#define QUANT_PATH 1
#else
#define QUANT_PATH 0
#endif

/* MT: x rows per register tile (quant_gemm.c's comment on the paths says why each). */
#if QUANT_PATH == 1
#define MT 3
#else
#define MT 4
#endif

/* ---- register tiles: sums[i * NT + j] = x row i . weight row j, for i < mr ------------------------ */

#if QUANT_PATH >= 2

/* `mr` is a constant at every call site (the TILE_F32 wrappers), so the untaken rows fold away. */
static inline __attribute__((always_inline)) void tile_f32(const int mr, const float *x, int64_t ldx,
                                                           const float *w, int64_t k, float *sums) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    __m512 c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;
    const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
    for (int64_t t = 0; t < k; t += 16) {
        const __m512 b0 = _mm512_loadu_ps(w0 + t), b1 = _mm512_loadu_ps(w1 + t);
        const __m512 b2 = _mm512_loadu_ps(w2 + t), b3 = _mm512_loadu_ps(w3 + t);
        __m512 a = _mm512_loadu_ps(x + t);
        c00 = _mm512_fmadd_ps(a, b0, c00), c01 = _mm512_fmadd_ps(a, b1, c01);
        c02 = _mm512_fmadd_ps(a, b2, c02), c03 = _mm512_fmadd_ps(a, b3, c03);
        if (mr > 1) {
            a = _mm512_loadu_ps(x + ldx + t);
            c10 = _mm512_fmadd_ps(a, b0, c10), c11 = _mm512_fmadd_ps(a, b1, c11);
            c12 = _mm512_fmadd_ps(a, b2, c12), c13 = _mm512_fmadd_ps(a, b3, c13);
        }
        if (mr > 2) {
            a = _mm512_loadu_ps(x + 2 * ldx + t);
            c20 = _mm512_fmadd_ps(a, b0, c20), c21 = _mm512_fmadd_ps(a, b1, c21);
            c22 = _mm512_fmadd_ps(a, b2, c22), c23 = _mm512_fmadd_ps(a, b3, c23);
        }
        if (mr > 3) {
            a = _mm512_loadu_ps(x + 3 * ldx + t);
            c30 = _mm512_fmadd_ps(a, b0, c30), c31 = _mm512_fmadd_ps(a, b1, c31);
            c32 = _mm512_fmadd_ps(a, b2, c32), c33 = _mm512_fmadd_ps(a, b3, c33);
        }
    }
    _mm_storeu_ps(sums, sum4_512(c00, c01, c02, c03));
    if (mr > 1) _mm_storeu_ps(sums + NT, sum4_512(c10, c11, c12, c13));
    if (mr > 2) _mm_storeu_ps(sums + 2 * NT, sum4_512(c20, c21, c22, c23));
    if (mr > 3) _mm_storeu_ps(sums + 3 * NT, sum4_512(c30, c31, c32, c33));
}
#elif QUANT_PATH == 1
static inline __attribute__((always_inline)) void tile_f32(const int mr, const float *x, int64_t ldx,
                                                           const float *w, int64_t k, float *sums) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    __m256 c20 = c00, c21 = c00, c22 = c00, c23 = c00;
    const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
    for (int64_t t = 0; t < k; t += 8) {
        const __m256 a0 = _mm256_loadu_ps(x + t);
        const __m256 a1 = mr > 1 ? _mm256_loadu_ps(x + ldx + t) : a0;
        const __m256 a2 = mr > 2 ? _mm256_loadu_ps(x + 2 * ldx + t) : a0;
        __m256 b = _mm256_loadu_ps(w0 + t);
        c00 = _mm256_fmadd_ps(a0, b, c00);
        if (mr > 1) c10 = _mm256_fmadd_ps(a1, b, c10);
        if (mr > 2) c20 = _mm256_fmadd_ps(a2, b, c20);
        b = _mm256_loadu_ps(w1 + t);
        c01 = _mm256_fmadd_ps(a0, b, c01);
        if (mr > 1) c11 = _mm256_fmadd_ps(a1, b, c11);
        if (mr > 2) c21 = _mm256_fmadd_ps(a2, b, c21);
        b = _mm256_loadu_ps(w2 + t);
        c02 = _mm256_fmadd_ps(a0, b, c02);
        if (mr > 1) c12 = _mm256_fmadd_ps(a1, b, c12);
        if (mr > 2) c22 = _mm256_fmadd_ps(a2, b, c22);
        b = _mm256_loadu_ps(w3 + t);
        c03 = _mm256_fmadd_ps(a0, b, c03);
        if (mr > 1) c13 = _mm256_fmadd_ps(a1, b, c13);
        if (mr > 2) c23 = _mm256_fmadd_ps(a2, b, c23);
    }
    _mm_storeu_ps(sums, sum4_256(c00, c01, c02, c03));
    if (mr > 1) _mm_storeu_ps(sums + NT, sum4_256(c10, c11, c12, c13));
    if (mr > 2) _mm_storeu_ps(sums + 2 * NT, sum4_256(c20, c21, c22, c23));
}
#else
static inline void tile_f32(const int mr, const float *x, int64_t ldx, const float *w, int64_t k, float *sums) {
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NT; ++j) {
            float s = 0.0f;
            for (int64_t t = 0; t < k; ++t) s += x[i * ldx + t] * w[j * k + t];
            sums[i * NT + j] = s;
        }
}
#endif

#define TILE_F32(MR)                                                                                         \
    static void tile_f32_##MR(const float *x, int64_t ldx, const float *w, int64_t k, float *sums) {         \
        tile_f32(MR, x, ldx, w, k, sums);                                                                    \
    }
TILE_F32(1) TILE_F32(2) TILE_F32(3)
#if MT == 4
TILE_F32(4)
#endif

typedef void (*tile_f32_fn)(const float *, int64_t, const float *, int64_t, float *);
#if MT == 4
static const tile_f32_fn TILES_F32[MT] = {tile_f32_1, tile_f32_2, tile_f32_3, tile_f32_4};
#else
static const tile_f32_fn TILES_F32[MT] = {tile_f32_1, tile_f32_2, tile_f32_3};
#endif


/* ---- the row form: 16 (8) x rows per vector, weights broadcast ----------------------------------- */

/* For many rows the dot form above reads every x value from L2 once per 4 weight rows (a byte per
 * multiply-add in float32), which holds it to about half the FMA rate. Here x is transposed once per
 * call into groups of RL rows, [k][RL] (bf16: [k/2][RL] pairs), and each weight value of the decoded
 * (row-major) tile is broadcast against a whole vector of x rows: tiles of RC weight rows x RV_MAX
 * groups, 24 (12) accumulators, one x vector load per group and one broadcast per weight row each step,
 * so x is read once per RC weight rows, the weights stay in the layout they were decoded in, and no
 * horizontal sums are needed. Rows past the last whole group take the dot form. At 32 rows of
 * k = 1,536 on one core of the Emerald Rapids of path 3's note, the dot form ran 35 GMAC/s and this
 * one 49-57 (its register tile alone 60, x and the weights in L2); a lone group (16-31 rows) loads 13
 * values per 12 FMAs and runs about 40. */
#if QUANT_PATH >= 2
#define RL 16    /* x rows per vector */
#define RC 12    /* weight rows per row-form tile: three weight tiles */
#define RV_MAX 2 /* groups per row-form tile: 24 accumulators */
#elif QUANT_PATH == 1
#define RL 8
#define RC 4     /* one weight tile: 12 accumulators + 3 x vectors + a broadcast fill the 16 registers */
#define RV_MAX 3
#endif

#if QUANT_PATH >= 2
/* out[c * RL * RV_MAX + g * RL + r] = sum over t of x[group g, row r][t] * w[c][t], for g < rv. */
static inline __attribute__((always_inline)) void rows_f32(const int rv, const float *xt, int64_t group,
                                                           const float *w, int64_t k, float *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0, b8 = a0, b9 = a0, b10 = a0,
           b11 = a0;
    for (int64_t t = 0; t < k; ++t) {
        const __m512 x0 = _mm512_loadu_ps(xt + t * RL);
        const __m512 x1 = rv > 1 ? _mm512_loadu_ps(xt + group + t * RL) : x0;
#define ROW_STEP(c)                                                                                          \
        {                                                                                                    \
            const __m512 v = _mm512_set1_ps(w[c * k + t]);                                                   \
            a##c = _mm512_fmadd_ps(x0, v, a##c);                                                             \
            if (rv > 1) b##c = _mm512_fmadd_ps(x1, v, b##c);                                                 \
        }
        ROW_STEP(0) ROW_STEP(1) ROW_STEP(2) ROW_STEP(3) ROW_STEP(4) ROW_STEP(5)
        ROW_STEP(6) ROW_STEP(7) ROW_STEP(8) ROW_STEP(9) ROW_STEP(10) ROW_STEP(11)
#undef ROW_STEP
    }
    const __m512 as[RC] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};
    const __m512 bs[RC] = {b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11};
    for (int c = 0; c < RC; ++c) {
        _mm512_storeu_ps(out + c * RL * RV_MAX, as[c]);
        if (rv > 1) _mm512_storeu_ps(out + c * RL * RV_MAX + RL, bs[c]);
    }
}
#endif


#if QUANT_PATH == 1
static inline __attribute__((always_inline)) void rows_f32(const int rv, const float *xt, int64_t group,
                                                           const float *w, int64_t k, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    for (int64_t t = 0; t < k; ++t) {
        const __m256 x0 = _mm256_loadu_ps(xt + t * RL);
        const __m256 x1 = rv > 1 ? _mm256_loadu_ps(xt + group + t * RL) : x0;
        const __m256 x2 = rv > 2 ? _mm256_loadu_ps(xt + 2 * group + t * RL) : x0;
#define ROW_STEP(j)                                                                                          \
        {                                                                                                    \
            const __m256 v = _mm256_broadcast_ss(w + j * k + t);                                             \
            a##j = _mm256_fmadd_ps(x0, v, a##j);                                                             \
            if (rv > 1) b##j = _mm256_fmadd_ps(x1, v, b##j);                                                 \
            if (rv > 2) c##j = _mm256_fmadd_ps(x2, v, c##j);                                                 \
        }
        ROW_STEP(0) ROW_STEP(1) ROW_STEP(2) ROW_STEP(3)
#undef ROW_STEP
    }
    const __m256 acc[3][RC] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}, {c0, c1, c2, c3}};
    for (int c = 0; c < RC; ++c)
        for (int g = 0; g < rv; ++g) _mm256_storeu_ps(out + c * RL * RV_MAX + g * RL, acc[g][c]);
}
#endif

#if QUANT_PATH >= 1
typedef void (*rows_f32_fn)(const float *, int64_t, const float *, int64_t, float *);
#define ROWS_F32(RV)                                                                                         \
    static void rows_f32_##RV(const float *xt, int64_t group, const float *w, int64_t k, float *out) {       \
        rows_f32(RV, xt, group, w, k, out);                                                                  \
    }
ROWS_F32(1) ROWS_F32(2)
#if RV_MAX == 3
ROWS_F32(3)
static const rows_f32_fn ROWS_F32_FNS[RV_MAX] = {rows_f32_1, rows_f32_2, rows_f32_3};
#else
static const rows_f32_fn ROWS_F32_FNS[RV_MAX] = {rows_f32_1, rows_f32_2};
#endif
#endif

#endif
