/* The quantized linear, `ferrox_packed_gemm`: y = x @ w.T with w in quant_packed.h's layout and x
 * quantized per call to int8, each 32-block of each row with a scale of its own, as llama.cpp's CPU
 * matmuls do: integer dot products where a float kernel would widen every weight.
 *
 * The arithmetic, the same on every path and at every batch size:
 *   x's block: dx = max|x| / 127, qx = nearest(x * (127 / max|x|)), so |x - dx * qx| <= dx / 2 up to the
 *   roundings of dx and of the product (a block whose max |x| is below 2^-119 quantizes to zero: its dx
 *   would be subnormal; each x moves by less than 2^-119).
 *   per weight row and block (per half block for Q6_K's 16-input scales), in block order:
 *     i   = sum u * qx - o * sum qx                     (int32, exact: |i| < 2^20)
 *     acc = fma((float)i, d * dx, acc)                  (two roundings)
 *     acc = fma(m, dx * sum qx, acc)                    (formats with a minimum)
 * A row's result therefore depends on that row alone: not on how many rows share the call, nor on the
 * thread count, nor on the path (the integer sums are exact in any order, and the float steps are the
 * same operations in the same order). That is what makes a request's answer the same alone or batched.
 *
 * Paths (what the build targets):
 *   AVX-512 with AVX512BW and AVX512_VNNI: a weight vector is 16 rows by 4 inputs as packed, expanded in
 *     registers (nibbles masked and shifted, the fifth bit added under a byte mask, the 2-bit pairs
 *     shifted into place, MXFP4's codes looked up by `vpshufb`), and `vpdpbusd` multiplies it by 4 of
 *     x's bytes broadcast: 8 of them per row and block, into two int32 accumulators. Tiles of up to 8 x
 *     rows share each expanded block.
 *   AVX2 (+ FMA, F16C): the same over 8 weight rows at a time, `vpmaddubsw` then `vpmaddwd` by ones.
 *     Q8_0's quants go signed with x taking their sign (llama.cpp's arrangement), so no 16-bit pair sum
 *     can saturate (2 * 128 * 127 < 2^15); the other formats' u are at most 63.
 *   anything else: the same sums in plain C over weights unpacked a group at a time. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_packed.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PACKED_PATH 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PACKED_PATH 1
#else
#define PACKED_PATH 0
#endif
#if PACKED_PATH > 0
#include <immintrin.h>
#endif

#define TINY_BLOCK 0x1p-119f
/* A tile of at most PREFETCH_ROWS x rows (a decode step of one or two sequences) is bound by how fast its
 * weights arrive: each thread reads one group's units in a single stream, which the hardware prefetcher
 * alone fetched at about 37 GB/s on a 2-core Zen 4 where a bf16 GEMM's four streams reached 45-50. So the
 * unit PREFETCH_UNITS ahead is asked for while this one is multiplied: the 1B-shaped Q4_K_M model's
 * one-row forward went from 18.0 to 16.1 ms there (medians of four alternated runs; two units ahead
 * measured between the two, four no better than none). */
#define PREFETCH_UNITS 1
#define PREFETCH_ROWS 2
/* x rows a tile shares an expanded weight block among (AVX2 keeps fewer vectors in its 16 registers). */
#if PACKED_PATH == 1
#define MR 4
#else
#define MR 8
#endif

int ferrox_packed_path(void) { return PACKED_PATH; }

typedef struct {
    int64_t k, nb;
    int8_t *q;    /* [m][k] */
    float *dx;    /* [m][nb] */
    int32_t *sq;  /* [m][2 nb]: sums of each 16 quants */
    float *s;     /* [m][nb]: dx * the block's sum */
} acts_t;

typedef struct {
    const uint8_t *w;
    int64_t rows, col, first_group, group_bytes;
    int type;
    packed_fmt_t f;
} pseg_t;

