/* A linear layer with fp16 weights and float32 activations: y[m][n] = x[m][k] . w[n][k].
 *
 * The weight is stored once, at load, as panels of 8 output columns (`ferrox_f16_gemm` documents the
 * layout) and widened to float32 in registers as it is read; products are accumulated in float32, one
 * sum per output in the order of k. This replaces fbgemm's fp16 GEMM for the model's shapes because of
 * the loop order: fbgemm copies (transposes) each 6-row slice of x into a scratch buffer in every thread
 * and then sweeps the whole weight past it, so a 32-row decode step streams each weight slice about six
 * times and repacks x for every call. Here each thread owns a contiguous range of output columns and,
 * for each block of up to ROW_BLOCK rows, sweeps those rows past one 24-column slice of the weight at a
 * time: the slice (k x 24 halves, 27 KB at k = 576) stays in L1/L2 across the rows, x is read in
 * place, and threads never wait on each other inside a call.
 *
 * The register tile is 4 rows x 24 columns (12 accumulators, 3 weight vectors, one broadcast: the 16
 * AVX2 registers). The accumulators are named variables, not an array: GCC keeps an array tile in
 * memory and stores it every iteration, which halved the speed. Without AVX2, FMA and F16C the same
 * loops run in scalar code (correct, slow); `ferrox_f16_gemm_vectorised` says which was built, and
 * the caller prefers fbgemm where it is not. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define F16_GEMM_AVX2 1
#else
#define F16_GEMM_AVX2 0
#endif

enum { PANEL = 8, TILE_ROWS = 4, TILE_PANELS = 3, TILE_COLS = TILE_PANELS * PANEL };
/* Rows swept past each weight slice before the next slice: x's block (64 x k floats, 147 KB at
 * k = 576) stays in L2 while the slices stream through. 32-256 measured alike within noise on a 2-core
 * AVX2 EPYC; 64 covers a decode step of 32-64 rows in one block. */
enum { ROW_BLOCK = 64 };

int ferrox_f16_gemm_vectorised(void) { return F16_GEMM_AVX2; }

#if F16_GEMM_AVX2

static inline __attribute__((always_inline)) __m256 widen(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* One tile of mr <= 4 rows x np <= 3 panels; `mr` and `np` are constants at every call site, so the
 * untaken branches fold away and each variant keeps its accumulators in registers. */
static inline __attribute__((always_inline)) void tile(const int mr, const int np, const float *a, int64_t lda,
                                                       const uint16_t *b, int64_t k, float *c, int64_t ldc) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
    __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
    /* Panels past np are never formed: a pointer beyond the weight's end is undefined even unread. */
    const uint16_t *b0 = b, *b1 = np > 1 ? b + k * PANEL : b, *b2 = np > 2 ? b + 2 * k * PANEL : b;
    for (int64_t t = 0; t < k; ++t) {
        const __m256 w0 = widen(b0 + t * PANEL);
        const __m256 w1 = np > 1 ? widen(b1 + t * PANEL) : w0;
        const __m256 w2 = np > 2 ? widen(b2 + t * PANEL) : w0;
        __m256 v = _mm256_broadcast_ss(a + t);
        c00 = _mm256_fmadd_ps(v, w0, c00);
        if (np > 1) c01 = _mm256_fmadd_ps(v, w1, c01);
        if (np > 2) c02 = _mm256_fmadd_ps(v, w2, c02);
        if (mr > 1) {
            v = _mm256_broadcast_ss(a + lda + t);
            c10 = _mm256_fmadd_ps(v, w0, c10);
            if (np > 1) c11 = _mm256_fmadd_ps(v, w1, c11);
            if (np > 2) c12 = _mm256_fmadd_ps(v, w2, c12);
        }
        if (mr > 2) {
            v = _mm256_broadcast_ss(a + 2 * lda + t);
            c20 = _mm256_fmadd_ps(v, w0, c20);
            if (np > 1) c21 = _mm256_fmadd_ps(v, w1, c21);
            if (np > 2) c22 = _mm256_fmadd_ps(v, w2, c22);
        }
        if (mr > 3) {
            v = _mm256_broadcast_ss(a + 3 * lda + t);
            c30 = _mm256_fmadd_ps(v, w0, c30);
            if (np > 1) c31 = _mm256_fmadd_ps(v, w1, c31);
            if (np > 2) c32 = _mm256_fmadd_ps(v, w2, c32);
        }
    }
    const __m256 rows[4][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32}};
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < np; ++j) _mm256_storeu_ps(c + i * ldc + j * PANEL, rows[i][j]);
}

