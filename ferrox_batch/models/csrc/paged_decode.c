/* Paged decode attention for the CPU: one query token per sequence, keys and values read
 * straight from the paged KV pool through each sequence's block table.
 *
 * The torch path gathers every sequence's context into a contiguous tensor and then runs
 * SDPA over it, so each K/V byte is read, written and read again. Here each byte is read
 * once: pass 1 scores the keys, pass 2 accumulates the values. Work is split over
 * sequences on the calling thread's OpenMP team; within a sequence every query head is
 * scored against a slot's key rows while they are in cache (GQA without copies).
 *
 * Layouts (element type T is float32 or bfloat16, chosen by `is_bf16`):
 *   q      [n, kv, g, d]        the new token's query heads, grouped by KV head
 *   pool   [slots, 2, kv, d]    this layer's pool: slot s holds K (index 0) and V (index 1)
 *   tables [n, max_blocks]      int64 block ids; position p lives in slot
 *                               tables[i][p / block_size] * block_size + p % block_size
 *   lo, hi [n]                  int64: sequence i attends to positions lo[i] .. hi[i] - 1
 *   out    [n, kv, g, d]        T
 * Accumulation is float32; bfloat16 output is rounded to nearest even, as torch does. A
 * sequence with no key to attend (lo == hi) gets zeros (SDPA would give NaN); the decoder never
 * asks for one. `threads` is the team size (torch's intra-op thread count).
 * Returns 0, or -1 when scratch memory could not be had (out is then unspecified).
 */
#include "bf16.h"

int ferrox_paged_decode(const void *q, const void *pool, const int64_t *tables, int64_t max_blocks,
                        const int64_t *lo, const int64_t *hi, void *out, int64_t n, int64_t kv, int64_t g,
                        int64_t d, int64_t block_size, float scale, int is_bf16, int threads) {
    int failed = 0;
    const int64_t slot_stride = 2 * kv * d; /* elements from one slot to the next */
    const int64_t heads = kv * g;           /* query heads of one sequence */
    const int64_t elem = is_bf16 ? 2 : 4;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int64_t longest = 0;
        for (int64_t i = 0; i < n; ++i)
            if (hi[i] - lo[i] > longest) longest = hi[i] - lo[i];
        /* Per thread: scores [heads, longest], the query and accumulators [heads, d], one slot's
         * K (or V) rows for every KV head [kv, d], and 1 / sum per query head. */
        float *scratch = (float *)malloc(sizeof(float) * (size_t)(heads * longest + 2 * heads * d + kv * d + heads + 16));
        float *scores = scratch;
        float *qf = scores + heads * longest;
        float *acc = qf + heads * d;
        float *rows = acc + heads * d;
        float *inv_sum = rows + kv * d;
        /* One task per sequence: a slot's K rows for all KV heads are one contiguous run (and its
         * V rows the next), so each pass streams whole slots in position order. Every thread of
         * the team must reach the worksharing loop, so a thread without scratch enters it too
         * and fails the tasks it is handed. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) {
            if (scratch == NULL) {
                failed = 1;
                continue;
            }
            {
                const int64_t first = lo[i], len = hi[i] - lo[i];
                const int64_t *table = tables + i * max_blocks;
                row_f32(q, i * heads * d, heads * d, is_bf16, qf);
                for (int64_t part = 0; part < 2; ++part) { /* 0: scores from K, 1: values from V */
                    if (part == 1) {
                        /* Softmax per query head (1 / sum is applied at the end). */
                        for (int64_t j = 0; j < heads; ++j) {
                            float *sj = scores + j * longest;
                            float m = -3.4028235e38f;
                            for (int64_t t = 0; t < len; ++t) m = sj[t] > m ? sj[t] : m;
                            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                            for (int64_t t = 0; t < len; ++t) {
                                sj[t] = expf(sj[t] - m);
                                sum += sj[t];
                            }
                            inv_sum[j] = len > 0 ? 1.0f / sum : 0.0f;
                        }
                        memset(acc, 0, sizeof(float) * (size_t)(heads * d));
                    }
                    for (int64_t t = 0; t < len; ++t) {
                        const int64_t p = first + t;
                        const int64_t slot = table[p / block_size] * block_size + p % block_size;
                        if (t + 4 < len) { /* the next slots are rarely adjacent across blocks */
                            const int64_t pn = p + 4;
                            const int64_t ahead = table[pn / block_size] * block_size + pn % block_size;
                            const char *at = (const char *)pool + (ahead * slot_stride + part * kv * d) * elem;
                            for (int64_t b = 0; b < kv * d * elem; b += 64) __builtin_prefetch(at + b, 0, 0);
                        }
                        row_f32(pool, slot * slot_stride + part * kv * d, kv * d, is_bf16, rows);
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
                for (int64_t j = 0; j < heads; ++j) {
                    const float *aj = acc + j * d;
                    if (is_bf16) {
                        uint16_t *dst = (uint16_t *)out + (i * heads + j) * d;
                        for (int64_t e = 0; e < d; ++e) dst[e] = bf16_round(aj[e] * inv_sum[j]);
                    } else {
                        float *dst = (float *)out + (i * heads + j) * d;
                        for (int64_t e = 0; e < d; ++e) dst[e] = aj[e] * inv_sum[j];
                    }
                }
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
