/* Linear layers and embedding rows straight from GGUF's quantized blocks (quant_blocks.h).
 *
 * `ferrox_quant_gemm` computes y[m][n] = x[m][k] . w[n][k] for a weight kept as the file stores it: the
 * memory a decode step streams is the file's 4.5-8.5 bits per weight, not 16 or 32. The weight may be
 * stacked from segments in different formats (a fused q|k|v projection whose file stores Q and K in Q5_0
 * and V in Q8_0); each segment is `rows` rows of k weights in one format, and they are stacked in order
 * along n.
 *
 * Decode, then multiply. The output rows (weight rows) of all segments are cut into tiles of NT = 4; a
 * thread decodes a tile's rows of k weights into a scratch of its own, once, and then sweeps every row
 * of x past it, so each weight is decoded once per call whatever m is, and at m = 1 the call makes one
 * pass over the weight's bytes (the scratch, 9 KB at k = 576, never leaves L1). Threads own contiguous
 * ranges of tiles, so each streams a contiguous range of the weight and never waits on another inside a
 * call. Two register tilings sweep x past the decoded rows:
 * - the dot form (few rows, and the rows after the last whole group below): MT x NT outputs, each a dot
 *   product of k terms in a vector accumulator (16 or 8 lanes), summed horizontally at the end;
 * - the row form (whole groups of 16, or 8, rows): x transposed once per call, each decoded weight
 *   broadcast against a vector of x rows (see `rows_f32`).
 * For many rows, x is swept in blocks that stay in L2 and the weight is decoded a panel of tiles at a
 * time, every block of x passing the whole panel: still one decode per weight.
 *
 * Paths, by what the compiler targets (`ferrox_quant_path` says which was built):
 *   2  AVX-512F: dot form 4 x 4 of 16-lane float32 FMAs (16 accumulators, 4 weight vectors and one x
 *      vector of the 32 registers, 8 loads per 16 FMAs); row form 12 weight rows x 2 groups of 16 rows.
 *   1  AVX2 + FMA: dot form 3 x 4 of 8 lanes (the tile's 3 x rows loaded first, then each weight vector
 *      once for its 3 FMAs: 12 accumulators + 3 + 1 = the 16 registers, 7 loads per 12 FMAs; 4 x 4
 *      would need 21 registers and spill); row form 4 weight rows x 3 groups of 8.
 *   0  anything else: the dot form in plain C (correct, slow).
 * On every path the weights are the exact float32 decodes and x is read in float32 (bf16 x widened
 * exactly, once per call, into a buffer or as it is transposed). All paths sum in float32 and round bf16
 * output to nearest even once, from the finished sum. No path multiplies in bf16: with AVX512_BF16, a
 * `vdpbf16ps` tile over weights rounded to bf16 measured 1.1-1.6x slower per call than these float32
 * tiles on a 2-core Emerald Rapids (KVM; it issued one per 2 cycles against two FMAs per cycle), and a
 * 32-row decode step of the default model 1.8x slower (130 ms against 72). The accumulators are
 * named variables, not an array: GCC keeps an array tile in memory (see f16_gemm.c).
 *
 * `ferrox_quant_rows` decodes whole rows (the embedding's lookups), exact in float32 and rounded to
 * bf16 with bf16.h's integer rounding (subnormals kept, as torch's cast keeps them).
 *
 * `ferrox_quant_gemm_q8act` (at the end) quantizes x to int8 instead, for few rows.
 *
 * Return values: 0; -1 when k is not a whole number of a segment's blocks (or a count is negative);
 * -2 for a type that is not one of the six (of Q8_0 and Q4_0 for `ferrox_quant_gemm_q8act`); -3 when
 * scratch memory could not be had. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_blocks.h"

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

/* NT: weight rows per tile (decoded together; one accumulator column each). MT: x rows per register
 * tile (the path's comment above says why each). */
#define NT 4
#if QUANT_PATH == 1
#define MT 3
#else
#define MT 4
#endif
/* x rows swept as one block, and scratch for a panel of tiles decoded at once when x takes more than
 * one block, so each block of x meets the whole panel before the next is decoded. Together they fit
 * the smallest L2 this runs on (512 KB): x is then read from L3 once per panel (4 / 36 bytes per
 * multiply-add at k = 1,536, where a panel is 36 rows; up to 256 rows at smaller k) and the panel
 * from L2 once per block. */
enum { X_BLOCK_BYTES = 128 * 1024, PANEL_BYTES = 256 * 1024, MAX_PANEL = 64 };

int ferrox_quant_supported(int type) { return quant_block_elems(type) != 0; }

int ferrox_quant_path(void) { return QUANT_PATH; }

