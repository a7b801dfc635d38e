/* A linear layer with bf16 weights and bf16 activations: y[m][n] = x[m][k] . w[n][k], every row's result
 * a function of that row alone.
 *
 * oneDNN's bf16 GEMM picks its kernel, and with it the order of each output's sum, by the batch's row
 * count, so the same request's logits move with the batch it shares and greedy answers change. Here
 * the order is fixed by the arithmetic below, whatever the number of rows, the tile a row lands in,
 * the thread count or the path, and decoding one row streams the weight once at the memory's speed,
 * without oneDNN's per-call overhead (the layer stack calls it from C).
 *
 * The arithmetic, per output (r, c), over input pairs t = 0 .. ceil(k / 2) - 1 in order, with x and w
 * widened exactly to float32 (the pair past an odd k is (x[k - 1], 0)):
 *   acc = acc + x[2t + 1] * w[2t + 1]      (the product exact: two 8-bit significands; one rounding)
 *   acc = acc + x[2t] * w[2t]              (one rounding)
 * then y = acc rounded to nearest even bf16 (or kept float32). That is `vdpbf16ps`'s definition, which
 * the AVX-512 BF16 path runs; the other paths compute the same steps with fused multiply-adds (exact
 * product, one rounding), so every path gives the same bits, except where a product or a sum is
 * subnormal (`vdpbf16ps` flushes those to zero).
 *
 * Layout (`ferrox_bf16_pack`): ceil(n / 16) panels of 16 output columns; panel p holds, for each pair
 * t, the 16 columns' (w[2t], w[2t + 1]) as one 32-bit word each, even element in the low half (the
 * operand `vdpbf16ps` takes), zero past n and past k.
 *
 * Paths: AVX-512 BF16: tiles of up to 4 rows x 4 panels (16 accumulators), x's pair broadcast.
 * AVX2 + FMA: tiles of up to 4 rows x 1 panel, each weight word split into its even and odd halves
 * by shift and mask (bf16 -> float32 is a 16-bit shift). Otherwise plain C in the same order.
 * Each thread owns a contiguous range of panels and sweeps every block of ROW_BLOCK rows past one tile's
 * panels before the next: each weight is read from memory once per call (a large weight, the lm head's,
 * read once per row block measured 0.8x oneDNN's at 256 rows), while x's rows are read again per tile
 * of panels, from cache. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BF16_PATH 2
#elif defined(__AVX2__) && defined(__FMA__)
#define BF16_PATH 1
#else
#define BF16_PATH 0
#endif
#if BF16_PATH > 0
#include <immintrin.h>
#endif

/* K_SPAN input pairs of a tile's panels (64 KB at 4 panels) are swept past a whole row block before the
 * next span: a long k (8192 inputs: 1 MB per 4 panels) would otherwise leave L2 between row tiles. */
enum { PANEL = 16, ROW_BLOCK = 64, TILE_ROWS = 4, K_SPAN = 256 };
/* Panels a tile spans: a macro, as the tile table below is chosen by the preprocessor. */
#if BF16_PATH == 2
#define TILE_PANELS 4
#else
#define TILE_PANELS 1
#endif

int ferrox_bf16_path(void) { return BF16_PATH; }

int64_t ferrox_bf16_packed_words(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * PANEL * ((k + 1) / 2); }

int ferrox_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint32_t *out, int threads) {
    if (n < 0 || k < 0) return -1;
    const int64_t pairs = (k + 1) / 2, panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t t = 0; t < pairs; ++t)
            for (int c = 0; c < PANEL; ++c) {
                const int64_t row = p * PANEL + c;
                uint32_t lo = 0, hi = 0;
                if (row < n) {
                    lo = w[row * k + 2 * t];
                    hi = 2 * t + 1 < k ? w[row * k + 2 * t + 1] : 0;
                }
                out[(p * pairs + t) * PANEL + c] = lo | hi << 16;
            }
    return 0;
}

/* x's pair t of a row as one word (even element low), (x[k - 1], 0) past an odd k. */
static inline uint32_t x_pair(const uint16_t *row, int64_t t, int64_t k) {
    if (2 * t + 1 < k) {
        uint32_t word;
        memcpy(&word, row + 2 * t, sizeof word);
        return word;
    }
    return row[2 * t];
}

/* The accumulators of one tile are stored as float32 rows of up to TILE_PANELS * PANEL columns. */
static inline void store_row(const float *acc, int64_t width, void *y, int64_t row_offset, int y_f32) {
    if (y_f32) {
        memcpy((float *)y + row_offset, acc, sizeof(float) * (size_t)width);
    } else {
        uint16_t *out = (uint16_t *)y + row_offset;
        for (int64_t c = 0; c < width; ++c) out[c] = bf16_round(acc[c]);
    }
}

#if BF16_PATH == 2

