/* The quantized block formats GGUF files store weights in, decoded to float32 one block at a time.
 *
 * A weight row of k values is k / QK blocks stored back to back (QK = 32, or 256 for a K-quant's
 * super-block); nothing in a block refers outside it. The layouts, byte offsets within a block:
 *
 *   Q8_0 (type 8,  34 bytes):  d fp16 @0; q int8[32] @2.                    w[j] = d * q[j]
 *   Q4_0 (type 2,  18 bytes):  d fp16 @0; qs[16] @2: w[j] from the low nibble of qs[j], w[j + 16]
 *                              from its high nibble.                         w = d * (nibble - 8)
 *   Q4_1 (type 3,  20 bytes):  d fp16 @0, m fp16 @2; qs[16] @4 as Q4_0's.   w = d * nibble + m
 *   Q5_0 (type 6,  22 bytes):  d fp16 @0; qh uint32 (little-endian) @2; qs[16] @6: nibbles as Q4_0's,
 *                              bit j of qh the fifth bit of w[j].            w = d * (q5 - 16)
 *   Q4_K (type 12, 144 bytes): d fp16 @0, dmin fp16 @2; 12 bytes @4 packing eight 6-bit scales sc
 *                              and mins mn; qs[128] @16: sub-block 2g (32 weights) in the low nibbles
 *                              of qs[32g .. 32g + 31], sub-block 2g + 1 in their high nibbles.
 *                              w = (d * sc) * nibble - (dmin * mn), per sub-block
 *   Q6_K (type 14, 210 bytes): ql[128] @0 (low 4 bits), qh[64] @128 (high 2 bits), 16 int8 scales @192,
 *                              d fp16 @208; two halves of 128 weights (see `decode_q6_k`).
 *                              w = (d * scale) * (q6 - 32), a scale per 16 weights
 *   MXFP4 (type 39, 17 bytes): e E8M0 @0; qs[16] @1, nibbles as Q4_0's.   w = KV[nibble] * 2^(e - 128)
 *                              (quant_mxfp4.h: KV the doubled FP4 values, the scale halved to match)
 *
 * Every decode is exact in the sense that matters: it computes what gguf's numpy reference computes in
 * float32, bit for bit. The fp16 scales widen exactly (F16C where the compiler has it, else half.h's
 * bit operations, subnormals included). Every product above is of small integers and an fp16
 * significand (at most 11 + 7 + 5 = 23 significant bits, Q6_K's d * scale * q), or for MXFP4 of a
 * small integer and a power of two (quant_mxfp4.h), so it is exact in
 * float32 in any order or fused into an FMA; the only rounding is Q4_1's and Q4_K's one addition,
 * which is the reference's too. That is why -ffast-math (reassociation, contraction) cannot change a
 * decoded weight, and why the decoders can stay plain C that GCC vectorises.
 *
 * `quant_decode_row` is what both entry points of quant_gemm.c call; the switch on the format is
 * taken once per row, the block loop inside each case. */
#ifndef FERROX_QUANT_BLOCKS_H
#define FERROX_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "half.h"
#include "quant_mxfp4.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

/* GGML's type numbers of the formats decoded here (what a GGUF file names a tensor's format by). */
enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q6_K = 14, QT_MXFP4 = 39 };

/* Weights per block of `type`, or 0 when the type is not one of the seven. */
static inline int quant_block_elems(int type) {
    switch (type) {
    case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: case QT_Q8_0: case QT_MXFP4: return 32;
    case QT_Q4_K: case QT_Q6_K: return 256;
    default: return 0;
    }
}

/* Bytes per block of `type` (0 when unsupported). */
static inline int quant_block_bytes(int type) {
    switch (type) {
    case QT_Q8_0: return 34;
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q5_0: return 22;
    case QT_Q4_K: return 144;
    case QT_Q6_K: return 210;
    case QT_MXFP4: return 17;
    default: return 0;
    }
}

/* The fp16 at p (any alignment), widened exactly. */
static inline float quant_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return f16_load(h);
#endif
}