/* ---- register tiles: sums[i * NT + j] = x row i . weight row j, for i < mr ------------------------ */

#if QUANT_PATH >= 1
/* The four sums of four 8-lane accumulators, in order: three horizontal adds and one fold. */
static inline __m128 sum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

#if QUANT_PATH >= 2
static inline __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

static inline __m128 sum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
    return sum4_256(fold512(a), fold512(b), fold512(c), fold512(d));
}

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

/* ---- the weight: segments, tiles ------------------------------------------------------------------ */

typedef struct {
    const uint8_t *w;
    int64_t rows, row_bytes, col, first_tile;
    int type;
} segment_t;

typedef struct {
    const segment_t *segs;
    int64_t n_segs, m, k, n;
    const void *x;   /* float32 (bf16 x is widened before the tiles read it) */
    int out_bf16;    /* y in bf16 */
    void *y;
    int64_t panel;   /* tiles decoded at once */
    int64_t x_block; /* x rows swept as one block */
    const void *xt;  /* the row form's transposed x (float32), or NULL */
    int64_t m_rows;  /* rows [0, m_rows) take the row form (whole groups), the rest the dot form */
} job_t;

/* Parses and checks the (type, rows, address) triples into `segs`; returns the tile count, or -1 / -2. */
static int64_t read_segments(const int64_t *triples, int64_t n_segs, int64_t k, segment_t *segs, int64_t *n) {
    int64_t tiles = 0, col = 0;
    for (int64_t s = 0; s < n_segs; ++s) {
        const int type = (int)triples[3 * s];
        const int64_t rows = triples[3 * s + 1];
        if (!ferrox_quant_supported(type) || (int64_t)type != triples[3 * s]) return -2;
        if (rows < 0 || k % quant_block_elems(type) != 0) return -1;
        segs[s].w = (const uint8_t *)(intptr_t)triples[3 * s + 2];
        segs[s].rows = rows;
        segs[s].row_bytes = k / quant_block_elems(type) * quant_block_bytes(type);
        segs[s].col = col;
        segs[s].first_tile = tiles;
        segs[s].type = type;
        col += rows;
        tiles += (rows + NT - 1) / NT;
    }
    *n = col;
    return tiles;
}

/* NT rows of the weight from row r of segment s into `slot` (float32), rows past
 * the segment's end zero; their sums are computed and never stored. */
static void decode_tile(const job_t *job, const segment_t *s, int64_t r, void *slot) {
    const int64_t k = job->k;
    for (int64_t j = 0; j < NT; ++j) {
        const uint8_t *src = s->w + (r + j) * s->row_bytes;
        const int live = r + j < s->rows;
        float *dst = (float *)slot + j * k;
        if (live)
            quant_decode_row(s->type, src, k, dst);
        else
            memset(dst, 0, sizeof(float) * (size_t)k);
    }
}

/* Rows i .. i + mr - 1 of y, columns col .. col + nt - 1, from a register tile's sums. */
static inline void store_sums(const job_t *job, const float *sums, int mr, int nt, int64_t i, int64_t col) {
    for (int a = 0; a < mr; ++a) {
        const int64_t at = (i + a) * job->n + col;
        if (job->out_bf16) {
            uint16_t *dst = (uint16_t *)job->y + at;
            for (int b = 0; b < nt; ++b) dst[b] = bf16_round(sums[a * NT + b]);
        } else {
            memcpy((float *)job->y + at, sums + a * NT, sizeof(float) * (size_t)nt);
        }
    }
}

/* Every x row past one decoded tile, MT rows at a time, within rows [r0, r1). */
static void sweep_rows(const job_t *job, const void *slot, int nt, int64_t col, int64_t r0, int64_t r1) {
    const int64_t k = job->k;
    float sums[MT * NT];
    for (int64_t i = r0; i < r1; i += MT) {
        const int mr = r1 - i < MT ? (int)(r1 - i) : MT;
        TILES_F32[mr - 1]((const float *)job->x + i * k, k, (const float *)slot, k, sums);
        store_sums(job, sums, mr, nt, i, col);
    }
}

#if QUANT_PATH >= 1
/* Groups [g0, g1) of x past the RC decoded weight rows at `rows` (tiles whose output columns start at
 * col[i], nt[i] of their NT rows real). */