#define LOAD(I, J) (mr > I && np > J ? _mm512_loadu_ps(acc[I] + J * PANEL) : _mm512_setzero_ps())
static inline __attribute__((always_inline)) void tile(const int mr, const int np, const uint16_t *x, int64_t k,
                                                       int64_t pairs, int64_t t0, int64_t t1, const uint32_t *w,
                                                       float acc[TILE_ROWS][TILE_PANELS * PANEL]) {
    __m512 c00 = LOAD(0, 0), c01 = LOAD(0, 1), c02 = LOAD(0, 2), c03 = LOAD(0, 3);
    __m512 c10 = LOAD(1, 0), c11 = LOAD(1, 1), c12 = LOAD(1, 2), c13 = LOAD(1, 3);
    __m512 c20 = LOAD(2, 0), c21 = LOAD(2, 1), c22 = LOAD(2, 2), c23 = LOAD(2, 3);
    __m512 c30 = LOAD(3, 0), c31 = LOAD(3, 1), c32 = LOAD(3, 2), c33 = LOAD(3, 3);
#undef LOAD
    const int64_t stride = pairs * PANEL; /* words from one panel to the next */
    const uint32_t *w0 = w, *w1 = np > 1 ? w + stride : w, *w2 = np > 2 ? w + 2 * stride : w;
    const uint32_t *w3 = np > 3 ? w + 3 * stride : w;
    for (int64_t t = t0; t < t1; ++t) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + t * PANEL);
        const __m512bh b1 = np > 1 ? (__m512bh)_mm512_loadu_si512(w1 + t * PANEL) : b0;
        const __m512bh b2 = np > 2 ? (__m512bh)_mm512_loadu_si512(w2 + t * PANEL) : b0;
        const __m512bh b3 = np > 3 ? (__m512bh)_mm512_loadu_si512(w3 + t * PANEL) : b0;
#define ROW(I, C0, C1, C2, C3)                                                                            \
    if (mr > I) {                                                                                         \
        const uint32_t word = x_pair(x + I * k, t, k);                                         \
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)word);                                        \
        C0 = _mm512_dpbf16_ps(C0, a, b0);                                                                 \
        if (np > 1) C1 = _mm512_dpbf16_ps(C1, a, b1);                                                     \
        if (np > 2) C2 = _mm512_dpbf16_ps(C2, a, b2);                                                     \
        if (np > 3) C3 = _mm512_dpbf16_ps(C3, a, b3);                                                     \
    }
        ROW(0, c00, c01, c02, c03)
        ROW(1, c10, c11, c12, c13)
        ROW(2, c20, c21, c22, c23)
        ROW(3, c30, c31, c32, c33)
#undef ROW
    }
    const __m512 rows[4][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23},
                               {c30, c31, c32, c33}};
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < np; ++j) _mm512_storeu_ps(acc[i] + j * PANEL, rows[i][j]);
}

#elif BF16_PATH == 1

#define LOAD(I, J) (mr > I ? _mm256_loadu_ps(acc[I] + J * 8) : _mm256_setzero_ps())
static inline __attribute__((always_inline)) void tile(const int mr, const int np, const uint16_t *x, int64_t k,
                                                       int64_t pairs, int64_t t0, int64_t t1, const uint32_t *w,
                                                       float acc[TILE_ROWS][TILE_PANELS * PANEL]) {
    (void)np, (void)pairs;
    __m256 c00 = LOAD(0, 0), c01 = LOAD(0, 1), c10 = LOAD(1, 0), c11 = LOAD(1, 1);
    __m256 c20 = LOAD(2, 0), c21 = LOAD(2, 1), c30 = LOAD(3, 0), c31 = LOAD(3, 1);
#undef LOAD
    const __m256i odd_mask = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t t = t0; t < t1; ++t) {
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(w + t * PANEL));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(w + t * PANEL + 8));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(lo, odd_mask));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(hi, odd_mask));
#define ROW(I, C0, C1)                                                                                    \
    if (mr > I) {                                                                                         \
        const uint32_t word = x_pair(x + I * k, t, k);                                         \
        const __m256i a = _mm256_set1_epi32((int)word);                                                   \
        const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));                                  \
        const __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(a, odd_mask));                             \
        C0 = _mm256_fmadd_ps(xe, e0, _mm256_fmadd_ps(xo, o0, C0));                                        \
        C1 = _mm256_fmadd_ps(xe, e1, _mm256_fmadd_ps(xo, o1, C1));                                        \
    }
        ROW(0, c00, c01)
        ROW(1, c10, c11)
        ROW(2, c20, c21)
        ROW(3, c30, c31)
#undef ROW
    }
    const __m256 rows[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < 2; ++j) _mm256_storeu_ps(acc[i] + j * 8, rows[i][j]);
}

#else

