/* Paged decode attention for the CPU: one query token per sequence, keys and values read
 * straight from the paged KV pool through each sequence's block table.
 *
 * The torch path gathers every sequence's context into a contiguous tensor and then runs
 * SDPA over it, so each K/V byte is read, written and read again. Here each byte is read
 * once: pass 1 scores the keys, pass 2 accumulates the values. Work is split over
 * sequences on the calling thread's OpenMP team; within a sequence every query head is
 * scored against a slot's key rows while they are in cache (GQA without copies).
 *
 * Layouts (q and out are float32 or bfloat16, chosen by `is_bf16`; the pool's element type
 * is `pool_kind`, half.h: float32, bfloat16 or fp16):
 *   q      [n, kv, g, d]        the new token's query heads, grouped by KV head
 *   pool   [slots, 2, kv, d]    this layer's pool: slot s holds K (index 0) and V (index 1)
 *   tables [n, max_blocks]      int64 block ids; position p lives in slot
 *                               tables[i][p / block_size] * block_size + p % block_size
 *   lo, hi [n]                  int64: sequence i attends to positions lo[i] .. hi[i] - 1
 *   out    [n, kv, g, d]        like q
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
 * reductions, not by memory, so a narrower pool (fp16) gains it nothing; the blocked one is
 * about 3x as fast with the pool in cache and about 1.3x its earlier one-head-at-a-time form
 * from DRAM (scripts/bench_decode_attention.py).
 * Returns 0, or -1 when scratch memory could not be had (out is then unspecified).
 */
#include "half.h"

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

static void softmax_rows(float *scores, int64_t heads, int64_t longest, int64_t len, float *inv_sum) {
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
        inv_sum[j] = len > 0 ? 1.0f / sum : 0.0f; /* applied at the end */
    }
}

/* One sequence, one slot at a time: any head size, any element type. */
static void sequence_generic(const float *qf, const void *pool, int kind, const int64_t *table, int64_t first,
                             int64_t len, int64_t block_size, int64_t kv, int64_t g, int64_t d, float scale,
                             int64_t longest, float *scores, float *acc, float *rows, float *inv_sum) {
    const int64_t heads = kv * g, slot_stride = 2 * kv * d;
    const int64_t elem = kind == ELEM_F32 ? 4 : 2;
    for (int64_t part = 0; part < 2; ++part) { /* 0: scores from K, 1: values from V */
        if (part == 1) {
            softmax_rows(scores, heads, longest, len, inv_sum);
            memset(acc, 0, sizeof(float) * (size_t)(heads * d));
        }
        for (int64_t t = 0; t < len; ++t) {
            const int64_t slot = slot_of(table, first + t, block_size);
            if (t + 4 < len) { /* the next slots are rarely adjacent across blocks */
                const int64_t ahead = slot_of(table, first + t + 4, block_size);
                const char *at = (const char *)pool + (ahead * slot_stride + part * kv * d) * elem;
                for (int64_t b = 0; b < kv * d * elem; b += 64) __builtin_prefetch(at + b, 0, 0);
            }
            elems_f32(pool, slot * slot_stride + part * kv * d, kv * d, kind, rows);
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
static inline __m256 load8(const void *base, int64_t offset, int kind) {
    if (kind == ELEM_F32) return _mm256_loadu_ps((const float *)base + offset);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + offset));
#if defined(__F16C__)
    if (kind == ELEM_F16) return _mm256_cvtph_ps(h);
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); /* bfloat16 */
}

/* Query heads that share a KV head, handled together: each widened K or V vector feeds GROUP_BLOCK
 * heads' FMAs, and GROUP_BLOCK x 4 accumulators, the heads' operands and one K/V vector fill AVX2's
 * 16 registers. */
#define GROUP_BLOCK 3

