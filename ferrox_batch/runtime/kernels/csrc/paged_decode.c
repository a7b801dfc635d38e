/* Paged decode attention for the CPU: one query token per sequence, keys and values read
 * straight from the paged KV pool through each sequence's block table.
 *
 * The torch path gathers every sequence's context into a contiguous tensor and then runs
 * SDPA over it, so each K/V byte is read, written and read again. Here each byte is read
 * once: pass 1 scores the keys, pass 2 accumulates the values. Work is split over
 * sequences on the calling thread's OpenMP team, and over each sequence's KV heads too when
 * there are fewer than two sequences per thread (a single stream then still uses every
 * thread); within a task every query head is scored against a slot's key rows while they are
 * in cache (GQA without copies).
 *
 * Layouts (q and out are float32 or bfloat16, chosen by `is_bf16`; the pool's element type
 * is `pool_kind`, half.h: float32, bfloat16 or fp16):
 *   q      [n, kv, g, d]        the new token's query heads, grouped by KV head
 *   pool   [slots, 2, kv, d]    this layer's pool: slot s holds K (index 0) and V (index 1)
 *   tables [n, max_blocks]      int64 block ids; position p lives in slot
 *                               tables[i][p / block_size] * block_size + p % block_size
 *   lo, hi [n]                  int64: sequence i attends to positions lo[i] .. hi[i] - 1
 *   out    [n, kv, g, d]        like q
 *   sinks  [kv * g] or NULL     float32: query head h's sink logit (gpt-oss), indexed kv_head * g + j like
 *                               one sequence's heads of q; it joins the softmax's max and denominator
 *                               (sum += exp(sink - max)) with no value. NULL: no sink, the arithmetic as without.
 * Pool elements are widened exactly and all arithmetic is float32; bfloat16 output is
 * rounded to nearest even, as torch does. A sequence with no key to attend (lo == hi) gets
 * zeros (SDPA would give NaN); the decoder never asks for one. `threads` is the team size
 * (torch's intra-op thread count).
 *
 * Two paths compute the same sums. The generic one scores one slot at a time, a
 * horizontal sum per dot product. The AVX2 one (x86 with AVX2 + FMA, head sizes that are
 * a multiple of 8) is register-blocked: up to three query heads that share a KV head are
 * scored together against 4 slots' keys (12 accumulators, each widened key vector read
 * once for all three), and their values are accumulated 32 elements of the head at a time
 * with the accumulators in registers across every slot; each sequence's slots are
 * prefetched, keys and values, AHEAD slots in advance. The generic loop is bound by its
 * reductions, not by memory, so a narrower pool (fp16) gains it nothing. The blocked path
 * measured about 1.6x its earlier 8-slot, one-head-at-a-time form (itself 1.9x the generic
 * loop) with an fp16 pool in cache, and 1.4x per 32-row step from DRAM
 * (scripts/bench_decode_attention.py).
 * Returns 0, or -1 when scratch memory could not be had (out is then unspecified).
 */
#include "half.h"
#include "kernels.h"

/* How many slots ahead of its scoring the tiled path prefetches a sequence's keys and values. */
#define AHEAD 16

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FERROX_TILE_PATH 1
#else
#define FERROX_TILE_PATH 0
#endif

/* The slot that holds position p of a sequence. */
static inline int64_t slot_of(const int64_t *table, int64_t p, int64_t block_size) {
    return table[p / block_size] * block_size + p % block_size;
}

/* Each of `heads` score rows (`longest` apart, len scores each) to exp(score - max), and 1 / their sum into
 * inv_sum; `sinks` (NULL: none) holds those heads' sink logits, which join the max and the sum. */
static void softmax_rows(float *scores, int64_t heads, int64_t longest, int64_t len, const float *sinks,
                         float *inv_sum) {
    for (int64_t j = 0; j < heads; ++j) {
        float *sj = scores + j * longest;
        float m = -3.4028235e38f;
        for (int64_t t = 0; t < len; ++t) m = sj[t] > m ? sj[t] : m;
        if (sinks != NULL && sinks[j] > m) m = sinks[j];
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
            sj[t] = expf(sj[t] - m);
            sum += sj[t];
        }
        if (sinks != NULL) sum += expf(sinks[j] - m);
        inv_sum[j] = len > 0 ? 1.0f / sum : 0.0f; /* applied at the end; no keys: zeros, sink or not */
    }
}

/* KV heads h0 .. h1 - 1 of one sequence, one slot at a time: any head size, any element type. `qf`, scores,
 * acc, sinks and inv_sum as `heads_tiled`'s; rows [(h1 - h0) d] (the slot's widened keys or values). */