static void sweep_groups(const job_t *job, const void *rows, const int64_t *col, const int *nt, int64_t g0,
                         int64_t g1) {
    const int64_t k = job->k;
    float out[RC * RL * RV_MAX];
    for (int64_t g = g0; g < g1; g += RV_MAX) {
        const int rv = g1 - g < RV_MAX ? (int)(g1 - g) : RV_MAX;
            ROWS_F32_FNS[rv - 1]((const float *)job->xt + g * RL * k, RL * k, (const float *)rows, k, out);
        /* Row by row, each row's (up to) RC columns: runs of adjacent columns. Column by column (each
         * store n floats from the last) this took a quarter of the time at 256 rows. */
        for (int64_t r = 0; r < rv * RL; ++r) {
            const int64_t at = (g * RL + r) * job->n;
            for (int tile = 0; tile < RC / NT; ++tile)
                for (int j = 0; j < nt[tile]; ++j) {
                    const float v = out[(tile * NT + j) * RL * RV_MAX + r];
                    if (job->out_bf16)
                        ((uint16_t *)job->y)[at + col[tile] + j] = bf16_round(v);
                    else
                        ((float *)job->y)[at + col[tile] + j] = v;
                }
        }
    }
}
#endif

/* Tiles [t0, t1): a panel at a time, decoded into `panel` (job->panel slots of NT rows; with the row
 * form a whole number of RC-row tiles, slots past the range zero), then every block of x swept past
 * each of them: its whole groups in the row form, the rows after them in the dot form. */
static void run_tiles(const job_t *job, int64_t t0, int64_t t1, char *panel) {
    const int64_t k = job->k, slot_bytes = NT * k * (int64_t)sizeof(float);
    int64_t s = 0;
    int64_t col[MAX_PANEL];
    int nt[MAX_PANEL];
    for (int64_t p0 = t0; p0 < t1; p0 += job->panel) {
        const int64_t p1 = p0 + job->panel < t1 ? p0 + job->panel : t1;
        for (int64_t t = p0; t < p1; ++t) {
            while (t >= job->segs[s].first_tile + (job->segs[s].rows + NT - 1) / NT) ++s;
            const segment_t *seg = &job->segs[s];
            const int64_t r = (t - seg->first_tile) * NT;
            col[t - p0] = seg->col + r;
            nt[t - p0] = seg->rows - r < NT ? (int)(seg->rows - r) : NT;
            decode_tile(job, seg, r, panel + (t - p0) * slot_bytes);
        }
#if QUANT_PATH >= 1
        int64_t used = p1 - p0;
        if (job->m_rows > 0)
            for (; used % (RC / NT) != 0; ++used) {
                memset(panel + used * slot_bytes, 0, (size_t)slot_bytes);
                nt[used] = 0;
            }
#endif
        for (int64_t r0 = 0; r0 < job->m; r0 += job->x_block) {
            const int64_t r1 = r0 + job->x_block < job->m ? r0 + job->x_block : job->m;
#if QUANT_PATH >= 1
            if (r0 < job->m_rows) {
                const int64_t g1 = (r1 < job->m_rows ? r1 : job->m_rows) / RL;
                for (int64_t t = 0; t < used; t += RC / NT)
                    sweep_groups(job, panel + t * slot_bytes, col + t, nt + t, r0 / RL, g1);
            }
#endif
            const int64_t d0 = r0 > job->m_rows ? r0 : job->m_rows;
            if (d0 < r1)
                for (int64_t t = 0; t < p1 - p0; ++t) sweep_rows(job, panel + t * slot_bytes, nt[t], col[t], d0, r1);
        }
    }
}

/* Rows [0, rows) of x (float32, or bf16 `x_bf16`, widened exactly) transposed into groups of RL: float32
 * [k][RL] each; rows [a, b) of them, a and b whole groups. */
#if QUANT_PATH >= 1
static void transpose_x(const void *x, int x_bf16, int64_t k, int64_t a, int64_t b, void *xt) {
    for (int64_t r = a; r < b; ++r) {
        const int64_t g = r / RL, lane = r % RL;
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + r * k;
            float *dst = (float *)xt + g * RL * k + lane;
            for (int64_t t = 0; t < k; ++t) dst[t * RL] = bf16_load(src + t);
        } else {
            const float *src = (const float *)x + r * k;
            float *dst = (float *)xt + g * RL * k + lane;
            for (int64_t t = 0; t < k; ++t) dst[t * RL] = src[t];
        }
    }
}
#endif

