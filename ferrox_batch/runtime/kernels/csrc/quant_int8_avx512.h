/* The AVX-512 (AVX512BW + AVX512_VNNI) tile of quant_int8.c, whose comment says what it computes: 16
 * weight rows of one group by up to MR x rows, each block expanded in registers once and shared by the
 * rows. Included by it only where PACKED_PATH is 2, after its acts_t, pseg_t, MR and PREFETCH_* . */
#ifndef FERROX_QUANT_INT8_AVX512_H
#define FERROX_QUANT_INT8_AVX512_H

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* Rows r0 .. r0 + R of x times the 16 weight rows of one group (`gw`), into out[R][16]. */
static inline __attribute__((always_inline)) void tile(const int type, const int R, const pseg_t *s, const uint8_t *gw,
                                                       const acts_t *a, int64_t r0, float *out) {
    packed_fmt_t f; /* constants: `type` is a literal at every call, so this switch folds away */
    packed_fmt(type, &f);
    const int bpu = f.unit_k / 32;
    const int64_t units = a->k / f.unit_k, unit_bytes = packed_unit_bytes(&f), nb = a->nb, k = a->k;
    const __m512i nib = _mm512_set1_epi8(15), pair = _mm512_set1_epi8(0x30), sixteen = _mm512_set1_epi8(16);
    __m512 acc[MR];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t t = 0; t < units; ++t) {
        const uint8_t *unit = gw + t * unit_bytes;
        if (R <= PREFETCH_ROWS && t + PREFETCH_UNITS < units) { /* see PREFETCH_UNITS */
            const char *ahead = (const char *)(unit + PREFETCH_UNITS * unit_bytes);
            for (int64_t b = 0; b < unit_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
        }
        const __m512 big = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)unit));
        for (int j = 0; j < bpu; ++j) {
            const int64_t b = t * bpu + j;
            const uint8_t *q = unit + f.head + j * f.qbytes;
            __m512 dv0 = big, dv1 = big, mv = _mm512_setzero_ps();
            if (type == QT_Q4_1) mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(unit + 32)));
            if (type == QT_Q4_K) {
                const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(unit + 64 + 16 * j))));
                const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(unit + 192 + 16 * j))));
                dv0 = dv1 = _mm512_mul_ps(big, sc);
                mv = _mm512_sub_ps(_mm512_setzero_ps(),
                                   _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(unit + 32))), mn));
            }
            if (type == QT_Q6_K) {
                const __m128i s0 = _mm_loadu_si128((const __m128i *)(unit + 32 + 32 * j));
                const __m128i s1 = _mm_loadu_si128((const __m128i *)(unit + 48 + 32 * j));
                dv0 = _mm512_mul_ps(big, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s0)));
                dv1 = _mm512_mul_ps(big, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s1)));
            }
            if (type == QT_MXFP4) /* the 16 rows' exponent bytes */
                dv0 = dv1 = mxfp4_half16(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)unit)));
            __m512i w[8];
            if (f.bits == 8) {
                for (int kd = 0; kd < 8; ++kd) w[kd] = _mm512_loadu_si512(q + 64 * kd);
            } else {
                for (int c = 0; c < 4; ++c) {
                    const __m512i v = _mm512_loadu_si512(q + 64 * c);
                    w[2 * c] = _mm512_and_si512(v, nib);
                    w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                }
                if (f.lut) {
                    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)mxfp4_u8));
                    for (int kd = 0; kd < 8; ++kd) w[kd] = _mm512_shuffle_epi8(table, w[kd]);
                }
                if (f.bits == 5) {
                    for (int kd = 0; kd < 8; ++kd) {
                        uint64_t bits;
                        memcpy(&bits, q + 256 + 8 * kd, sizeof bits);
                        w[kd] = _mm512_mask_add_epi8(w[kd], (__mmask64)bits, w[kd], sixteen);
                    }
                } else if (f.bits == 6) {
                    for (int p = 0; p < 2; ++p) {
                        const __m512i v = _mm512_loadu_si512(q + 256 + 64 * p);
                        w[4 * p] = _mm512_or_si512(w[4 * p], _mm512_and_si512(_mm512_slli_epi16(v, 4), pair));
                        w[4 * p + 1] = _mm512_or_si512(w[4 * p + 1], _mm512_and_si512(_mm512_slli_epi16(v, 2), pair));
                        w[4 * p + 2] = _mm512_or_si512(w[4 * p + 2], _mm512_and_si512(v, pair));
                        w[4 * p + 3] = _mm512_or_si512(w[4 * p + 3], _mm512_and_si512(_mm512_srli_epi16(v, 2), pair));
                    }
                }
            }
            for (int r = 0; r < R; ++r) {
                const int64_t row = r0 + r;
                const int8_t *xq = a->q + row * k + 32 * b;
                const int32_t *sq = a->sq + row * 2 * nb + 2 * b;
                const __m512 dx = _mm512_set1_ps(a->dx[row * nb + b]);
                if (f.sub == 32) {
                    __m512i i0 = _mm512_set1_epi32(-f.zero * (sq[0] + sq[1])), i1 = _mm512_setzero_si512();
                    for (int kd = 0; kd < 8; kd += 2) {
                        i0 = _mm512_dpbusd_epi32(i0, w[kd], bcast4(xq + 4 * kd));
                        i1 = _mm512_dpbusd_epi32(i1, w[kd + 1], bcast4(xq + 4 * kd + 4));
                    }
                    i0 = _mm512_add_epi32(i0, i1);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(dv0, dx), acc[r]);
                    if (f.has_min) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a->s[row * nb + b]), acc[r]);
                } else {
                    for (int h = 0; h < 2; ++h) {
                        __m512i i0 = _mm512_set1_epi32(-f.zero * sq[h]), i1 = _mm512_setzero_si512();
                        i0 = _mm512_dpbusd_epi32(i0, w[4 * h], bcast4(xq + 16 * h));
                        i1 = _mm512_dpbusd_epi32(i1, w[4 * h + 1], bcast4(xq + 16 * h + 4));
                        i0 = _mm512_dpbusd_epi32(i0, w[4 * h + 2], bcast4(xq + 16 * h + 8));
                        i1 = _mm512_dpbusd_epi32(i1, w[4 * h + 3], bcast4(xq + 16 * h + 12));
                        i0 = _mm512_add_epi32(i0, i1);
                        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(h ? dv1 : dv0, dx), acc[r]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}
#define HALVES 1
#define LANES 16

#endif