static void quantize_row(const void *x, int x_bf16, int64_t r, const acts_t *a) {
    const int64_t k = a->k, nb = a->nb;
    int8_t *q = a->q + r * k;
    for (int64_t b = 0; b < nb; ++b) {
        float v[32], amax = 0.0f;
        row_f32(x, r * k + 32 * b, 32, x_bf16, v);
        uint32_t special = 0; /* an infinity or a NaN, by its exponent bits (-ffast-math assumes neither) */
        for (int j = 0; j < 32; ++j) {
            uint32_t bits;
            memcpy(&bits, &v[j], sizeof bits);
            special |= (bits & 0x7f800000u) == 0x7f800000u;
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const int tiny = special || amax < TINY_BLOCK;
        /* A block holding an infinity or a NaN makes its row's outputs NaN, as a float product would. */
        const float d = special ? __builtin_nanf("") : tiny ? 0.0f : amax / 127.0f, inv = tiny ? 0.0f : 127.0f / amax;
        int32_t lo = 0, hi = 0;
        for (int j = 0; j < 32; ++j) {
            const int8_t qj = (int8_t)lrintf(v[j] * inv); /* |v * inv| < 127.5 */
            q[32 * b + j] = qj;
            if (j < 16) lo += qj; else hi += qj;
        }
        a->dx[r * nb + b] = d;
        a->sq[r * 2 * nb + 2 * b] = lo;
        a->sq[r * 2 * nb + 2 * b + 1] = hi;
        a->s[r * nb + b] = d * (float)(lo + hi);
    }
}

static inline void store_row(void *y, int out_bf16, int64_t n, int64_t row, int64_t col, const float *v, int count) {
    if (out_bf16) {
        uint16_t *dst = (uint16_t *)y + row * n + col;
        for (int c = 0; c < count; ++c) dst[c] = bf16_round(v[c]);
    } else {
        memcpy((float *)y + row * n + col, v, sizeof(float) * (size_t)count);
    }
}

#if PACKED_PATH == 2
#include "quant_int8_avx512.h"
#elif PACKED_PATH == 1
#include "quant_int8_avx2.h"
#endif

#if PACKED_PATH > 0
/* The tiles of one type, R rows at a time: 8 (or 4), then what is left, largest first. Every row's sums
 * are the same operations whichever tile it falls in. */
#define TILES(T)                                                                                  \
    for (; r + MR <= r1; r += MR) { tile(T, MR, s, gw, a, r, out); emit(MR); }                   \
    if (MR > 4 && r + 4 <= r1) { tile(T, 4, s, gw, a, r, out); emit(4); r += 4; }               \
    if (r + 2 <= r1) { tile(T, 2, s, gw, a, r, out); emit(2); r += 2; }                          \
    if (r < r1) { tile(T, 1, s, gw, a, r, out); emit(1); r += 1; }

static void group_rows(const pseg_t *s, int64_t g, const acts_t *a, int64_t r0, int64_t r1, void *y, int out_bf16,
                       int64_t n) {
    const uint8_t *gw = s->w + g * s->group_bytes;
    const int valid = (int)(s->rows - g * PG < PG ? s->rows - g * PG : PG);
    const int64_t col = s->col + g * PG;
    float out[MR * 16];
    int64_t r = r0;
#define emit(R) for (int i = 0; i < (R); ++i) store_row(y, out_bf16, n, r + i, col, out + 16 * i, valid)
    switch (s->type) {
    case QT_Q8_0: TILES(QT_Q8_0) break;
    case QT_Q4_0: TILES(QT_Q4_0) break;
    case QT_Q4_1: TILES(QT_Q4_1) break;
    case QT_Q5_0: TILES(QT_Q5_0) break;
    case QT_Q4_K: TILES(QT_Q4_K) break;
    case QT_Q6_K: TILES(QT_Q6_K) break;
    case QT_MXFP4: TILES(QT_MXFP4) break;
    default: break;
    }
#undef emit
}
#else
/* Plain C: the group's u values and scales unpacked once (into `scratch`), then every x row. */
static void group_rows(const pseg_t *s, int64_t g, const acts_t *a, int64_t r0, int64_t r1, void *y, int out_bf16,
                       int64_t n, uint8_t *scratch) {
    const packed_fmt_t f = s->f;
    const int64_t k = a->k, nb = a->nb, unit_bytes = packed_unit_bytes(&f), bpu = f.unit_k / 32;
    const int valid = (int)(s->rows - g * PG < PG ? s->rows - g * PG : PG);
    uint8_t *u = scratch;                             /* [16][k] */
    float *d = (float *)(scratch + PG * k);           /* [16][2 nb] */
    float *m = d + PG * 2 * nb;                       /* [16][nb] */
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *unit = s->w + g * s->group_bytes + b / bpu * unit_bytes;
        const int j = (int)(b % bpu);
        for (int r = 0; r < PG; ++r) {
            packed_ints(&f, unit + f.head + j * f.qbytes, r, u + r * k + 32 * b);
            packed_scales(s->type, unit, j, r, d + r * 2 * nb + 2 * b, m + r * nb + b);
        }
    }
    for (int64_t row = r0; row < r1; ++row) {
        const int8_t *xq = a->q + row * k;
        const int32_t *sq = a->sq + row * 2 * nb;
        float out[PG];
        for (int c = 0; c < valid; ++c) {
            const uint8_t *uc = u + c * k;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                const float dx = a->dx[row * nb + b];
                for (int h = 0; h < (f.sub == 32 ? 1 : 2); ++h) {
                    const int from = f.sub == 32 ? 0 : 16 * h, count = f.sub;
                    int32_t i = -f.zero * (f.sub == 32 ? sq[2 * b] + sq[2 * b + 1] : sq[2 * b + h]);
                    for (int l = from; l < from + count; ++l) i += (int32_t)uc[32 * b + l] * xq[32 * b + l];
                    acc = fmaf((float)i, d[c * 2 * nb + 2 * b + h] * dx, acc);
                }
                if (f.has_min) acc = fmaf(m[c * nb + b], a->s[row * nb + b], acc);
            }
            out[c] = acc;
        }
        store_row(y, out_bf16, n, row, s->col + g * PG, out, valid);
    }
}
#endif