/* The product for checked segments: returns 0, or -3 when memory could not be had. */
static int gemm(const segment_t *segs, int64_t n_segs, int64_t tiles, int64_t n, const void *x, int x_bf16,
                int64_t m, int64_t k, void *y, int threads) {
    job_t job = {segs, n_segs, m, k, n, x, x_bf16 != 0, y, 1, 1, NULL, 0};
    const int64_t elem = sizeof(float); /* bytes of an x value (as the tiles read it) and of a decoded weight */
#if QUANT_PATH >= 1
    job.m_rows = m / RL * RL;
    const int64_t tile_slots = job.m_rows > 0 ? RC / NT : 1; /* tiles a panel holds at least */
#else
    const int64_t tile_slots = 1;
#endif
    /* x rows per block: a whole number of the row form's widest tiles (2 groups of 16 rows, or 3 of 8),
     * so no block ends in a narrower one (1 group of 16: a third slower); the dot form's rows come
     * after the last whole group, in the last block. */
#if QUANT_PATH >= 1
    const int64_t unit = RL * RV_MAX;
#else
    const int64_t unit = MT;
#endif
    const int64_t block = X_BLOCK_BYTES / (k * elem) / unit * unit;
    job.x_block = block < unit ? unit : block;
    job.panel = tile_slots;
    if (m > job.x_block) {
        const int64_t panel = PANEL_BYTES / (NT * k * elem) / tile_slots * tile_slots;
        job.panel = panel < tile_slots ? tile_slots : panel > MAX_PANEL ? MAX_PANEL / tile_slots * tile_slots : panel;
    }
    /* bf16 x: widened once, here, into a buffer every thread reads (only the dot form's rows: the row form
     * widens as it transposes). */
    float *wide = NULL;
    void *xt = NULL;
    const int64_t dot_rows = m - job.m_rows;
    if (x_bf16 && dot_rows > 0) {
        wide = (float *)malloc(sizeof(float) * (size_t)(m * k));
        if (wide == NULL) return -3;
        job.x = wide;
    }
    if (job.m_rows > 0) {
        xt = aligned_alloc(64, (size_t)(job.m_rows * k * elem));
        if (xt == NULL) {
            free(wide);
            return -3;
        }
        job.xt = xt;
    }
    const int team = tiles < threads ? (int)tiles : threads < 1 ? 1 : threads;
    int failed = 0;
#pragma omp parallel num_threads(team) reduction(| : failed)
    {
        const int64_t size = omp_get_num_threads(), id = omp_get_thread_num();
        if (wide != NULL) {
            const int64_t a = job.m_rows + dot_rows * id / size, b = job.m_rows + dot_rows * (id + 1) / size;
            row_f32(x, a * k, (b - a) * k, 1, wide + a * k);
        }
#if QUANT_PATH >= 1
        if (xt != NULL) {
            const int64_t groups = job.m_rows / RL;
            transpose_x(x, x_bf16, k, groups * id / size * RL, groups * (id + 1) / size * RL, xt);
        }
#endif
        if (wide != NULL || xt != NULL) {
#pragma omp barrier
        }
        char *panel = (char *)aligned_alloc(64, (size_t)(job.panel * NT * k * elem));
        if (panel == NULL)
            failed = 1;
        else
            run_tiles(&job, tiles * id / size, tiles * (id + 1) / size, panel);
        free(panel);
    }
    free(wide);
    free(xt);
    return failed ? -3 : 0;
}

int ferrox_quant_gemm(const void *x, int x_bf16, int64_t m, int64_t k, const int64_t *segments, int64_t n_segments,
                      void *y, int threads) {
    if (k <= 0 || m < 0 || n_segments < 0) return -1;
    segment_t few[8];
    segment_t *segs = n_segments <= 8 ? few : (segment_t *)malloc(sizeof(segment_t) * (size_t)n_segments);
    if (segs == NULL) return -3;
    int64_t n = 0;
    const int64_t tiles = read_segments(segments, n_segments, k, segs, &n);
    const int status = tiles < 0                ? (int)tiles
                       : m == 0 || tiles == 0 ? 0
                                              : gemm(segs, n_segments, tiles, n, x, x_bf16, m, k, y, threads);
    if (segs != few) free(segs);
    return status;
}

/* out[i] = row rows[i] of w (rows of k weights of `type`), decoded: n rows of k float32, or bf16 when
 * `out_bf16`. The indices are not checked here (the caller knows how many rows w has). */
int ferrox_quant_rows(int type, const void *w, int64_t k, const int64_t *rows, int64_t n, void *out, int out_bf16,
                      int threads) {
    if (!ferrox_quant_supported(type)) return -2;
    if (k <= 0 || n < 0 || k % quant_block_elems(type) != 0) return -1;
    const int64_t row_bytes = k / quant_block_elems(type) * quant_block_bytes(type);
    int failed = 0;
    /* A few rows (a decode step's tokens) are not worth waking the team for. */
#pragma omp parallel num_threads(n * k >= 65536 ? threads : 1) reduction(| : failed)
    {
        float *row = out_bf16 ? (float *)malloc(sizeof(float) * (size_t)k) : NULL;
        failed = out_bf16 && row == NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
            const uint8_t *src = (const uint8_t *)w + rows[i] * row_bytes;
            if (!out_bf16) {
                quant_decode_row(type, src, k, (float *)out + i * k);
            } else if (row != NULL) {
                quant_decode_row(type, src, k, row);
                uint16_t *dst = (uint16_t *)out + i * k;
                for (int64_t t = 0; t < k; ++t) dst[t] = bf16_round(row[t]);
            }
        }
        free(row);
    }
    return failed ? -3 : 0;
}