static inline void decode_q8_0(const uint8_t *b, float *restrict out) {
    const float d = quant_half(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; ++j) out[j] = d * (float)q[j];
}

static inline void decode_q4_0(const uint8_t *b, float *restrict out) {
    const float d = quant_half(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)((int)(qs[j] & 15) - 8);
        out[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
    }
}

static inline void decode_q4_1(const uint8_t *b, float *restrict out) {
    const float d = quant_half(b), m = quant_half(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)(qs[j] & 15) + m;
        out[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

static inline void decode_q5_0(const uint8_t *b, float *restrict out) {
    const float d = quant_half(b);
    uint32_t qh;
    memcpy(&qh, b + 2, sizeof qh); /* little-endian, as x86 and the file are */
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; ++j) {
        const int lo = (int)((qs[j] & 15) | (((qh >> j) & 1u) << 4));
        const int hi = (int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
        out[j] = d * (float)(lo - 16);
        out[j + 16] = d * (float)(hi - 16);
    }
}

/* Q4_K's eight 6-bit scales and mins, from its 12 packed bytes s: sub-blocks 0-3 keep theirs in the low
 * six bits of s[j] (scale) and s[j + 4] (min); sub-blocks 4-7 take their low four bits from the nibbles
 * of s[j + 4] (scale low, min high) and their top two from the spare high bits of s[j - 4] and s[j]. */
static inline void q4_k_scales(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 48);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 48);
    }
}

static inline void decode_q4_k(const uint8_t *b, float *restrict out) {
    const float d = quant_half(b), dmin = quant_half(b + 2);
    int sc[8], mn[8];
    q4_k_scales(b + 4, sc, mn);
    const uint8_t *qs = b + 16;
    for (int g = 0; g < 4; ++g) {
        /* The reference forms d * sc and dmin * mn first; both are exact, as is their product with a
         * nibble, so only the subtraction rounds. */
        const float d0 = d * (float)sc[2 * g], m0 = dmin * (float)mn[2 * g];
        const float d1 = d * (float)sc[2 * g + 1], m1 = dmin * (float)mn[2 * g + 1];
        const uint8_t *q = qs + 32 * g;
        float *o = out + 64 * g;
        for (int l = 0; l < 32; ++l) {
            o[l] = d0 * (float)(q[l] & 15) - m0;
            o[l + 32] = d1 * (float)(q[l] >> 4) - m1;
        }
    }
}

/* Each half h of 128 weights reads ql[64h ..], qh[32h ..] and scales[8h ..]: weight 32g + l of the half
 * (g < 4, l < 32) has its low four bits in the low (g = 0, 1) or high (g = 2, 3) nibble of
 * ql[64h + 32 (g & 1) + l], its top two in bits 2g, 2g + 1 of qh[32h + l], and scale (32g + l) / 16. */
