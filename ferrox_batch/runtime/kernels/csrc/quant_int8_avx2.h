/* The AVX2 (+ FMA, F16C) tiles of quant_int8.c, whose comment says what they compute: the AVX-512 tile's
 * arithmetic over 8 weight rows at a time. Included by it only where PACKED_PATH is 1, after its acts_t,
 * pseg_t, MR and PREFETCH_* . */
#ifndef FERROX_QUANT_INT8_AVX2_H
#define FERROX_QUANT_INT8_AVX2_H

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* 32 bytes of 0xff / 0x00, byte i from bit i of `bits`. */
static inline __m256i bytes_of_bits(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                  0x0303030303030303LL));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

/* As the AVX-512 tile, for the 8 weight rows of half h of a group: out[R][8]. */
static inline __attribute__((always_inline)) void tile_half(const int type, const int R, const pseg_t *s,
                                                            const uint8_t *gw, const acts_t *a, int64_t r0, int h,
                                                            float *out) {
    packed_fmt_t f; /* constants: `type` is a literal at every call, so this switch folds away */
    packed_fmt(type, &f);
    const int bpu = f.unit_k / 32;
    const int64_t units = a->k / f.unit_k, unit_bytes = packed_unit_bytes(&f), nb = a->nb, k = a->k;
    const __m256i nib = _mm256_set1_epi8(15), pair = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t t = 0; t < units; ++t) {
        const uint8_t *unit = gw + t * unit_bytes;
        if (R <= PREFETCH_ROWS && h == 0 && t + PREFETCH_UNITS < units) { /* see PREFETCH_UNITS */
            const char *ahead = (const char *)(unit + PREFETCH_UNITS * unit_bytes);
            for (int64_t b = 0; b < unit_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
        }
        const __m256 big = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 16 * h)));
        for (int j = 0; j < bpu; ++j) {
            const int64_t b = t * bpu + j;
            const uint8_t *q = unit + f.head + j * f.qbytes;
            __m256 dv0 = big, dv1 = big, mv = _mm256_setzero_ps();
            if (type == QT_Q4_1) mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 32 + 16 * h)));
            if (type == QT_Q4_K) {
                const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(unit + 64 + 16 * j + 8 * h))));
                const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(unit + 192 + 16 * j + 8 * h))));
                dv0 = dv1 = _mm256_mul_ps(big, sc);
                mv = _mm256_sub_ps(_mm256_setzero_ps(),
                                   _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 32 + 16 * h))), mn));
            }
            if (type == QT_Q6_K) {
                const __m128i s0 = _mm_loadl_epi64((const __m128i *)(unit + 32 + 32 * j + 8 * h));
                const __m128i s1 = _mm_loadl_epi64((const __m128i *)(unit + 48 + 32 * j + 8 * h));
                dv0 = _mm256_mul_ps(big, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s0)));
                dv1 = _mm256_mul_ps(big, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s1)));
            }
            if (type == QT_MXFP4) /* this half's 8 exponent bytes */
                dv0 = dv1 = mxfp4_half8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(unit + 8 * h))));
            __m256i w[8];
            if (f.bits == 8) {
                for (int kd = 0; kd < 8; ++kd)
                    w[kd] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + 64 * kd + 32 * h)),
                                             _mm256_set1_epi8((char)0x80)); /* the signed quants */
            } else {
                for (int c = 0; c < 4; ++c) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * c + 32 * h));
                    w[2 * c] = _mm256_and_si256(v, nib);
                    w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                }
                if (f.lut) {
                    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)mxfp4_u8));
                    for (int kd = 0; kd < 8; ++kd) w[kd] = _mm256_shuffle_epi8(table, w[kd]);
                }
                if (f.bits == 5) {
                    for (int kd = 0; kd < 8; ++kd) {
                        uint32_t bits;
                        memcpy(&bits, q + 256 + 8 * kd + 4 * h, sizeof bits);
                        w[kd] = _mm256_or_si256(w[kd], _mm256_and_si256(bytes_of_bits(bits), _mm256_set1_epi8(16)));
                    }
                } else if (f.bits == 6) {
                    for (int p = 0; p < 2; ++p) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 256 + 64 * p + 32 * h));
                        w[4 * p] = _mm256_or_si256(w[4 * p], _mm256_and_si256(_mm256_slli_epi16(v, 4), pair));
                        w[4 * p + 1] = _mm256_or_si256(w[4 * p + 1], _mm256_and_si256(_mm256_slli_epi16(v, 2), pair));
                        w[4 * p + 2] = _mm256_or_si256(w[4 * p + 2], _mm256_and_si256(v, pair));
                        w[4 * p + 3] = _mm256_or_si256(w[4 * p + 3], _mm256_and_si256(_mm256_srli_epi16(v, 2), pair));
                    }
                }
            }
            for (int r = 0; r < R; ++r) {
                const int64_t row = r0 + r;
                const int8_t *xq = a->q + row * k + 32 * b;
                const int32_t *sq = a->sq + row * 2 * nb + 2 * b;
                const __m256 dx = _mm256_set1_ps(a->dx[row * nb + b]);
                for (int g = 0; g < (f.sub == 32 ? 1 : 2); ++g) {
                    const int first = f.sub == 32 ? 0 : 4 * g, count = f.sub == 32 ? 8 : 4;
                    const int32_t sum = f.sub == 32 ? sq[0] + sq[1] : sq[g];
                    __m256i i0 = _mm256_set1_epi32(type == QT_Q8_0 ? 0 : -f.zero * sum);
                    for (int kd = first; kd < first + count; ++kd) {
                        const __m256i xb = bcast4(xq + 4 * kd);
                        const __m256i prod = type == QT_Q8_0
                            ? _mm256_maddubs_epi16(_mm256_abs_epi8(w[kd]), _mm256_sign_epi8(xb, w[kd]))
                            : _mm256_maddubs_epi16(w[kd], xb);
                        i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(prod, ones));
                    }
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(g ? dv1 : dv0, dx), acc[r]);
                }
                if (f.has_min) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a->s[row * nb + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

#define HALVES 2
#define LANES 8
static inline __attribute__((always_inline)) void tile(const int type, const int R, const pseg_t *s, const uint8_t *gw,
                                                       const acts_t *a, int64_t r0, float *out) {
    float half[MR * 8];
    for (int h = 0; h < 2; ++h) {
        tile_half(type, R, s, gw, a, r0, h, half);
        for (int r = 0; r < R; ++r) memcpy(out + 16 * r + 8 * h, half + 8 * r, 8 * sizeof(float));
    }
}

#endif