/* ---- int8 activations: `ferrox_quant_gemm_q8act` ---------------------------------------------------
 *
 * The small-batch alternative: x is quantized too, each 32-block of each row to int8 with a scale of
 * its own (dx = max |x| / 127, q = nearest(x / dx), so every x is within dx / 2 of dx * q, up to the
 * roundings in forming dx and x / dx), and each block's product is an integer dot product of the
 * weight's quants with x's, scaled by dx * dw in float32. Nothing is decoded to float: at one row the
 * widening kernel's time goes to decoding, here to 32-way integer multiply-adds. Q8_0 and Q4_0 only
 * (-2 for any other type). The result is the exact product with x replaced by its quantized values,
 * summed in float32: it differs from `ferrox_quant_gemm`'s by the activations' quantization (up to
 * half a step of each block's scale times |w|), which the caller accepts by choosing this entry point.
 *
 * Paths (what the build targets; the same sums, exact in int32, in any case):
 *   AVX-512 with AVX512BW and AVX512_VNNI: two blocks (64 bytes) per `vpdpbusd`, unsigned bytes times
 *     signed bytes. x's quants are the signed operand; Q4_0's nibbles (0-15) are the unsigned one and
 *     the -8 comes back as -8 times x's sums, Q8_0's quants are offset by 128 (a xor) and the 128 comes
 *     back as -128 times x's sums: each x row's lane sums are formed once per call, times -8 and -128,
 *     and start each dot product's accumulator. Tiles of 4 x rows x 4 weight rows, 16 float32
 *     accumulators of 16 lanes; each lane's int32 (4 products) is converted exactly (|sum| < 2^17) and
 *     multiplied in by its block's dx * dw.
 *   AVX2 (+ FMA, F16C): one block per vector, `vpmaddubsw` and `vpmaddwd`: the signed quants' absolute
 *     values times x's quants carrying the weight's sign (llama.cpp's arrangement), which keeps each
 *     16-bit pair sum within 2 * 128 * 127 < 2^15, so nothing saturates. Tiles of 2 x 4.
 *   anything else: the same sums in plain C. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8ACT_PATH 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q8ACT_PATH 1
#else
#define Q8ACT_PATH 0
#endif
#if Q8ACT_PATH == 1
#define QMT 2
#else
#define QMT 4
#endif
/* Blocks whose largest |x| is below this quantize to zero: their dx would be subnormal (dx < 2^-126),
 * where it no longer holds x's scale to float32's precision. Each such x moves by less than 2^-119. */
#define Q8ACT_TINY 0x1p-119f

typedef struct {
    const segment_t *segs;
    int64_t m, k, n;
    /* x's rows are kq quants apart (k, or on the AVX-512 path k + 32: a zero block of padding), their lane
     * arrays kq / 4 apart. */
    int64_t kq;
    int8_t *q;          /* [m][kq] x's quants */
    float *dx;          /* [m][k / 32] each block's scale */
    float *lane_dx;     /* [m][kq / 4] the scale of each 4-element lane's block (AVX-512 path) */
    int32_t *c8, *c128; /* [m][kq / 4] -8 and -128 times each lane's sum of quants (AVX-512 path) */
    int out_bf16;
    void *y;
} q8job_t;

/* Row r of x quantized: 32-blocks to int8 and their scales (and the AVX-512 path's lane arrays). */
static void quantize_row(const void *x, int x_bf16, int64_t r, const q8job_t *job) {
    const int64_t k = job->k;
    int8_t *q = job->q + r * job->kq;
    for (int64_t b = 0; b < k / 32; ++b) {
        float v[32], amax = 0.0f;
        row_f32(x, r * k + 32 * b, 32, x_bf16, v);
        for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(v[j]));
        const int tiny = amax < Q8ACT_TINY;
        const float d = tiny ? 0.0f : amax / 127.0f, inv = tiny ? 0.0f : 127.0f / amax;
        for (int j = 0; j < 32; ++j) q[32 * b + j] = (int8_t)lrintf(v[j] * inv); /* |v * inv| < 127.5 */
        job->dx[r * (k / 32) + b] = d;
        if (job->lane_dx != NULL)
            for (int l = 0; l < 8; ++l) {
                const int64_t at = r * (job->kq / 4) + 8 * b + l;
                const int8_t *lane = q + 32 * b + 4 * l;
                const int sum = lane[0] + lane[1] + lane[2] + lane[3];
                job->lane_dx[at] = d;
                job->c8[at] = -8 * sum;
                job->c128[at] = -128 * sum;
            }
    }
}