/* scores[j][t0 .. t0 + count) for the gc (<= GROUP_BLOCK) query heads at q (rows d apart) against one KV
 * head's keys in `count` (<= 4) slots (element offsets `at`; a slot past count repeats the first, and
 * its lanes are not kept). Four slots x gc heads of accumulators advance together along the head
 * dimension, so every widened key vector is read once and the FMA chains are independent. `gc` is a
 * constant wherever this is inlined, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void key_block(const float *q, const void *pool, int kind,
                                                            const int64_t *at, int64_t count, int64_t d,
                                                            int gc, float scale, float *scores, int64_t longest) {
    __m256 acc[GROUP_BLOCK][4];
    for (int j = 0; j < gc; ++j)
        for (int u = 0; u < 4; ++u) acc[j][u] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; e += 8) {
        __m256 qv[GROUP_BLOCK];
        for (int j = 0; j < gc; ++j) qv[j] = _mm256_loadu_ps(q + j * d + e);
        for (int u = 0; u < 4; ++u) {
            const __m256 k = load8(pool, at[u] + e, kind);
            for (int j = 0; j < gc; ++j) acc[j][u] = _mm256_fmadd_ps(k, qv[j], acc[j][u]);
        }
    }
    for (int j = 0; j < gc; ++j) {
        /* The 4 sums of acc[j][0..3]'s lanes, in order. */
        const __m256 s01 = _mm256_hadd_ps(acc[j][0], acc[j][1]), s23 = _mm256_hadd_ps(acc[j][2], acc[j][3]);
        const __m256 s = _mm256_hadd_ps(s01, s23);
        const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        float got[4];
        _mm_storeu_ps(got, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        for (int64_t u = 0; u < count; ++u) scores[j * longest + u] = got[u];
    }
}

/* acc[j][e0 .. e0 + 8 * vecs) += sum over the len slots t of w[j][t] * V[t] for the gc (<= GROUP_BLOCK)
 * query heads of one KV head (`at[t]`: slot t's element offset of that head's values, plus e0; `w` rows
 * `longest` apart, `acc` rows d apart), vecs (<= 4) vectors of the head dimension at a time. The
 * accumulators stay in registers across every slot. Constant gc and vecs where inlined, as above. */
static inline __attribute__((always_inline)) void value_block(float *acc, const float *w, const void *pool,
                                                              int kind, const int64_t *at, int64_t len,
                                                              int64_t d, int64_t longest, int gc, int vecs) {
    __m256 a[GROUP_BLOCK][4];
    for (int j = 0; j < gc; ++j)
        for (int b = 0; b < vecs; ++b) a[j][b] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
        __m256 wt[GROUP_BLOCK];
        for (int j = 0; j < gc; ++j) wt[j] = _mm256_set1_ps(w[j * longest + t]);
        for (int b = 0; b < vecs; ++b) {
            const __m256 v = load8(pool, at[t] + 8 * b, kind);
            for (int j = 0; j < gc; ++j) a[j][b] = _mm256_fmadd_ps(wt[j], v, a[j][b]);
        }
    }
    for (int j = 0; j < gc; ++j)
        for (int b = 0; b < vecs; ++b) _mm256_storeu_ps(acc + j * d + 8 * b, a[j][b]);
}

static void value_blocks(float *acc, const float *w, const void *pool, int kind, const int64_t *at, int64_t len,
                         int64_t d, int64_t longest, int gc, int vecs) {
    /* One specialisation per (gc, vecs, kind): constant sizes keep the accumulators in registers, and a
     * constant kind keeps load8's choice out of the inner loop. */
#define FERROX_VALUES(G, V)                                                                         \
    switch (kind) {                                                                                 \
    case ELEM_F32: value_block(acc, w, pool, ELEM_F32, at, len, d, longest, G, V); break;           \
    case ELEM_F16: value_block(acc, w, pool, ELEM_F16, at, len, d, longest, G, V); break;           \
    default: value_block(acc, w, pool, ELEM_BF16, at, len, d, longest, G, V); break;                \
    }
    switch (gc * 8 + vecs) {
    case 1 * 8 + 4: FERROX_VALUES(1, 4); break;
    case 2 * 8 + 4: FERROX_VALUES(2, 4); break;
    case 3 * 8 + 4: FERROX_VALUES(3, 4); break;
    case 1 * 8 + 1: FERROX_VALUES(1, 1); break;
    case 2 * 8 + 1: FERROX_VALUES(2, 1); break;
    default: FERROX_VALUES(3, 1); break;
    }
#undef FERROX_VALUES
}

static void key_blocks(const float *q, const void *pool, int kind, const int64_t *at, int64_t count, int64_t d,
                       int gc, float scale, float *scores, int64_t longest) {
#define FERROX_KEYS(G)                                                                              \
    switch (kind) {                                                                                 \
    case ELEM_F32: key_block(q, pool, ELEM_F32, at, count, d, G, scale, scores, longest); break;    \
    case ELEM_F16: key_block(q, pool, ELEM_F16, at, count, d, G, scale, scores, longest); break;    \
    default: key_block(q, pool, ELEM_BF16, at, count, d, G, scale, scores, longest); break;         \
    }
    switch (gc) {
    case 1: FERROX_KEYS(1); break;
    case 2: FERROX_KEYS(2); break;
    default: FERROX_KEYS(3); break;
    }
#undef FERROX_KEYS
}