static void heads_generic(const float *qf, const void *pool, int kind, const int64_t *table, int64_t first,
                          int64_t len, int64_t block_size, int64_t kv, int64_t h0, int64_t h1, int64_t g, int64_t d,
                          float scale, int64_t longest, float *scores, float *acc, float *rows, const float *sinks,
                          float *inv_sum) {
    const int64_t heads = (h1 - h0) * g, slot_stride = 2 * kv * d, span = (h1 - h0) * d;
    const int64_t elem = kind == ELEM_F32 ? 4 : 2;
    for (int64_t part = 0; part < 2; ++part) { /* 0: scores from K, 1: values from V */
        if (part == 1) {
            softmax_rows(scores, heads, longest, len, sinks, inv_sum);
            memset(acc, 0, sizeof(float) * (size_t)(heads * d));
        }
        for (int64_t t = 0; t < len; ++t) {
            const int64_t slot = slot_of(table, first + t, block_size);
            if (t + 4 < len) { /* the next slots are rarely adjacent across blocks */
                const int64_t ahead = slot_of(table, first + t + 4, block_size);
                const char *at = (const char *)pool + (ahead * slot_stride + part * kv * d + h0 * d) * elem;
                for (int64_t b = 0; b < span * elem; b += 64) __builtin_prefetch(at + b, 0, 0);
            }
            elems_f32(pool, slot * slot_stride + part * kv * d + h0 * d, span, kind, rows);
            for (int64_t j = 0; j < heads; ++j) {
                const float *row = rows + (j / g) * d;
                if (part == 0) {
                    const float *qj = qf + j * d;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int64_t e = 0; e < d; ++e) s += qj[e] * row[e];
                    scores[j * longest + t] = s * scale;
                } else {
                    const float w = scores[j * longest + t];
                    float *aj = acc + j * d;
#pragma omp simd
                    for (int64_t e = 0; e < d; ++e) aj[e] += w * row[e];
                }
            }
        }
    }
}

#if FERROX_TILE_PATH
#include "paged_decode_blocked.h"
#endif

int ferrox_paged_decode(const void *q, const void *pool, const int64_t *tables, int64_t max_blocks,
                        const int64_t *lo, const int64_t *hi, void *out, int64_t n, int64_t kv, int64_t g,
                        int64_t d, int64_t block_size, float scale, const float *sinks, int is_bf16, int pool_kind,
                        int threads) {
    int failed = 0;
    const int64_t heads = kv * g; /* query heads of one sequence */
    int tiled = FERROX_TILE_PATH && d % 8 == 0;
    /* Tasks per sequence: its KV heads apart when the sequences alone cannot fill the team. */
    const int64_t split = n < 2 * (int64_t)threads ? kv : 1;
#if !defined(__F16C__)
    if (pool_kind == ELEM_F16) tiled = 0;
#endif
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int64_t longest = 0;
        for (int64_t i = 0; i < n; ++i)
            if (hi[i] - lo[i] > longest) longest = hi[i] - lo[i];
        /* Per thread: scores [heads, longest], the query and accumulators [heads, d], the generic
         * path's widened slot [kv, d], 1 / sum per query head, and the tiled path's slot ids
         * (longest + AHEAD) and element offsets (longest), int64 each: 2 floats' room. */
        const int64_t rows_len = tiled ? 0 : kv * d;
        const int64_t slots_len = tiled ? 2 * (2 * longest + AHEAD) : 0;
        float *scratch = (float *)malloc(sizeof(float) * (size_t)(heads * longest + 2 * heads * d + rows_len + heads
                                                                   + slots_len + 16));
        float *scores = scratch;
        float *qf = scores + heads * longest;
        float *acc = qf + heads * d;
        float *rows = acc + heads * d;
        float *inv_sum = rows + rows_len;
        int64_t *slots = (int64_t *)(void *)(((uintptr_t)(inv_sum + heads) + 7u) & ~(uintptr_t)7u);
        /* One task per sequence, or per (sequence, KV head) when there are too few sequences to spread
         * over the team (a single stream's decode). Each head's sums are the same either way. Every
         * thread of the team must reach the worksharing loop, so a thread without scratch enters it too
         * and fails the tasks it is handed. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n * split; ++task) {
            if (scratch == NULL) {
                failed = 1;
                continue;
            }
            const int64_t i = task / split, h0 = task % split * (kv / split), h1 = h0 + kv / split;
            const int64_t first = lo[i], len = hi[i] - lo[i];
            const int64_t *table = tables + i * max_blocks;
            row_f32(q, (i * heads + h0 * g) * d, (h1 - h0) * g * d, is_bf16, qf);
            const float *task_sinks = sinks != NULL ? sinks + h0 * g : NULL; /* this task's query heads' */
#if FERROX_TILE_PATH
            if (tiled) {
                for (int64_t t = 0; t < len; ++t) slots[t] = slot_of(table, first + t, block_size);
                for (int64_t t = len; t < len + AHEAD; ++t) slots[t] = -1;
                heads_tiled(qf, pool, pool_kind, slots, len, kv, h0, h1, g, d, scale, longest, scores, acc,
                            slots + longest + AHEAD, task_sinks, inv_sum);
            } else
#endif
                heads_generic(qf, pool, pool_kind, table, first, len, block_size, kv, h0, h1, g, d, scale, longest,
                              scores, acc, rows, task_sinks, inv_sum);
            for (int64_t j = 0; j < (h1 - h0) * g; ++j) {
                const float *aj = acc + j * d;
                const int64_t at = (i * heads + h0 * g + j) * d;
                if (is_bf16) {
                    uint16_t *dst = (uint16_t *)out + at;
                    for (int64_t e = 0; e < d; ++e) dst[e] = bf16_round(aj[e] * inv_sum[j]);
                } else {
                    float *dst = (float *)out + at;
                    for (int64_t e = 0; e < d; ++e) dst[e] = aj[e] * inv_sum[j];
                }
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
