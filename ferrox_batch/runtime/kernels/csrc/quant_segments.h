/* The rows of a quantized weight as the kernels take them: segments of one format each, stacked along
 * the outputs and cut into tiles of NT rows (quant_gemm.c's), and the horizontal sums its register tiles
 * end with. A call passes (ggml type, rows, address) triples;
 * `read_segments` checks and parses them once per call. */
#ifndef FERROX_QUANT_SEGMENTS_H
#define FERROX_QUANT_SEGMENTS_H

#include <stdint.h>

#include "kernels.h"
#include "quant_blocks.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Weight rows per tile: decoded together, one accumulator column each. */
#define NT 4

typedef struct {
    const uint8_t *w;
    int64_t rows, row_bytes, col, first_tile;
    int type;
} segment_t;

/* Parses and checks the (type, rows, address) triples into `segs`; returns the tile count, or -1 / -2. */
static inline int64_t read_segments(const int64_t *triples, int64_t n_segs, int64_t k, segment_t *segs, int64_t *n) {
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

#if defined(__AVX2__)
/* The four sums of four 8-lane accumulators, in order: three horizontal adds and one fold. */
static inline __m128 sum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

#if defined(__AVX512F__)
static inline __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

static inline __m128 sum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
    return sum4_256(fold512(a), fold512(b), fold512(c), fold512(d));
}
#endif

#endif