static inline void tile(const int mr, const int np, const uint16_t *x, int64_t k, int64_t pairs, int64_t t0,
                        int64_t t1, const uint32_t *w, float acc[TILE_ROWS][TILE_PANELS * PANEL]) {
    (void)np, (void)pairs;
    for (int64_t t = t0; t < t1; ++t)
        for (int i = 0; i < mr; ++i) {
            const uint32_t word = x_pair(x + i * k, t, k);
            const uint16_t xe_bits = (uint16_t)(word & 0xffffu), xo_bits = (uint16_t)(word >> 16);
            const float xe = bf16_load(&xe_bits), xo = bf16_load(&xo_bits);
            for (int c = 0; c < PANEL; ++c) {
                const uint32_t pair = w[t * PANEL + c];
                const uint16_t we_bits = (uint16_t)(pair & 0xffffu), wo_bits = (uint16_t)(pair >> 16);
                acc[i][c] = fmaf(xe, bf16_load(&we_bits), fmaf(xo, bf16_load(&wo_bits), acc[i][c]));
            }
        }
}

#endif

#define TILE_FN(MR, NP)                                                                                   \
    static void tile_##MR##_##NP(const uint16_t *x, int64_t k, int64_t pairs, int64_t t0, int64_t t1,      \
                                 const uint32_t *w, float acc[TILE_ROWS][TILE_PANELS * PANEL]) {           \
        tile(MR, NP, x, k, pairs, t0, t1, w, acc);                                                         \
    }
typedef void (*tile_fn)(const uint16_t *, int64_t, int64_t, int64_t, int64_t, const uint32_t *,
                        float[TILE_ROWS][TILE_PANELS * PANEL]);
#if TILE_PANELS == 4
TILE_FN(1, 1) TILE_FN(1, 2) TILE_FN(1, 3) TILE_FN(1, 4) TILE_FN(2, 1) TILE_FN(2, 2) TILE_FN(2, 3) TILE_FN(2, 4)
TILE_FN(3, 1) TILE_FN(3, 2) TILE_FN(3, 3) TILE_FN(3, 4) TILE_FN(4, 1) TILE_FN(4, 2) TILE_FN(4, 3) TILE_FN(4, 4)
static const tile_fn TILES[TILE_ROWS][TILE_PANELS] = {{tile_1_1, tile_1_2, tile_1_3, tile_1_4},
                                                     {tile_2_1, tile_2_2, tile_2_3, tile_2_4},
                                                     {tile_3_1, tile_3_2, tile_3_3, tile_3_4},
                                                     {tile_4_1, tile_4_2, tile_4_3, tile_4_4}};
#else
TILE_FN(1, 1) TILE_FN(2, 1) TILE_FN(3, 1) TILE_FN(4, 1)
static const tile_fn TILES[TILE_ROWS][TILE_PANELS] = {{tile_1_1}, {tile_2_1}, {tile_3_1}, {tile_4_1}};
#endif

/* x: m rows of k bf16 (contiguous); w: `ferrox_bf16_pack`'s panels of an [n, k] weight; y: m rows of n
 * bf16 (`y_f32` = 0) or float32. Returns 0, or -1 for a negative size. */
int ferrox_bf16_gemm(const uint16_t *x, int64_t m, int64_t k, const uint32_t *w, int64_t n, void *y, int y_f32,
                     int threads) {
    if (m < 0 || n < 0 || k < 0) return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t pairs = (k + 1) / 2, panels = (n + PANEL - 1) / PANEL;
    /* One panel per thread at least; a single row's weight is split over every thread (memory-bound). */
    const int team_size = panels < threads ? (int)panels : threads;
#pragma omp parallel num_threads(team_size)
    {
        const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t first = panels * id / team, last = panels * (id + 1) / team;
        /* The block's running sums: a tile's accumulators are saved here between spans of k, in float32,
         * so spanning changes nothing of the order. */
        float sums[ROW_BLOCK][TILE_PANELS * PANEL];
        for (int64_t p = first; p < last; p += TILE_PANELS) {
            const int np = last - p < TILE_PANELS ? (int)(last - p) : TILE_PANELS;
            const int64_t col = p * PANEL, width = n - col < np * PANEL ? n - col : np * PANEL;
            for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
                const int64_t r1 = r0 + ROW_BLOCK < m ? r0 + ROW_BLOCK : m;
                memset(sums, 0, sizeof(float) * (size_t)((r1 - r0) * TILE_PANELS * PANEL));
                for (int64_t t0 = 0; t0 < pairs; t0 += K_SPAN) {
                    const int64_t t1 = t0 + K_SPAN < pairs ? t0 + K_SPAN : pairs;
                    for (int64_t r = r0; r < r1; r += TILE_ROWS) {
                        const int mr = r1 - r < TILE_ROWS ? (int)(r1 - r) : TILE_ROWS;
                        TILES[mr - 1][np - 1](x + r * k, k, pairs, t0, t1, w + p * pairs * PANEL,
                                              (float(*)[TILE_PANELS * PANEL])sums[r - r0]);
                    }
                }
                for (int64_t r = r0; r < r1; ++r) store_row(sums[r - r0], width, y, r * n + col, y_f32);
            }
        }
    }
    return 0;
}