/* One sequence; `slots` holds its len slot ids followed by AHEAD of -1, `offsets` room for len
 * element offsets. Pass 1 walks the slots 4 at a time, scoring every query head against each slot's keys
 * while they are in cache; pass 2 walks every slot once per (block of query heads, 32 values of the head
 * dimension), its accumulators in registers throughout. */
static void sequence_tiled(const float *qf, const void *pool, int kind, const int64_t *slots, int64_t len,
                           int64_t kv, int64_t g, int64_t d, float scale, int64_t longest, float *scores,
                           float *acc, int64_t *offsets, float *inv_sum) {
    const int64_t width = kv * d, slot_stride = 2 * width;
    const int64_t elem = kind == ELEM_F32 ? 4 : 2;
    for (int64_t t0 = 0; t0 < len; t0 += 4) {
        const int64_t count = len - t0 < 4 ? len - t0 : 4;
        /* The slots AHEAD ahead, keys and values, into L1: their blocks are rarely adjacent, so the
         * hardware prefetcher misses each block's start, and pass 2 then reads the values from cache
         * (a decode step's whole cache is larger than L3). Measured 1.2-1.3x over keys alone with a
         * non-temporal hint. */
        for (int64_t u = 0; u < count && slots[t0 + u + AHEAD] >= 0; ++u) {
            const char *ahead = (const char *)pool + slots[t0 + u + AHEAD] * slot_stride * elem;
            for (int64_t b = 0; b < slot_stride * elem; b += 64) __builtin_prefetch(ahead + b, 0, 3);
        }
        for (int64_t h = 0; h < kv; ++h) {
            int64_t at[4];
            for (int64_t u = 0; u < 4; ++u) at[u] = slots[t0 + (u < count ? u : 0)] * slot_stride + h * d;
            for (int64_t j = 0; j < g; j += GROUP_BLOCK) {
                const int gc = (int)(g - j < GROUP_BLOCK ? g - j : GROUP_BLOCK);
                key_blocks(qf + (h * g + j) * d, pool, kind, at, count, d, gc, scale,
                           scores + (h * g + j) * longest + t0, longest);
            }
        }
    }
    softmax_rows(scores, kv * g, longest, len, inv_sum);
    for (int64_t h = 0; h < kv; ++h) {
        for (int64_t e = 0; e < d;) {
            const int vecs = d - e >= 32 ? 4 : 1;
            for (int64_t t = 0; t < len; ++t) offsets[t] = slots[t] * slot_stride + width + h * d + e;
            for (int64_t j = 0; j < g; j += GROUP_BLOCK) {
                const int gc = (int)(g - j < GROUP_BLOCK ? g - j : GROUP_BLOCK);
                value_blocks(acc + (h * g + j) * d + e, scores + (h * g + j) * longest, pool, kind, offsets, len,
                             d, longest, gc, vecs);
            }
            e += 8 * vecs;
        }
    }
}
#endif

int ferrox_paged_decode(const void *q, const void *pool, const int64_t *tables, int64_t max_blocks,
                        const int64_t *lo, const int64_t *hi, void *out, int64_t n, int64_t kv, int64_t g,
                        int64_t d, int64_t block_size, float scale, int is_bf16, int pool_kind, int threads) {
    int failed = 0;
    const int64_t heads = kv * g; /* query heads of one sequence */
    int tiled = FERROX_TILE_PATH && d % 8 == 0;
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
        /* One task per sequence. Every thread of the team must reach the worksharing loop, so a
         * thread without scratch enters it too and fails the tasks it is handed. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) {
            if (scratch == NULL) {
                failed = 1;
                continue;
            }
            const int64_t first = lo[i], len = hi[i] - lo[i];
            const int64_t *table = tables + i * max_blocks;
            row_f32(q, i * heads * d, heads * d, is_bf16, qf);
#if FERROX_TILE_PATH
            if (tiled) {
                for (int64_t t = 0; t < len; ++t) slots[t] = slot_of(table, first + t, block_size);
                for (int64_t t = len; t < len + AHEAD; ++t) slots[t] = -1;
                sequence_tiled(qf, pool, pool_kind, slots, len, kv, g, d, scale, longest, scores, acc,
                               slots + longest + AHEAD,
                               inv_sum);
            } else
#endif
                sequence_generic(qf, pool, pool_kind, table, first, len, block_size, kv, g, d, scale, longest,
                                 scores, acc, rows, inv_sum);
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
        free(scratch);
    }
    return failed ? -1 : 0;
}
