/* Prefill attention for the CPU: the query rows of one forward's prompt chunks, each chunk attending
 * causally (and within an optional sliding window) to its own sequence's paged context.
 *
 * torch's path gathers each chunk's context, widens it and runs SDPA once per chunk and layer; for
 * the chunks of a burst of prompts (tens to a few hundred rows) that call costs several times its
 * arithmetic. Here a chunk's keys and values are widened once into float32 scratch shared by the
 * team (keys transposed, `[kv][d][keys]`, so 16 keys' scores are two vectors), and the work is
 * split into tasks of up to QUERY_ROWS rows x one KV head: every query head of those rows that
 * reads that KV head is scored against each key vector while it is in registers, then the
 * softmax, then the values. A row's scores are exact dot products of its own keys; keys outside
 * its range are computed in a padded block but never read.
 *
 * Layouts (q and out float32 or bfloat16, chosen by `is_bf16`; the pool's element type is
 * `pool_kind`, half.h):
 *   q       row r's query heads at q + r * q_stride, [kv, g, d] contiguous
 *   pool    [slots, 2, kv, d]     this layer's pool (index 0 K, index 1 V)
 *   slots   int64: the context slots of every chunk, concatenated
 *   chunks  [n_chunks, 4] int64:  first query row, rows, start (positions before the chunk),
 *                                 offset of the chunk's start + rows slots in `slots`
 *   out     [rows, kv * g * d]    contiguous
 *   sinks   [kv * g] or NULL      float32: query head h's sink logit (gpt-oss), indexed kv_head * g + j like a
 *                                 row's heads; it joins each softmax's max and denominator (sum +=
 *                                 exp(sink - max)) with no value. NULL: no sink, the arithmetic as without.
 * Row i of a chunk is position start + i and attends to positions lo .. start + i, where lo is 0,
 * or start + i + 1 - window with a window (`window` > 0). Arithmetic is float32 in the same steps
 * as paged_decode.c (score = (q . k) * scale, w = exp(score - max), out = sum w v / sum w); bf16
 * output is rounded to nearest even. The AVX2 path needs AVX2 + FMA and a head size that is a
 * multiple of 8; the generic path takes any. `threads` is the team size.
 * Returns 0, or -1 when scratch memory could not be had (out is then unspecified).
 */
#include "half.h"
#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PREFILL_TILE_PATH 1
#else
#define PREFILL_TILE_PATH 0
#endif

/* Rows per task: QUERY_ROWS x g query vectors share each key vector loaded. */
enum { QUERY_ROWS = 4, KEY_BLOCK = 16, CHUNK_COLS = 4 };

/* Heads of one row at a time in pass 2 (AVX2 path), with 4 vectors of the head dimension: 3 x 4
 * accumulators. */
#define VALUE_HEADS 3

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* The first position row i of a chunk that starts at `start` attends to (its last is start + i). */
static inline int64_t row_lo(int64_t start, int64_t i, int64_t window) {
    const int64_t lo = start + i + 1 - window;
    return window > 0 && lo > 0 ? lo : 0;
}

#if PREFILL_TILE_PATH
#include "prefill_attention_tiles.h"
#endif

/* One task: rows i0 .. i0 + nr - 1 of a chunk, KV head h. kt, vh: the head's widened keys
 * (`[d][ld]`) and values (`[ld][d]`); qf, scores, acc, inv_sum: the thread's scratch. */