static inline void decode_q6_k(const uint8_t *b, float *restrict out) {
    const float d = quant_half(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192);
    for (int h = 0; h < 2; ++h) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        float ds[8];
        for (int s = 0; s < 8; ++s) ds[s] = d * (float)scales[8 * h + s];
        float *o = out + 128 * h;
        for (int l = 0; l < 32; ++l) {
            const int half = l >> 4;
            const int q0 = (int)((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
            const int q1 = (int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            o[l] = ds[half] * (float)q0;
            o[l + 32] = ds[2 + half] * (float)q1;
            o[l + 64] = ds[4 + half] * (float)q2;
            o[l + 96] = ds[6 + half] * (float)q3;
        }
    }
}

/* One row of k weights of a supported `type` (k a whole number of its blocks) into out[0 .. k), in plain
 * C: the decoders of a build without AVX2, and the reference the vector ones below are written from. */
static inline void quant_decode_row_c(int type, const uint8_t *row, int64_t k, float *restrict out) {
    switch (type) {
    case QT_Q8_0:
        for (int64_t b = 0; b < k / 32; ++b) decode_q8_0(row + 34 * b, out + 32 * b);
        break;
    case QT_Q4_0:
        for (int64_t b = 0; b < k / 32; ++b) decode_q4_0(row + 18 * b, out + 32 * b);
        break;
    case QT_Q4_1:
        for (int64_t b = 0; b < k / 32; ++b) decode_q4_1(row + 20 * b, out + 32 * b);
        break;
    case QT_Q5_0:
        for (int64_t b = 0; b < k / 32; ++b) decode_q5_0(row + 22 * b, out + 32 * b);
        break;
    case QT_Q4_K:
        for (int64_t b = 0; b < k / 256; ++b) decode_q4_k(row + 144 * b, out + 256 * b);
        break;
    case QT_Q6_K:
        for (int64_t b = 0; b < k / 256; ++b) decode_q6_k(row + 210 * b, out + 256 * b);
        break;
    case QT_MXFP4:
        for (int64_t b = 0; b < k / 32; ++b) decode_mxfp4(row + 17 * b, out + 32 * b);
        break;
    default:
        break;
    }
}

/* The vector decoders. GCC's vectorisation of the C above measured 1-12 Gw/s a core depending on the
 * format (Q6_K's bit shuffles and Q4_0's nibble offsets the slowest), where a decode step needs the
 * decode to keep up with memory: written out here, each format runs at several times that.
 *
 * They compute the same float32 values, exactly, by other means that are exact too:
 * - a 4-bit quant (Q4_0, Q4_1, Q4_K, MXFP4's codes; Q5_0 as two halves) indexes a 16-entry table of its
 *   block's (or sub-block's) weights, built once per block with the reference's formula: `vpermps` picks the
 *   entry, using the low four bits of each lane (so a byte's low nibble needs no mask);
 * - d * (q - c) as fma(q, d, -c * d): both products are exact and so is their difference (it is the
 *   weight, which float32 holds exactly), so the one rounding of the FMA changes nothing;
 * - Q4_1's d * q + m and Q4_K's (d * sc) * q - dmin * mn as one FMA: the product is exact, so the FMA
 *   rounds exactly as the reference's separate addition does. */
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512i quant_bytes16(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

#define QUANT_IOTA16 _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)

/* 32 consecutive float32 weights into dst from element `at`. */
static inline __attribute__((always_inline)) void quant_put32(float *dst, int64_t at, __m512 lo, __m512 hi) {
    _mm512_storeu_ps(dst + at, lo);
    _mm512_storeu_ps(dst + at + 16, hi);
}

static inline __attribute__((always_inline)) void quant_decode_row_512(int type, const uint8_t *row, int64_t k,
                                                                       float *dst) {
    const __m512 iota = QUANT_IOTA16;
    switch (type) {
    case QT_Q8_0:
        for (int64_t b = 0; b < k / 32; ++b) {
            const uint8_t *p = row + 34 * b;
            const __m512 d = _mm512_set1_ps(quant_half(p));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2))));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18))));
            quant_put32(dst, 32 * b, _mm512_mul_ps(d, lo), _mm512_mul_ps(d, hi));
        }
        break;
    case QT_Q4_0:
        for (int64_t b = 0; b < k / 32; ++b) {
            const uint8_t *p = row + 18 * b;
            const __m512 table = _mm512_mul_ps(_mm512_set1_ps(quant_half(p)), _mm512_sub_ps(iota, _mm512_set1_ps(8)));
            const __m512i v = quant_bytes16(p + 2);
            quant_put32(dst, 32 * b, _mm512_permutexvar_ps(v, table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table));
        }
        break;
    case QT_Q4_1:
        for (int64_t b = 0; b < k / 32; ++b) {
            const uint8_t *p = row + 20 * b;
            const __m512 table =
                _mm512_fmadd_ps(_mm512_set1_ps(quant_half(p)), iota, _mm512_set1_ps(quant_half(p + 2)));
            const __m512i v = quant_bytes16(p + 4);
            quant_put32(dst, 32 * b, _mm512_permutexvar_ps(v, table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table));
        }
        break;
    case QT_MXFP4:
        for (int64_t b = 0; b < k / 32; ++b) {
            const uint8_t *p = row + 17 * b;
            const __m512 table = _mm512_mul_ps(_mm512_set1_ps(mxfp4_half(p[0])), _mm512_loadu_ps(mxfp4_kv_f32));
            const __m512i v = quant_bytes16(p + 1);
            quant_put32(dst, 32 * b, _mm512_permutexvar_ps(v, table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table));
        }
        break;
    case QT_Q5_0:
        for (int64_t b = 0; b < k / 32; ++b) {
            /* Two tables: quants 0-15 (fifth bit clear) and 16-31 (set); the fifth bits, one per weight,
             * are the masks that pick the second. */
            const uint8_t *p = row + 22 * b;
            const __m512 d = _mm512_set1_ps(quant_half(p));
            const __m512 clear = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16)));
            const __m512 set = _mm512_mul_ps(d, iota);
            uint32_t qh;
            memcpy(&qh, p + 2, sizeof qh);
            const __m512i v = quant_bytes16(p + 6), v4 = _mm512_srli_epi32(v, 4);
            const __mmask16 fifth_lo = (__mmask16)(qh & 0xffffu), fifth_hi = (__mmask16)(qh >> 16);
            const __m512 lo = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(v, clear), fifth_lo, v, set);
            const __m512 hi = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(v4, clear), fifth_hi, v4, set);
            quant_put32(dst, 32 * b, lo, hi);
        }
        break;
    case QT_Q4_K:
        for (int64_t b = 0; b < k / 256; ++b) {
            const uint8_t *p = row + 144 * b;
            const float d = quant_half(p), dmin = quant_half(p + 2);
            int sc[8], mn[8];
            q4_k_scales(p + 4, sc, mn);
            for (int g = 0; g < 4; ++g) {
                const __m512 low = _mm512_fmsub_ps(_mm512_set1_ps(d * (float)sc[2 * g]), iota,
                                                   _mm512_set1_ps(dmin * (float)mn[2 * g]));
                const __m512 high = _mm512_fmsub_ps(_mm512_set1_ps(d * (float)sc[2 * g + 1]), iota,
                                                    _mm512_set1_ps(dmin * (float)mn[2 * g + 1]));
                const __m512i v0 = quant_bytes16(p + 16 + 32 * g), v1 = quant_bytes16(p + 32 + 32 * g);
                quant_put32(dst, 256 * b + 64 * g, _mm512_permutexvar_ps(v0, low), _mm512_permutexvar_ps(v1, low));
                quant_put32(dst, 256 * b + 64 * g + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), high),
                            _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), high));
            }
        }
        break;
    case QT_Q6_K:
        for (int64_t b = 0; b < k / 256; ++b) {
            const uint8_t *p = row + 210 * b;
            const float d = quant_half(p + 208);
            const int8_t *scales = (const int8_t *)(p + 192);
            const __m512i m15 = _mm512_set1_epi32(15), m48 = _mm512_set1_epi32(48);
            for (int h = 0; h < 2; ++h) {
                const uint8_t *ql = p + 64 * h, *qh = p + 128 + 32 * h;
                const __m512i a0 = quant_bytes16(ql), a1 = quant_bytes16(ql + 16);
                const __m512i c0 = quant_bytes16(ql + 32), c1 = quant_bytes16(ql + 48);
                const __m512i h0 = quant_bytes16(qh), h1 = quant_bytes16(qh + 16);
                /* Group g's 6-bit quants (module comment on decode_q6_k): low bits, then bits 2g, 2g + 1 of
                 * qh moved to bits 4-5. */
                __m512i q[4][2];
                q[0][0] = _mm512_or_si512(_mm512_and_si512(a0, m15), _mm512_and_si512(_mm512_slli_epi32(h0, 4), m48));
                q[0][1] = _mm512_or_si512(_mm512_and_si512(a1, m15), _mm512_and_si512(_mm512_slli_epi32(h1, 4), m48));
                q[1][0] = _mm512_or_si512(_mm512_and_si512(c0, m15), _mm512_and_si512(_mm512_slli_epi32(h0, 2), m48));
                q[1][1] = _mm512_or_si512(_mm512_and_si512(c1, m15), _mm512_and_si512(_mm512_slli_epi32(h1, 2), m48));
                q[2][0] = _mm512_or_si512(_mm512_srli_epi32(a0, 4), _mm512_and_si512(h0, m48));
                q[2][1] = _mm512_or_si512(_mm512_srli_epi32(a1, 4), _mm512_and_si512(h1, m48));
                q[3][0] = _mm512_or_si512(_mm512_srli_epi32(c0, 4), _mm512_and_si512(_mm512_srli_epi32(h0, 2), m48));
                q[3][1] = _mm512_or_si512(_mm512_srli_epi32(c1, 4), _mm512_and_si512(_mm512_srli_epi32(h1, 2), m48));
                for (int g = 0; g < 4; ++g) {
                    const float s0 = d * (float)scales[8 * h + 2 * g], s1 = d * (float)scales[8 * h + 2 * g + 1];
                    const __m512 lo = _mm512_fmsub_ps(_mm512_cvtepi32_ps(q[g][0]), _mm512_set1_ps(s0),
                                                      _mm512_set1_ps(32 * s0));
                    const __m512 hi = _mm512_fmsub_ps(_mm512_cvtepi32_ps(q[g][1]), _mm512_set1_ps(s1),
                                                      _mm512_set1_ps(32 * s1));
                    quant_put32(dst, 256 * b + 128 * h + 32 * g, lo, hi);
                }
            }
        }
        break;
    default:
        break;
    }
}