#define TILE_FN(MR, NP)                                                                                    \
    static void tile_##MR##_##NP(const float *a, int64_t lda, const uint16_t *b, int64_t k, float *c,     \
                                 int64_t ldc) {                                                           \
        tile(MR, NP, a, lda, b, k, c, ldc);                                                               \
    }
TILE_FN(1, 1) TILE_FN(1, 2) TILE_FN(1, 3) TILE_FN(2, 1) TILE_FN(2, 2) TILE_FN(2, 3)
TILE_FN(3, 1) TILE_FN(3, 2) TILE_FN(3, 3) TILE_FN(4, 1) TILE_FN(4, 2) TILE_FN(4, 3)

typedef void (*tile_fn)(const float *, int64_t, const uint16_t *, int64_t, float *, int64_t);
static const tile_fn TILES[TILE_ROWS][TILE_PANELS] = {{tile_1_1, tile_1_2, tile_1_3},
                                                     {tile_2_1, tile_2_2, tile_2_3},
                                                     {tile_3_1, tile_3_2, tile_3_3},
                                                     {tile_4_1, tile_4_2, tile_4_3}};

static void run_tile(int mr, int np, const float *a, int64_t lda, const uint16_t *b, int64_t k, float *c,
                     int64_t ldc) {
    TILES[mr - 1][np - 1](a, lda, b, k, c, ldc);
}

#else

static void run_tile(int mr, int np, const float *a, int64_t lda, const uint16_t *b, int64_t k, float *c,
                     int64_t ldc) {
    float acc[TILE_ROWS][TILE_COLS];
    memset(acc, 0, sizeof acc);
    for (int64_t t = 0; t < k; ++t)
        for (int j = 0; j < np * PANEL; ++j) {
            const float w = f16_load(b[((int64_t)(j / PANEL) * k + t) * PANEL + j % PANEL]);
            for (int i = 0; i < mr; ++i) acc[i][j] += a[i * lda + t] * w;
        }
    for (int i = 0; i < mr; ++i) memcpy(c + i * ldc, acc[i], sizeof(float) * (size_t)(np * PANEL));
}

#endif

/* Panels of an n-column weight, padded to whole 24-column slices: where the second half of a gated
 * weight (`ferrox_f16_gemm_gated`) starts. */
static int64_t slice_panels(int64_t n) {
    return ((n + PANEL - 1) / PANEL + TILE_PANELS - 1) / TILE_PANELS * TILE_PANELS;
}

/* silu(gate) * up for one slice of a row block: the gate's sums for every row of the block go to a
 * buffer first, then the up's tile by tile, each multiplied in as it is formed, so only the product is
 * stored and the 2n-wide projection never reaches memory. Sweeping one half at a time keeps that half's
 * slice in L1 across the block's rows, as the plain GEMM does (alternating the halves per tile measured
 * 0.93-0.95x the unfused pair at 256 rows). silu(g) = g / (1 + exp(-g)), torch's formula, with exp's
 * argument held at 88 (exp(88) is finite in float32): -ffast-math's vector expf is not defined past its
 * range. Below g = -88 silu is then g / 1.6e38 (|silu| <= |g| / 1.6e38, under 1e-30 for any gate a
 * model computes) where torch's overflowing exp gives a signed zero. */