static void task(const void *q, int64_t q_stride, int is_bf16, int64_t row0, int64_t start, int64_t i0, int64_t nr,
                 int64_t h, int64_t g, int64_t d, int64_t heads, int64_t window, float scale, const float *kt,
                 const float *vh, int64_t ld, int tiled, const float *sinks, float *qf, float *scores, float *acc,
                 float *inv_sum, void *out) {
    const int64_t nq = nr * g;
    for (int64_t r = 0; r < nr; ++r)
        row_f32(q, (row0 + i0 + r) * q_stride + h * g * d, g * d, is_bf16, qf + r * g * d);
    (void)tiled;
#if PREFILL_TILE_PATH
    if (tiled) {
        /* Keys any row of the task reads, widened to whole KEY_BLOCKs (ld is a multiple of one). */
        const int64_t kb = row_lo(start, i0, window) / KEY_BLOCK * KEY_BLOCK;
        const int64_t ke = round_up(start + i0 + nr, KEY_BLOCK);
        for (int64_t v0 = 0; v0 < nq; v0 += SCORE_QUERIES) {
            const int nv = (int)(nq - v0 < SCORE_QUERIES ? nq - v0 : SCORE_QUERIES);
            score_blocks(qf + v0 * d, d, kt, ld, kb, ke - kb, nv, scale, scores + v0 * ld);
        }
    } else
#endif
        for (int64_t v = 0; v < nq; ++v) {
            const int64_t i = i0 + v / g, hi = start + i + 1;
            for (int64_t j = row_lo(start, i, window); j < hi; ++j) {
                float s = 0.0f;
                for (int64_t e = 0; e < d; ++e) s += qf[v * d + e] * kt[e * ld + j];
                scores[v * ld + j] = s * scale;
            }
        }
    for (int64_t v = 0; v < nq; ++v) { /* softmax over each row's own keys; 1 / sum applied at the end */
        const int64_t i = i0 + v / g, lo = row_lo(start, i, window), hi = start + i + 1;
        float *sv = scores + v * ld, m = -3.4028235e38f, sum = 0.0f;
        /* Query vector v is head h * g + v % g of its row (the task's vectors are its rows' g heads in turn). */
        const float *sink = sinks != NULL ? sinks + h * g + v % g : NULL;
        for (int64_t j = lo; j < hi; ++j) m = sv[j] > m ? sv[j] : m;
        if (sink != NULL && *sink > m) m = *sink;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = lo; j < hi; ++j) {
            sv[j] = expf(sv[j] - m);
            sum += sv[j];
        }
        if (sink != NULL) sum += expf(*sink - m);
        inv_sum[v] = 1.0f / sum;
    }
    for (int64_t r = 0; r < nr; ++r) {
        const int64_t i = i0 + r, lo = row_lo(start, i, window), hi = start + i + 1;
        for (int64_t hh = 0; hh < g;) {
            int64_t nh = 1;
            int64_t e = 0;
#if PREFILL_TILE_PATH
            if (tiled) {
                nh = g - hh < VALUE_HEADS ? g - hh : VALUE_HEADS;
                for (; e < d;) {
                    const int vecs = (int)((d - e) / 8 < 4 ? (d - e) / 8 : 4);
                    value_blocks(scores + (r * g + hh) * ld, ld, vh + e, d, lo, hi, (int)nh, vecs, acc + e);
                    e += 8 * vecs;
                }
            } else
#endif
                for (; e < d; ++e) {
                    const float *w = scores + (r * g + hh) * ld;
                    float s = 0.0f;
                    for (int64_t j = lo; j < hi; ++j) s += w[j] * vh[j * d + e];
                    acc[e] = s;
                }
            for (int64_t x = 0; x < nh; ++x) {
                const float inv = inv_sum[r * g + hh + x], *src = acc + x * d;
                const int64_t at = (row0 + i) * heads * d + (h * g + hh + x) * d;
                if (is_bf16) {
                    uint16_t *dst = (uint16_t *)out + at;
                    for (int64_t y = 0; y < d; ++y) dst[y] = bf16_round(src[y] * inv);
                } else {
                    float *dst = (float *)out + at;
                    for (int64_t y = 0; y < d; ++y) dst[y] = src[y] * inv;
                }
            }
            hh += nh;
        }
    }
}

/* Keys j0 .. j0 + 7 of a chunk (those at or past `keys` are padding: zero keys, values untouched),
 * every KV head: keys into kt ([kv][d][ld], transposed), values into vals ([kv][ld][d]), float32. */