/* A weight's (type, rows, address) triples read into `segs`, stacked along the outputs: each segment's first
 * output column and first group. `*width` and `*groups` get the weight's outputs and groups. 0, or -2 for a
 * type not packed here, -1 for a k that is not whole units of a segment's format. */
static int read_segments(const int64_t *triples, int64_t count, int64_t k, pseg_t *segs, int64_t *width,
                         int64_t *groups) {
    int64_t n = 0, g = 0;
    for (int64_t i = 0; i < count; ++i) {
        pseg_t *s = &segs[i];
        s->type = (int)triples[3 * i];
        s->rows = triples[3 * i + 1];
        s->w = (const uint8_t *)(intptr_t)triples[3 * i + 2];
        if ((int64_t)s->type != triples[3 * i] || !packed_fmt(s->type, &s->f)) return -2;
        if (s->rows < 0 || k % s->f.unit_k != 0) return -1;
        s->group_bytes = packed_group_bytes(&s->f, k);
        s->col = n;
        s->first_group = g;
        n += s->rows;
        g += (s->rows + PG - 1) / PG;
    }
    *width = n;
    *groups = g;
    return 0;
}

/* x [m][k] (float32, or bf16 when `x_bf16`) times the packed weights `segments` ((type, rows, address)
 * triples, stacked along the outputs) -> y [m][n] in x's dtype. -1: k is not a whole number of a
 * format's units; -2: a type not packed here; -3: no memory. */
int ferrox_packed_gemm(const void *x, int x_bf16, int64_t m, int64_t k, const int64_t *segments, int64_t n_segments,
                       void *y, int threads) {
    if (k <= 0 || m < 0 || n_segments < 0 || k % 32 != 0) return -1;
    pseg_t few[8];
    pseg_t *segs = n_segments <= 8 ? few : (pseg_t *)malloc(sizeof(pseg_t) * (size_t)n_segments);
    if (segs == NULL) return -3;
    int64_t n = 0, groups = 0;
    int status = read_segments(segments, n_segments, k, segs, &n, &groups);
    acts_t a = {k, k / 32, NULL, NULL, NULL, NULL};
    if (status == 0 && m > 0 && groups > 0) {
        a.q = (int8_t *)malloc((size_t)(m * k));
        a.dx = (float *)malloc(sizeof(float) * (size_t)(m * a.nb));
        a.sq = (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * 2 * a.nb));
        a.s = (float *)malloc(sizeof(float) * (size_t)(m * a.nb));
        if (a.q == NULL || a.dx == NULL || a.sq == NULL || a.s == NULL) status = -3;
    }
    if (status == 0 && m > 0 && groups > 0) {
        /* Rows in chunks whose quants stay in the cache while every group passes over them. */
        const int64_t chunk = k * 64 >= (int64_t)1 << 20 ? 64 : ((int64_t)1 << 20) / k / 8 * 8;
        int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
        {
#if PACKED_PATH == 0
            uint8_t *scratch = (uint8_t *)malloc((size_t)(PG * k + sizeof(float) * PG * 3 * (k / 32)));
            failed = scratch == NULL;
#endif
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; ++r) quantize_row(x, x_bf16, r, &a);
            for (int64_t r0 = 0; r0 < m; r0 += chunk) {
                const int64_t r1 = r0 + chunk < m ? r0 + chunk : m;
#pragma omp for schedule(static) nowait
                for (int64_t g = 0; g < groups; ++g) {
                    int64_t i = 0;
                    while (i + 1 < n_segments && segs[i + 1].first_group <= g) ++i;
#if PACKED_PATH == 0
                    if (scratch != NULL) group_rows(&segs[i], g - segs[i].first_group, &a, r0, r1, y, x_bf16, n, scratch);
#else
                    group_rows(&segs[i], g - segs[i].first_group, &a, r0, r1, y, x_bf16, n);
#endif
                }
            }
#if PACKED_PATH == 0
            free(scratch);
#endif
        }
        if (failed) status = -3;
    }
    free(a.q);
    free(a.dx);
    free(a.sq);
    free(a.s);
    if (segs != few) free(segs);
    return status;
}