static void gated_slice(int64_t rows, int np, int64_t width, const float *a, int64_t k, const uint16_t *gate,
                        const uint16_t *up, float *y, int64_t ldy) {
    float g[ROW_BLOCK * TILE_COLS], u[TILE_ROWS * TILE_COLS];
    for (int64_t r = 0; r < rows; r += TILE_ROWS) {
        const int mr = rows - r < TILE_ROWS ? (int)(rows - r) : TILE_ROWS;
        run_tile(mr, np, a + r * k, k, gate, k, g + r * TILE_COLS, TILE_COLS);
    }
    for (int64_t r = 0; r < rows; r += TILE_ROWS) {
        const int mr = rows - r < TILE_ROWS ? (int)(rows - r) : TILE_ROWS;
        run_tile(mr, np, a + r * k, k, up, k, u, TILE_COLS);
        for (int i = 0; i < mr; ++i) {
            const float *gi = g + (r + i) * TILE_COLS, *ui = u + i * TILE_COLS;
            float *out = y + (r + i) * ldy;
#pragma omp simd
            for (int64_t c = 0; c < width; ++c) out[c] = gi[c] / (1.0f + expf(fminf(-gi[c], 88.0f))) * ui[c];
        }
    }
}

/* Both entry points: y = x . w^T (n columns), or, `gated`, y = silu(x . gate^T) * (x . up^T) with the
 * gate's panels first and the up's after them from `slice_panels(n)` on. */
static void sweep(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y, int threads,
                  int gated) {
    const int64_t panels = (n + PANEL - 1) / PANEL, slices = (panels + TILE_PANELS - 1) / TILE_PANELS;
    const uint16_t *up = gated ? w + slice_panels(n) * k * PANEL : NULL;
#pragma omp parallel num_threads(slices < threads ? (int)slices : threads)
    {
        const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t first = slices * id / team, last = slices * (id + 1) / team;
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
            const int64_t r1 = r0 + ROW_BLOCK < m ? r0 + ROW_BLOCK : m;
            for (int64_t s = first; s < last; ++s) {
                const int64_t p = s * TILE_PANELS, col = p * PANEL;
                const int np = panels - p < TILE_PANELS ? (int)(panels - p) : TILE_PANELS;
                const int64_t width = n - col < np * PANEL ? n - col : np * PANEL;
                const uint16_t *b = w + p * k * PANEL;
                if (gated) {
                    gated_slice(r1 - r0, np, width, x + r0 * k, k, b, up + p * k * PANEL, y + r0 * n + col, n);
                    continue;
                }
                for (int64_t r = r0; r < r1; r += TILE_ROWS) {
                    const int mr = r1 - r < TILE_ROWS ? (int)(r1 - r) : TILE_ROWS;
                    if (width == np * PANEL) {
                        run_tile(mr, np, x + r * k, k, b, k, y + r * n + col, n);
                    } else { /* the last slice ends inside a panel: through a buffer, so no store passes n */
                        float part[TILE_ROWS * TILE_COLS];
                        run_tile(mr, np, x + r * k, k, b, k, part, TILE_COLS);
                        for (int i = 0; i < mr; ++i)
                            memcpy(y + (r + i) * n + col, part + i * TILE_COLS, sizeof(float) * (size_t)width);
                    }
                }
            }
        }
    }
}

/* x: m rows of k floats (row-major, contiguous); w: ceil(n / 8) panels, panel p holding the halves of
 * output columns 8p .. 8p + 7 as w[(p * k + t) * 8 + c] for t < k (columns past n are zero); y: m rows
 * of n floats. `threads` is the OpenMP team to split the columns over. Returns 0. */
int ferrox_f16_gemm(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y, int threads) {
    if (m <= 0 || n <= 0) return 0;
    if (k <= 0) {
        memset(y, 0, sizeof(float) * (size_t)(m * n));
        return 0;
    }
    sweep(x, m, k, w, n, y, threads, 0);
    return 0;
}

/* The gated MLP's input projection: y[m][n] = silu(x . gate^T) * (x . up^T), for a weight packed as the
 * gate's n columns in panels (as above, padded with zero panels to `slice_panels(n)`) followed by the
 * up's n columns in the same layout. Returns 0. */
int ferrox_f16_gemm_gated(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y,
                          int threads) {
    if (m <= 0 || n <= 0) return 0;
    if (k <= 0) { /* both halves sum to zero, and silu(0) * 0 is zero */
        memset(y, 0, sizeof(float) * (size_t)(m * n));
        return 0;
    }
    sweep(x, m, k, w, n, y, threads, 1);
    return 0;
}