static void widen_keys(const void *pool, int kind, const int64_t *slots, int64_t j0, int64_t keys, int64_t kv,
                       int64_t d, int64_t ld, int tiled, float *kt, float *vals) {
    const int64_t width = kv * d, count = keys - j0 < 0 ? 0 : keys - j0 < 8 ? keys - j0 : 8;
    (void)tiled;
#if PREFILL_TILE_PATH && defined(__F16C__)
    if (tiled) { /* 8 x 8 blocks of keys widened in registers and transposed there */
        for (int64_t h = 0; h < kv; ++h) {
            for (int64_t e = 0; e < d; e += 8) {
                __m256 r[8];
                for (int64_t u = 0; u < 8; ++u)
                    r[u] = u < count ? load8(pool, slots[j0 + u] * 2 * width + h * d + e, kind) : _mm256_setzero_ps();
                transpose8(r);
                for (int64_t u = 0; u < 8; ++u) _mm256_storeu_ps(kt + (h * d + e + u) * ld + j0, r[u]);
            }
            for (int64_t u = 0; u < count; ++u)
                for (int64_t e = 0; e < d; e += 8)
                    _mm256_storeu_ps(vals + (h * ld + j0 + u) * d + e,
                                     load8(pool, slots[j0 + u] * 2 * width + width + h * d + e, kind));
        }
        return;
    }
#endif
    for (int64_t u = 0; u < 8; ++u) {
        for (int64_t h = 0; h < kv; ++h) {
            float *kh = kt + h * d * ld;
            if (u >= count) { /* scored, never read, but kept finite */
                for (int64_t e = 0; e < d; ++e) kh[e * ld + j0 + u] = 0.0f;
                continue;
            }
            const int64_t at = slots[j0 + u] * 2 * width + h * d;
            float *vh = vals + (h * ld + j0 + u) * d;
            elems_f32(pool, at, d, kind, vh); /* the key, through the value's row */
            for (int64_t e = 0; e < d; ++e) kh[e * ld + j0 + u] = vh[e];
            elems_f32(pool, at + width, d, kind, vh);
        }
    }
}

int ferrox_prefill_attention(const void *q, int64_t q_stride, const void *pool, const int64_t *slots,
                             const int64_t *chunks, int64_t n_chunks, void *out, int64_t kv, int64_t g, int64_t d,
                             int64_t window, float scale, const float *sinks, int is_bf16, int pool_kind,
                             int threads) {
    const int64_t heads = kv * g, width = kv * d;
    int tiled = PREFILL_TILE_PATH && d % 8 == 0;
    int64_t longest = 0; /* the most keys a chunk holds, in whole KEY_BLOCKs */
    for (int64_t c = 0; c < n_chunks; ++c) {
        const int64_t keys = round_up(chunks[c * CHUNK_COLS + 2] + chunks[c * CHUNK_COLS + 1], KEY_BLOCK);
        longest = keys > longest ? keys : longest;
    }
    if (longest == 0) return 0;
    /* Shared: one chunk's keys, transposed, and values, float32, per KV head. */
    float *kt = (float *)malloc(sizeof(float) * (size_t)(2 * width * longest));
    if (kt == NULL) return -1;
    float *vals = kt + width * longest;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* Per thread: query vectors [QUERY_ROWS * g][d], scores [QUERY_ROWS * g][longest], 1 / sum per
         * query vector, and the sums of one row's values for up to VALUE_HEADS heads ([VALUE_HEADS][d]). */
        const int64_t nq = QUERY_ROWS * g;
        float *scratch = (float *)malloc(sizeof(float) * (size_t)(nq * d + nq * longest + nq + VALUE_HEADS * d));
        float *qf = scratch, *scores = qf + nq * d, *inv_sum = scores + nq * longest, *acc = inv_sum + nq;
        for (int64_t c = 0; c < n_chunks; ++c) {
            const int64_t *chunk = chunks + c * CHUNK_COLS;
            const int64_t row0 = chunk[0], rows = chunk[1], start = chunk[2], keys = start + rows;
            const int64_t ld = round_up(keys, KEY_BLOCK);
            const int64_t *chunk_slots = slots + chunk[3];
#pragma omp for schedule(static)
            for (int64_t j0 = 0; j0 < ld; j0 += 8)
                widen_keys(pool, pool_kind, chunk_slots, j0, keys, kv, d, ld, tiled, kt, vals);
            const int64_t blocks = (rows + QUERY_ROWS - 1) / QUERY_ROWS;
            /* The later rows of a chunk read more keys: tasks are handed out as they finish. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < blocks * kv; ++t) {
                if (scratch == NULL) {
                    failed = 1;
                    continue;
                }
                const int64_t b = t / kv, h = t % kv, i0 = b * QUERY_ROWS;
                const int64_t nr = rows - i0 < QUERY_ROWS ? rows - i0 : QUERY_ROWS;
                task(q, q_stride, is_bf16, row0, start, i0, nr, h, g, d, heads, window, scale, kt + h * d * ld,
                     vals + h * ld * d, ld, tiled, sinks, qf, scores, acc, inv_sum, out);
            }
        }
        free(scratch);
    }
    free(kt);
    return failed ? -1 : 0;
}
