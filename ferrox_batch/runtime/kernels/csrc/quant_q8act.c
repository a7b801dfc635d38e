/* The int8-activation linear, `ferrox_quant_gemm_q8act`: the small-batch alternative to quant_gemm.c. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_blocks.h"
#include "quant_segments.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The small-batch alternative: x is quantized too, each 32-block of each row to int8 with a scale of
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

