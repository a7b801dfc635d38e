/* The AVX2 tiles of prefill_attention.c (that file's comment says what they compute): widening and
 * transposing keys, scoring query vectors against 16 keys at a time, and summing values for up to
 * three heads of a row, with every accumulator in a register. Included by it only where
 * PREFILL_TILE_PATH holds (AVX2 + FMA), after its KEY_BLOCK and VALUE_HEADS. */
#ifndef FERROX_PREFILL_ATTENTION_TILES_H
#define FERROX_PREFILL_ATTENTION_TILES_H

/* r[u][x] <- r[x][u] for an 8 x 8 block. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], v[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        v[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        v[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        v[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        v[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(v[i], v[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(v[i], v[i + 4], 0x31);
    }
}

/* Query vectors at a time in pass 1: SCORE_QUERIES x 2 key vectors of accumulators, the two key
 * vectors and a broadcast fill AVX2's 16 registers. */
#define SCORE_QUERIES 6

/* scores[v][j] = scale * (q_v . k_j) for nv (<= SCORE_QUERIES) query vectors (rows d apart in q)
 * and the keys kb .. kb + count of one KV head (count a multiple of KEY_BLOCK; kt: that head's
 * transposed keys, rows `ld` apart; score rows `ld` apart too, from key kb on). */
static inline __attribute__((always_inline)) void score_block(const float *q, int64_t d, const float *kt,
                                                              int64_t ld, int64_t kb, int64_t count, int nv,
                                                              float scale, float *scores) {
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t j = kb; j < kb + count; j += KEY_BLOCK) {
        __m256 a[SCORE_QUERIES][2];
        for (int v = 0; v < nv; ++v) a[v][0] = a[v][1] = _mm256_setzero_ps();
        for (int64_t e = 0; e < d; ++e) {
            const __m256 k0 = _mm256_loadu_ps(kt + e * ld + j), k1 = _mm256_loadu_ps(kt + e * ld + j + 8);
            for (int v = 0; v < nv; ++v) {
                const __m256 b = _mm256_broadcast_ss(q + v * d + e);
                a[v][0] = _mm256_fmadd_ps(b, k0, a[v][0]);
                a[v][1] = _mm256_fmadd_ps(b, k1, a[v][1]);
            }
        }
        for (int v = 0; v < nv; ++v) {
            _mm256_storeu_ps(scores + v * ld + j, _mm256_mul_ps(a[v][0], s));
            _mm256_storeu_ps(scores + v * ld + j + 8, _mm256_mul_ps(a[v][1], s));
        }
    }
}

static void score_blocks(const float *q, int64_t d, const float *kt, int64_t ld, int64_t kb, int64_t count, int nv,
                         float scale, float *scores) {
    switch (nv) { /* constant sizes keep the accumulators in registers */
    case 1: score_block(q, d, kt, ld, kb, count, 1, scale, scores); break;
    case 2: score_block(q, d, kt, ld, kb, count, 2, scale, scores); break;
    case 3: score_block(q, d, kt, ld, kb, count, 3, scale, scores); break;
    case 4: score_block(q, d, kt, ld, kb, count, 4, scale, scores); break;
    case 5: score_block(q, d, kt, ld, kb, count, 5, scale, scores); break;
    default: score_block(q, d, kt, ld, kb, count, 6, scale, scores); break;
    }
}

/* acc[h][0 .. 8 * vecs) = sum over keys lo .. hi - 1 of w[h][j] * v_j for nh (<= VALUE_HEADS) query
 * heads of one row (weight rows `ld` apart, acc rows d apart) and values v_j at v + j * d, 8 * vecs
 * elements. The
 * accumulators are named, not an array: GCC kept an array of them on the stack here, storing all
 * twelve every key, and that pass took half the kernel's time (perf). */
static inline __attribute__((always_inline)) void value_block(const float *w, int64_t ld, const float *v, int64_t d,
                                                              int64_t lo, int64_t hi, int nh, int vecs,
                                                              float *acc) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m256 a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    const float *w0 = w, *w1 = nh > 1 ? w + ld : w, *w2 = nh > 2 ? w + 2 * ld : w;
    for (int64_t j = lo; j < hi; ++j) {
        /* The weights first, then one value vector at a time: 12 accumulators, 3 weights and 1 value
         * are AVX2's 16 registers (all four values live at once would spill). */
        const float *vj = v + j * d;
        const __m256 b0 = _mm256_broadcast_ss(w0 + j);
        const __m256 b1 = nh > 1 ? _mm256_broadcast_ss(w1 + j) : b0, b2 = nh > 2 ? _mm256_broadcast_ss(w2 + j) : b0;
        __m256 x = _mm256_loadu_ps(vj);
        a00 = _mm256_fmadd_ps(b0, x, a00);
        if (nh > 1) a10 = _mm256_fmadd_ps(b1, x, a10);
        if (nh > 2) a20 = _mm256_fmadd_ps(b2, x, a20);
        if (vecs > 1) {
            x = _mm256_loadu_ps(vj + 8);
            a01 = _mm256_fmadd_ps(b0, x, a01);
            if (nh > 1) a11 = _mm256_fmadd_ps(b1, x, a11);
            if (nh > 2) a21 = _mm256_fmadd_ps(b2, x, a21);
        }
        if (vecs > 2) {
            x = _mm256_loadu_ps(vj + 16);
            a02 = _mm256_fmadd_ps(b0, x, a02);
            if (nh > 1) a12 = _mm256_fmadd_ps(b1, x, a12);
            if (nh > 2) a22 = _mm256_fmadd_ps(b2, x, a22);
        }
        if (vecs > 3) {
            x = _mm256_loadu_ps(vj + 24);
            a03 = _mm256_fmadd_ps(b0, x, a03);
            if (nh > 1) a13 = _mm256_fmadd_ps(b1, x, a13);
            if (nh > 2) a23 = _mm256_fmadd_ps(b2, x, a23);
        }
    }
    const __m256 sums[VALUE_HEADS][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
    for (int h = 0; h < nh; ++h)
        for (int b = 0; b < vecs; ++b) _mm256_storeu_ps(acc + h * d + 8 * b, sums[h][b]);
}

static void value_blocks(const float *w, int64_t ld, const float *v, int64_t d, int64_t lo, int64_t hi, int nh,
                         int vecs, float *acc) {
#define FERROX_VALUES(H)                                                    \
    switch (vecs) {                                                         \
    case 1: value_block(w, ld, v, d, lo, hi, H, 1, acc); break;             \
    case 2: value_block(w, ld, v, d, lo, hi, H, 2, acc); break;             \
    case 3: value_block(w, ld, v, d, lo, hi, H, 3, acc); break;             \
    default: value_block(w, ld, v, d, lo, hi, H, 4, acc); break;            \
    }
    switch (nh) {
    case 1: FERROX_VALUES(1); break;
    case 2: FERROX_VALUES(2); break;
    default: FERROX_VALUES(3); break;
    }
#undef FERROX_VALUES
}

#endif