static inline void quant_decode_row(int type, const uint8_t *row, int64_t k, float *restrict out) {
    quant_decode_row_512(type, row, k, out);
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256i quant_bytes8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* 8 lanes have no 16-entry table in one instruction, so the quants are converted and scaled: fma(q, d, c)
 * with the exact c of each format (the comment above); MXFP4's codes are first looked up as their integer
 * values by `vpshufb`, 16 bytes at a time. */
static inline void quant_decode_row(int type, const uint8_t *row, int64_t k, float *restrict out) {
    const __m256i m15 = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1), m48 = _mm256_set1_epi32(48);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), sixteen = _mm256_set1_epi32(16);
    switch (type) {
    case QT_Q8_0:
        for (int64_t b = 0; b < k / 32; ++b) {
            const uint8_t *p = row + 34 * b;
            const __m256 d = _mm256_set1_ps(quant_half(p));
            for (int i = 0; i < 32; i += 8) {
                const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 2 + i)));
                _mm256_storeu_ps(out + 32 * b + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
            }
        }
        break;
    case QT_Q4_0:
    case QT_Q4_1:
        for (int64_t b = 0; b < k / 32; ++b) {
            const int q41 = type == QT_Q4_1;
            const uint8_t *p = row + (q41 ? 20 : 18) * b;
            const float df = quant_half(p);
            const __m256 d = _mm256_set1_ps(df), c = _mm256_set1_ps(q41 ? quant_half(p + 2) : -8 * df);
            for (int i = 0; i < 16; i += 8) {
                const __m256i v = quant_bytes8(p + (q41 ? 4 : 2) + i);
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, m15));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
                _mm256_storeu_ps(out + 32 * b + i, _mm256_fmadd_ps(lo, d, c));
                _mm256_storeu_ps(out + 32 * b + 16 + i, _mm256_fmadd_ps(hi, d, c));
            }
        }
        break;
    case QT_MXFP4:
        for (int64_t b = 0; b < k / 32; ++b) {
            const uint8_t *p = row + 17 * b;
            const __m256 d = _mm256_set1_ps(mxfp4_half(p[0]));
            __m128i lo, hi;
            mxfp4_kv_bytes(p + 1, &lo, &hi);
            const __m128i kv[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int i = 0; i < 4; ++i) {
                const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(kv[i]));
                _mm256_storeu_ps(out + 32 * b + 8 * i, _mm256_mul_ps(d, w));
            }
        }
        break;
    case QT_Q5_0:
        for (int64_t b = 0; b < k / 32; ++b) {
            const uint8_t *p = row + 22 * b;
            const float df = quant_half(p);
            const __m256 d = _mm256_set1_ps(df), c = _mm256_set1_ps(-16 * df);
            uint32_t qh;
            memcpy(&qh, p + 2, sizeof qh);
            const __m256i bits = _mm256_set1_epi32((int)qh);
            for (int i = 0; i < 16; i += 8) {
                const __m256i v = quant_bytes8(p + 6 + i);
                const __m256i at = _mm256_add_epi32(lanes, _mm256_set1_epi32(i));
                const __m256i fifth_lo = _mm256_and_si256(_mm256_srlv_epi32(bits, at), one);
                const __m256i fifth_hi = _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_add_epi32(at, sixteen)), one);
                const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m15), _mm256_slli_epi32(fifth_lo, 4));
                const __m256i hi = _mm256_or_si256(_mm256_srli_epi32(v, 4), _mm256_slli_epi32(fifth_hi, 4));
                _mm256_storeu_ps(out + 32 * b + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), d, c));
                _mm256_storeu_ps(out + 32 * b + 16 + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), d, c));
            }
        }
        break;
    case QT_Q4_K:
        for (int64_t b = 0; b < k / 256; ++b) {
            const uint8_t *p = row + 144 * b;
            const float d = quant_half(p), dmin = quant_half(p + 2);
            int sc[8], mn[8];
            q4_k_scales(p + 4, sc, mn);
            for (int g = 0; g < 4; ++g) {
                const __m256 d0 = _mm256_set1_ps(d * (float)sc[2 * g]), m0 = _mm256_set1_ps(dmin * (float)mn[2 * g]);
                const __m256 d1 = _mm256_set1_ps(d * (float)sc[2 * g + 1]);
                const __m256 m1 = _mm256_set1_ps(dmin * (float)mn[2 * g + 1]);
                float *o = out + 256 * b + 64 * g;
                for (int i = 0; i < 32; i += 8) {
                    const __m256i v = quant_bytes8(p + 16 + 32 * g + i);
                    _mm256_storeu_ps(o + i, _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, m15)), d0, m0));
                    _mm256_storeu_ps(o + 32 + i, _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d1, m1));
                }
            }
        }
        break;
    case QT_Q6_K:
        for (int64_t b = 0; b < k / 256; ++b) {
            const uint8_t *p = row + 210 * b;
            const float d = quant_half(p + 208);
            const int8_t *scales = (const int8_t *)(p + 192);
            for (int h = 0; h < 2; ++h) {
                const uint8_t *ql = p + 64 * h, *qh = p + 128 + 32 * h;
                float *o = out + 256 * b + 128 * h;
                for (int l = 0; l < 32; l += 8) {
                    const __m256i a = quant_bytes8(ql + l), c = quant_bytes8(ql + 32 + l), hb = quant_bytes8(qh + l);
                    const __m256i h0 = _mm256_and_si256(_mm256_slli_epi32(hb, 4), m48);
                    const __m256i h1 = _mm256_and_si256(_mm256_slli_epi32(hb, 2), m48);
                    const __m256i h3 = _mm256_and_si256(_mm256_srli_epi32(hb, 2), m48);
                    const __m256i q0 = _mm256_or_si256(_mm256_and_si256(a, m15), h0);
                    const __m256i q1 = _mm256_or_si256(_mm256_and_si256(c, m15), h1);
                    const __m256i q2 = _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_and_si256(hb, m48));
                    const __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(c, 4), h3);
                    const __m256i qs[4] = {q0, q1, q2, q3};
                    for (int g = 0; g < 4; ++g) {
                        const float s = d * (float)scales[8 * h + 2 * g + l / 16];
                        _mm256_storeu_ps(o + 32 * g + l, _mm256_fmsub_ps(_mm256_cvtepi32_ps(qs[g]), _mm256_set1_ps(s),
                                                                         _mm256_set1_ps(32 * s)));
                    }
                }
            }
        }
        break;
    default:
        break;
    }
}

#else

static inline void quant_decode_row(int type, const uint8_t *row, int64_t k, float *restrict out) {
    quant_decode_row_c(type, row, k, out);
}

#endif
#endif