/* Block b's quants as signed integers and its scale (the plain-C and AVX2 paths' view of a weight). */
static inline float block_ints(int type, const uint8_t *row, int64_t b, int8_t *w) {
    if (type == QT_Q8_0) {
        memcpy(w, row + 34 * b + 2, 32);
        return quant_half(row + 34 * b);
    }
    const uint8_t *qs = row + 18 * b + 2;
    for (int j = 0; j < 16; ++j) {
        w[j] = (int8_t)((qs[j] & 15) - 8);
        w[j + 16] = (int8_t)((qs[j] >> 4) - 8);
    }
    return quant_half(row + 18 * b);
}

#if Q8ACT_PATH == 2
/* Blocks b and b + 1 of a weight row as `vpdpbusd`'s unsigned operand (Q4_0's nibbles, Q8_0's quants
 * + 128) and their scales over each block's 8 lanes; a block past the row's end (k an odd number of
 * blocks) is zero, as x's padding is. */
static inline __attribute__((always_inline)) void weight_pair(const int type, const uint8_t *row, int64_t b,
                                                              int both, __m512i *w, __m512 *dw) {
    uint16_t h0, h1 = 0;
    if (type == QT_Q8_0) {
        const uint8_t *p = row + 34 * b;
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(p + 2));
        const __m256i hi = both ? _mm256_loadu_si256((const __m256i *)(p + 36)) : _mm256_setzero_si256();
        *w = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8((char)0x80));
        memcpy(&h0, p, 2);
        if (both) memcpy(&h1, p + 34, 2);
    } else {
        const uint8_t *p = row + 18 * b;
        const __m128i a = _mm_loadu_si128((const __m128i *)(p + 2));
        const __m128i c = both ? _mm_loadu_si128((const __m128i *)(p + 20)) : _mm_setzero_si128();
        const __m256i y0 = _mm256_inserti128_si256(_mm256_castsi128_si256(a), _mm_srli_epi16(a, 4), 1);
        const __m256i y1 = _mm256_inserti128_si256(_mm256_castsi128_si256(c), _mm_srli_epi16(c, 4), 1);
        *w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(y0), y1, 1), _mm512_set1_epi8(15));
        memcpy(&h0, p, 2);
        if (both) memcpy(&h1, p + 18, 2);
    }
    *dw = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)h0)),
                                                  _mm_set1_epi16((short)h1), 1));
}

static inline __attribute__((always_inline)) void q8_tile(const int type, const int mr, const q8job_t *job,
                                                          int64_t i, const uint8_t *const *rows, float *sums) {
    const int64_t k = job->k, nb = k / 32;
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    __m512 c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;
    const int32_t *corr = type == QT_Q8_0 ? job->c128 : job->c8;
    for (int64_t b = 0; b < nb; b += 2) {
        const int both = b + 1 < nb;
        __m512i w0, w1, w2, w3;
        __m512 d0, d1, d2, d3;
        weight_pair(type, rows[0], b, both, &w0, &d0);
        weight_pair(type, rows[1], b, both, &w1, &d1);
        weight_pair(type, rows[2], b, both, &w2, &d2);
        weight_pair(type, rows[3], b, both, &w3, &d3);
        /* x's row r at blocks b, b + 1 (a missing second block reads x's zero padding). */
#define Q8_ROW(r, a0, a1, a2, a3)                                                                         \
        if (mr > r) {                                                                                     \
            const int64_t lane = (i + r) * (job->kq / 4) + 8 * b;                                         \
            const __m512i xq = _mm512_loadu_si512((const void *)(job->q + (i + r) * job->kq + 32 * b));   \
            const __m512i c = _mm512_loadu_si512((const void *)(corr + lane));                           \
            const __m512 dx = _mm512_loadu_ps(job->lane_dx + lane);                                      \
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, w0, xq)), _mm512_mul_ps(d0, dx), a0); \
            a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, w1, xq)), _mm512_mul_ps(d1, dx), a1); \
            a2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, w2, xq)), _mm512_mul_ps(d2, dx), a2); \
            a3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, w3, xq)), _mm512_mul_ps(d3, dx), a3); \
        }
        Q8_ROW(0, c00, c01, c02, c03)
        Q8_ROW(1, c10, c11, c12, c13)
        Q8_ROW(2, c20, c21, c22, c23)
        Q8_ROW(3, c30, c31, c32, c33)
