/* The AVX2 path of paged_decode.c, register-blocked (that file's comment says what it computes and
 * how; this one is included by it only where FERROX_TILE_PATH holds, after its softmax_rows).
 * Needs AVX2 and FMA, and F16C for an fp16 pool (without F16C paged_decode.c keeps fp16 pools on the
 * generic path). */
#ifndef FERROX_PAGED_DECODE_BLOCKED_H
#define FERROX_PAGED_DECODE_BLOCKED_H

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

/* KV heads h0 .. h1 - 1 of one sequence: their query heads (`qf`, [(h1 - h0) g, d]) over the slots; `slots`
 * holds the sequence's len slot ids followed by AHEAD of -1, `offsets` room for len element offsets. Pass 1
 * walks the slots 4 at a time, scoring every query head against each slot's keys while they are in cache;
 * pass 2 walks every slot once per (KV head, block of query heads, 32 values of the head dimension), its
 * accumulators in registers throughout. scores [(h1 - h0) g, longest], acc [(h1 - h0) g, d], sinks (NULL or
 * these query heads' sink logits) and inv_sum [(h1 - h0) g]. Each head's sums are the same whatever range it
 * is computed in. */
static void heads_tiled(const float *qf, const void *pool, int kind, const int64_t *slots, int64_t len, int64_t kv,
                        int64_t h0, int64_t h1, int64_t g, int64_t d, float scale, int64_t longest, float *scores,
                        float *acc, int64_t *offsets, const float *sinks, float *inv_sum) {
    const int64_t width = kv * d, slot_stride = 2 * width;
    const int64_t elem = kind == ELEM_F32 ? 4 : 2, span = (h1 - h0) * d * elem;
    for (int64_t t0 = 0; t0 < len; t0 += 4) {
        const int64_t count = len - t0 < 4 ? len - t0 : 4;
        /* The slots AHEAD ahead, these heads' keys and values, into L1: their blocks are rarely adjacent, so
         * the hardware prefetcher misses each block's start, and pass 2 then reads the values from cache
         * (a decode step's whole cache is larger than L3). Measured 1.2-1.3x over keys alone with a
         * non-temporal hint. */
        for (int64_t u = 0; u < count && slots[t0 + u + AHEAD] >= 0; ++u) {
            const char *ahead = (const char *)pool + (slots[t0 + u + AHEAD] * slot_stride + h0 * d) * elem;
            for (int64_t b = 0; b < span; b += 64) {
                __builtin_prefetch(ahead + b, 0, 3);
                __builtin_prefetch(ahead + width * elem + b, 0, 3);
            }
        }
        for (int64_t h = h0; h < h1; ++h) {
            int64_t at[4];
            for (int64_t u = 0; u < 4; ++u) at[u] = slots[t0 + (u < count ? u : 0)] * slot_stride + h * d;
            for (int64_t j = 0; j < g; j += GROUP_BLOCK) {
                const int gc = (int)(g - j < GROUP_BLOCK ? g - j : GROUP_BLOCK);
                const int64_t row = (h - h0) * g + j;
                key_blocks(qf + row * d, pool, kind, at, count, d, gc, scale, scores + row * longest + t0, longest);
            }
        }
    }
    softmax_rows(scores, (h1 - h0) * g, longest, len, sinks, inv_sum);
    for (int64_t h = h0; h < h1; ++h) {
        for (int64_t e = 0; e < d;) {
            const int vecs = d - e >= 32 ? 4 : 1;
            for (int64_t t = 0; t < len; ++t) offsets[t] = slots[t] * slot_stride + width + h * d + e;
            for (int64_t j = 0; j < g; j += GROUP_BLOCK) {
                const int gc = (int)(g - j < GROUP_BLOCK ? g - j : GROUP_BLOCK);
                const int64_t row = (h - h0) * g + j;
                value_blocks(acc + row * d + e, scores + row * longest, pool, kind, offsets, len, d, longest, gc,
                             vecs);
            }
            e += 8 * vecs;
        }
    }
}
#endif
