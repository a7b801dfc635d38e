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
 * This is the weight-only kernel: x stays as it is. The layers' default, quant_int8.c, quantizes x to
 * int8 instead and multiplies weights repacked for integer dot products.
 *
 * Return values: 0; -1 when k is not a whole number of a segment's blocks (or a count is negative);
 * -2 for a type that is not one of the seven; -3 when
 * scratch memory could not be had. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_blocks.h"
#include "quant_segments.h"
#include "quant_tiles.h"

/* x rows swept as one block, and scratch for a panel of tiles decoded at once when x takes more than
 * one block, so each block of x meets the whole panel before the next is decoded. Together they fit
 * the smallest L2 this runs on (512 KB): x is then read from L3 once per panel (4 / 36 bytes per
 * multiply-add at k = 1,536, where a panel is 36 rows; up to 256 rows at smaller k) and the panel
 * from L2 once per block. */
enum { X_BLOCK_BYTES = 128 * 1024, PANEL_BYTES = 256 * 1024, MAX_PANEL = 64 };

int ferrox_quant_supported(int type) { return quant_block_elems(type) != 0; }

int ferrox_quant_path(void) { return QUANT_PATH; }

/* ---- the weight's tiles, decoded and swept ---------------------------------------------------------- */

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