#undef Q8_ROW
    }
    _mm_storeu_ps(sums, sum4_512(c00, c01, c02, c03));
    if (mr > 1) _mm_storeu_ps(sums + NT, sum4_512(c10, c11, c12, c13));
    if (mr > 2) _mm_storeu_ps(sums + 2 * NT, sum4_512(c20, c21, c22, c23));
    if (mr > 3) _mm_storeu_ps(sums + 3 * NT, sum4_512(c30, c31, c32, c33));
}
#elif Q8ACT_PATH == 1
static inline __attribute__((always_inline)) void q8_tile(const int type, const int mr, const q8job_t *job,
                                                          int64_t i, const uint8_t *const *rows, float *sums) {
    const int64_t k = job->k;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    for (int64_t b = 0; b < k / 32; ++b) {
        __m256i w[NT];
        __m256 dw[NT];
        for (int j = 0; j < NT; ++j) {
            int8_t q[32];
            dw[j] = _mm256_set1_ps(block_ints(type, rows[j], b, q));
            w[j] = _mm256_loadu_si256((const __m256i *)q);
        }
        const __m256i a0 = _mm256_sign_epi8(w[0], w[0]), a1 = _mm256_sign_epi8(w[1], w[1]);
        const __m256i a2 = _mm256_sign_epi8(w[2], w[2]), a3 = _mm256_sign_epi8(w[3], w[3]);
#define Q8_DOT(a, wj, xq) _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(xq, wj)), ones))
#define Q8_ROW(r, s0, s1, s2, s3)                                                                         \
        if (mr > r) {                                                                                     \
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(job->q + (i + r) * k + 32 * b));      \
            const __m256 dx = _mm256_broadcast_ss(job->dx + (i + r) * (k / 32) + b);                     \
            s0 = _mm256_fmadd_ps(Q8_DOT(a0, w[0], xq), _mm256_mul_ps(dw[0], dx), s0);                     \
            s1 = _mm256_fmadd_ps(Q8_DOT(a1, w[1], xq), _mm256_mul_ps(dw[1], dx), s1);                     \
            s2 = _mm256_fmadd_ps(Q8_DOT(a2, w[2], xq), _mm256_mul_ps(dw[2], dx), s2);                     \
            s3 = _mm256_fmadd_ps(Q8_DOT(a3, w[3], xq), _mm256_mul_ps(dw[3], dx), s3);                     \
        }
        Q8_ROW(0, c00, c01, c02, c03)
        Q8_ROW(1, c10, c11, c12, c13)
#undef Q8_ROW
#undef Q8_DOT
    }
    _mm_storeu_ps(sums, sum4_256(c00, c01, c02, c03));
    if (mr > 1) _mm_storeu_ps(sums + NT, sum4_256(c10, c11, c12, c13));
}
#else
static inline void q8_tile(const int type, const int mr, const q8job_t *job, int64_t i, const uint8_t *const *rows,
                           float *sums) {
    const int64_t k = job->k;
    for (int a = 0; a < mr; ++a)
        for (int j = 0; j < NT; ++j) {
            float acc = 0.0f;
            for (int64_t b = 0; b < k / 32; ++b) {
                int8_t w[32];
                const float dw = block_ints(type, rows[j], b, w);
                const int8_t *xq = job->q + (i + a) * k + 32 * b;
                int32_t dot = 0;
                for (int t = 0; t < 32; ++t) dot += (int32_t)xq[t] * w[t];
                acc += (float)dot * (dw * job->dx[(i + a) * (k / 32) + b]);
            }
            sums[a * NT + j] = acc;
        }
}
#endif

#define Q8_TILE(TYPE, MR)                                                                                    \
    static void q8_tile_##TYPE##_##MR(const q8job_t *job, int64_t i, const uint8_t *const *rows, float *sums) { \
        q8_tile(QT_##TYPE, MR, job, i, rows, sums);                                                          \
    }
typedef void (*q8_tile_fn)(const q8job_t *, int64_t, const uint8_t *const *, float *);
#if QMT == 4
Q8_TILE(Q8_0, 1) Q8_TILE(Q8_0, 2) Q8_TILE(Q8_0, 3) Q8_TILE(Q8_0, 4)
Q8_TILE(Q4_0, 1) Q8_TILE(Q4_0, 2) Q8_TILE(Q4_0, 3) Q8_TILE(Q4_0, 4)
static const q8_tile_fn Q8_TILES[2][QMT] = {{q8_tile_Q8_0_1, q8_tile_Q8_0_2, q8_tile_Q8_0_3, q8_tile_Q8_0_4},
                                            {q8_tile_Q4_0_1, q8_tile_Q4_0_2, q8_tile_Q4_0_3, q8_tile_Q4_0_4}};