/* A mixture of experts' products in one call: expert e's weight (`segments[e]`: the address of its
 * `counts[e]` (type, rows, address) triples, every weight of n outputs) multiplies x's rows lo[e] .. hi[e] - 1
 * into the same rows of y [m][n]. The rows are quantized once, and every (expert, group of its outputs) is
 * one task of one parallel loop, so an expert with one row costs no call of its own. Each row's result is
 * exactly ferrox_packed_gemm's for that row and that expert's weight (the same tiles, the same sums). An
 * expert with no rows (lo == hi) is skipped. Returns ferrox_packed_gemm's codes, or -1 for a range outside
 * [0, m] or a weight of another width. */
int ferrox_packed_gemm_experts(const void *x, int x_bf16, int64_t m, int64_t k, const int64_t *segments,
                               const int64_t *counts, const int64_t *lo, const int64_t *hi, int64_t experts,
                               int64_t n, void *y, int threads) {
    if (k <= 0 || m < 0 || experts < 0 || n <= 0 || k % 32 != 0) return -1;
    int64_t total_segments = 0;
    for (int64_t e = 0; e < experts; ++e) {
        if (counts[e] <= 0 || lo[e] < 0 || hi[e] < lo[e] || hi[e] > m) return -1;
        total_segments += counts[e];
    }
    pseg_t *segs = (pseg_t *)malloc(sizeof(pseg_t) * (size_t)(total_segments + 1));
    /* Per expert: its first segment, and the first task (group) of the flat loop; one past the last. */
    int64_t *first_seg = (int64_t *)malloc(sizeof(int64_t) * (size_t)(experts + 1));
    int64_t *first_task = (int64_t *)malloc(sizeof(int64_t) * (size_t)(experts + 1));
    int status = segs == NULL || first_seg == NULL || first_task == NULL ? -3 : 0;
    int64_t at = 0, tasks = 0;
    for (int64_t e = 0; e < experts && status == 0; ++e) {
        int64_t width = 0, groups = 0;
        first_seg[e] = at;
        first_task[e] = tasks;
        status = read_segments((const int64_t *)(intptr_t)segments[e], counts[e], k, segs + at, &width, &groups);
        at += counts[e];
        if (status == 0 && width != n) status = -1;
        if (hi[e] > lo[e]) tasks += groups;
    }
    if (status == 0) {
        first_seg[experts] = at;
        first_task[experts] = tasks;
    }
    acts_t a = {k, k / 32, NULL, NULL, NULL, NULL};
    if (status == 0 && m > 0 && tasks > 0) {
        a.q = (int8_t *)malloc((size_t)(m * k));
        a.dx = (float *)malloc(sizeof(float) * (size_t)(m * a.nb));
        a.sq = (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * 2 * a.nb));
        a.s = (float *)malloc(sizeof(float) * (size_t)(m * a.nb));
        if (a.q == NULL || a.dx == NULL || a.sq == NULL || a.s == NULL) status = -3;
    }
    if (status == 0 && m > 0 && tasks > 0) {
        int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
        {
#if PACKED_PATH == 0
            uint8_t *scratch = (uint8_t *)malloc((size_t)(PG * k + sizeof(float) * PG * 3 * (k / 32)));
            failed = scratch == NULL;
#endif
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; ++r) quantize_row(x, x_bf16, r, &a);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; ++t) {
                /* The expert whose tasks hold t: the last whose first task is at most t (an expert with no
                 * rows has no tasks, so the last such is never one). */
                int64_t below = 0, above = experts;
                while (above - below > 1) {
                    const int64_t mid = (below + above) / 2;
                    if (first_task[mid] <= t) below = mid; else above = mid;
                }
                const int64_t e = below;
                const int64_t g = t - first_task[e];
                int64_t i = first_seg[e];
                while (i + 1 < first_seg[e + 1] && segs[i + 1].first_group <= g) ++i;
#if PACKED_PATH == 0
                if (scratch != NULL) group_rows(&segs[i], g - segs[i].first_group, &a, lo[e], hi[e], y, x_bf16, n, scratch);
#else
                group_rows(&segs[i], g - segs[i].first_group, &a, lo[e], hi[e], y, x_bf16, n);
#endif
            }
#if PACKED_PATH == 0
            free(scratch);
#endif
        }
        if (failed) status = -3;
    }
    free(a.q);
    free(a.dx);
    free(a.sq);
    free(a.s);
    free(segs);
    free(first_seg);
    free(first_task);
    return status;
}