#else
Q8_TILE(Q8_0, 1) Q8_TILE(Q8_0, 2) Q8_TILE(Q4_0, 1) Q8_TILE(Q4_0, 2)
static const q8_tile_fn Q8_TILES[2][QMT] = {{q8_tile_Q8_0_1, q8_tile_Q8_0_2}, {q8_tile_Q4_0_1, q8_tile_Q4_0_2}};
#endif

/* Tiles [t0, t1) of the weight: each tile's NT rows (a row past the segment's end repeats its last
 * row; its sums are never stored) against every x row. */
static void q8_run_tiles(const q8job_t *job, int64_t t0, int64_t t1) {
    int64_t s = 0;
    float sums[QMT * NT];
    for (int64_t t = t0; t < t1; ++t) {
        while (t >= job->segs[s].first_tile + (job->segs[s].rows + NT - 1) / NT) ++s;
        const segment_t *seg = &job->segs[s];
        const int64_t r = (t - seg->first_tile) * NT;
        const int nt = seg->rows - r < NT ? (int)(seg->rows - r) : NT;
        const uint8_t *rows[NT];
        for (int j = 0; j < NT; ++j) rows[j] = seg->w + (r + (j < nt ? j : nt - 1)) * seg->row_bytes;
        for (int64_t i = 0; i < job->m; i += QMT) {
            const int mr = job->m - i < QMT ? (int)(job->m - i) : QMT;
            Q8_TILES[seg->type == QT_Q8_0 ? 0 : 1][mr - 1](job, i, rows, sums);
            for (int a = 0; a < mr; ++a) {
                const int64_t at = (i + a) * job->n + seg->col + r;
                if (job->out_bf16) {
                    uint16_t *dst = (uint16_t *)job->y + at;
                    for (int b = 0; b < nt; ++b) dst[b] = bf16_round(sums[a * NT + b]);
                } else {
                    memcpy((float *)job->y + at, sums + a * NT, sizeof(float) * (size_t)nt);
                }
            }
        }
    }
}

int ferrox_quant_gemm_q8act(const void *x, int x_bf16, int64_t m, int64_t k, const int64_t *segments,
                            int64_t n_segments, void *y, int threads) {
    if (k <= 0 || m < 0 || n_segments < 0) return -1;
    for (int64_t s = 0; s < n_segments; ++s)
        if (segments[3 * s] != QT_Q8_0 && segments[3 * s] != QT_Q4_0) return -2;
    segment_t few[8];
    segment_t *segs = n_segments <= 8 ? few : (segment_t *)malloc(sizeof(segment_t) * (size_t)n_segments);
    if (segs == NULL) return -3;
    int64_t n = 0;
    const int64_t tiles = read_segments(segments, n_segments, k, segs, &n);
    int status = tiles < 0 ? (int)tiles : 0;
    if (status == 0 && m > 0 && tiles > 0) {
        /* The AVX-512 path reads x two blocks at a time: its rows are padded with a zero block (a
         * quant of 0, a scale of 0) to a whole number of pairs. */
        const int64_t kq = Q8ACT_PATH == 2 ? k + 32 : k, lanes = kq / 4;
        q8job_t job = {segs, m, k, n, kq, NULL, NULL, NULL, NULL, NULL, x_bf16 != 0, y};
        job.q = (int8_t *)calloc((size_t)(m * kq), 1);
        job.dx = (float *)malloc(sizeof(float) * (size_t)(m * (k / 32)));
        if (Q8ACT_PATH == 2) {
            job.lane_dx = (float *)calloc((size_t)(m * lanes), sizeof(float));
            job.c8 = (int32_t *)calloc((size_t)(m * lanes), sizeof(int32_t));
            job.c128 = (int32_t *)calloc((size_t)(m * lanes), sizeof(int32_t));
        }
        if (job.q == NULL || job.dx == NULL ||
            (Q8ACT_PATH == 2 && (job.lane_dx == NULL || job.c8 == NULL || job.c128 == NULL))) {
            status = -3;
        } else {
            const int team = tiles < threads ? (int)tiles : threads < 1 ? 1 : threads;
#pragma omp parallel num_threads(team)
            {
                const int64_t size = omp_get_num_threads(), id = omp_get_thread_num();
                for (int64_t r = m * id / size; r < m * (id + 1) / size; ++r) quantize_row(x, x_bf16, r, &job);
#pragma omp barrier
                q8_run_tiles(&job, tiles * id / size, tiles * (id + 1) / size);
            }
        }
        free(job.q);
        free(job.dx);
        free(job.lane_dx);
        free(job.c8);
        free(job.c128);
    }
    if (segs != few) free(segs);
    return status;
}
