/* GGUF's quantized weights repacked once at load for integer dot products (quant_pack.c writes them,
 * quant_int8.c multiplies them), in the same bytes as the file's blocks.
 *
 * Every format is read as w = d * (u - o) + m over a block of inputs: u an unsigned integer of `bits`
 * bits, o the format's constant zero point, d a scale and m a minimum per row and block (m only where the
 * format has one). So a block's product with int8 activations (x ~ dx * qx) is
 *     sum w * x = (d * dx) * (sum u * qx - o * sum qx) + m * (dx * sum qx),
 * one integer dot product of unsigned bytes by signed bytes (`vpdpbusd`) and two float terms.
 *
 *   format  bits  o    d per          m                   the file's block
 *   Q8_0    8     128  32 inputs      -                   q + 128 (q int8)
 *   Q4_0    4     8    32             -                   the nibble
 *   Q4_1    4     0    32             m (fp16)            the nibble
 *   Q5_0    5     16   32             -                   nibble | fifth bit << 4
 *   Q4_K    4     0    32: D * sc     -(Dmin * mn)        6-bit sc, mn per 32; D, Dmin per 256
 *   Q6_K    6     32   16: D * sc     -                   int8 sc per 16; D per 256
 *   MXFP4   4*    12   32: 2^(e-128)  -                   KV[nibble] + 12 (quant_mxfp4.h), in [0, 24]
 *
 * (*) MXFP4 keeps its FP4 codes, 4 bits, where the others keep u: the code is looked up as u (`lut`, the
 * MXFP4_U table; one `vpshufb` per vector), so its packing is the file's size and its u is exact.
 *
 * Layout. Rows go in groups of 16 (the last padded with zero rows); a group is `units` units back to back,
 * a unit one block of the file (32 inputs, or a K-quant's 256). A unit is its scales (`head` bytes), then
 * per 32 inputs `qbytes` of quants, in which input 4 kd + t (kd < 8, t < 4) of row r sits at byte
 * 4 r + t of 64-byte vector kd: one vector is 16 rows by 4 inputs, `vpdpbusd`'s operand as it stands.
 *   8 bits: 8 vectors.
 *   4 bits: 4 vectors of nibbles: vector c's low nibbles are vector 2c, its high nibbles vector 2c + 1.
 *   5 bits: the 4 nibble vectors, then 8 uint64 masks: bit 4 r + t of mask kd is the fifth bit.
 *   6 bits: the 4 nibble vectors, then 2 vectors of 2-bit pairs: bits 2 i, 2 i + 1 of byte 4 r + t of
 *           vector p are bits 4-5 of vector 4 p + i.
 * Heads (16 entries each, one a row): Q8_0, Q4_0, Q5_0: d fp16[16]. Q4_1: d fp16[16], m fp16[16].
 * Q4_K: D fp16[16], Dmin fp16[16], sc uint8[8][16], mn uint8[8][16]. Q6_K: D fp16[16], sc int8[16][16].
 * MXFP4: e uint8[16] (the file's E8M0 bytes; 2^(e - 128) formed from bits, as llama.cpp does).
 * The fp16 values and small integers are the file's own bits, so every d and m formed from them
 * (products of an fp16 and an integer below 2^8) is exact in float32 and equals gguf's dequantization,
 * and so does each w. Sizes equal the file's but for Q4_K, whose 6-bit scales are unpacked to bytes
 * (2368 bytes per 16 rows of 256 against 2304, +2.8%). */
#ifndef FERROX_QUANT_PACKED_H
#define FERROX_QUANT_PACKED_H

#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"

/* Weight rows per group: one 64-byte vector holds 16 rows of 4 inputs. */
#define PG 16

typedef struct {
    int unit_k;   /* inputs per unit: 32, or 256 */
    int head;     /* bytes of a unit's scales */
    int qbytes;   /* bytes of 32 inputs' quants for 16 rows */
    int bits;     /* 8, 4, 5 or 6 */
    int zero;     /* o */
    int has_min;  /* whether m is there */
    int sub;      /* inputs per scale: 32, or 16 */
    int lut;      /* whether the 4-bit values are codes looked up as u (MXFP4) */
} packed_fmt_t;

/* The layout constants of `type`; 0 when it is not one of the seven. */
static inline int packed_fmt(int type, packed_fmt_t *f) {
    switch (type) {
    case QT_Q8_0: *f = (packed_fmt_t){32, 32, 512, 8, 128, 0, 32, 0}; return 1;
    case QT_Q4_0: *f = (packed_fmt_t){32, 32, 256, 4, 8, 0, 32, 0}; return 1;
    case QT_Q4_1: *f = (packed_fmt_t){32, 64, 256, 4, 0, 1, 32, 0}; return 1;
    case QT_Q5_0: *f = (packed_fmt_t){32, 32, 320, 5, 16, 0, 32, 0}; return 1;
    case QT_Q4_K: *f = (packed_fmt_t){256, 320, 256, 4, 0, 1, 32, 0}; return 1;
    case QT_Q6_K: *f = (packed_fmt_t){256, 288, 384, 6, 32, 0, 16, 0}; return 1;
    case QT_MXFP4: *f = (packed_fmt_t){32, 16, 256, 4, MXFP4_ZERO, 0, 32, 1}; return 1;
    default: return 0;
    }
}

static inline int64_t packed_unit_bytes(const packed_fmt_t *f) { return f->head + (int64_t)(f->unit_k / 32) * f->qbytes; }

static inline int64_t packed_group_bytes(const packed_fmt_t *f, int64_t k) {
    return k / f->unit_k * packed_unit_bytes(f);
}

/* Block j (of 32 inputs) of a unit: the scales of row r, d[0] for its first 16 inputs and d[1] for the
 * rest (equal but for Q6_K), and m (0 where the format has none). Plain C: the scalar loops and the row
 * decoder use it; the vector loops form the same values 16 rows at a time. */
static inline void packed_scales(int type, const uint8_t *unit, int j, int r, float d[2], float *m) {
    *m = 0.0f;
    switch (type) {
    case QT_Q4_1:
        *m = quant_half(unit + 32 + 2 * r);
        /* fall through */
    case QT_Q8_0: case QT_Q4_0: case QT_Q5_0:
        d[0] = d[1] = quant_half(unit + 2 * r);
        return;
    case QT_Q4_K:
        d[0] = d[1] = quant_half(unit + 2 * r) * (float)unit[64 + 16 * j + r];
        *m = -(quant_half(unit + 32 + 2 * r) * (float)unit[192 + 16 * j + r]);
        return;
    case QT_Q6_K: {
        const float dd = quant_half(unit + 2 * r);
        d[0] = dd * (float)(int8_t)unit[32 + 16 * (2 * j) + r];
        d[1] = dd * (float)(int8_t)unit[32 + 16 * (2 * j + 1) + r];
        return;
    }
    case QT_MXFP4:
        d[0] = d[1] = mxfp4_half(unit[r]);
        return;
    default:
        d[0] = d[1] = 0.0f;
    }
}

/* The u values of row r's 32 inputs in one block's quants `q`. */
static inline void packed_ints(const packed_fmt_t *f, const uint8_t *q, int r, uint8_t u[32]) {
    for (int i = 0; i < 32; ++i) {
        const int kd = i >> 2, at = 4 * r + (i & 3);
        int v;
        if (f->bits == 8) {
            v = q[64 * kd + at];
        } else {
            const uint8_t nib = q[64 * (kd >> 1) + at];
            v = (kd & 1) ? nib >> 4 : nib & 15;
            if (f->bits == 5) {
                uint64_t mask;
                memcpy(&mask, q + 256 + 8 * kd, sizeof mask);
                v |= (int)((mask >> at) & 1u) << 4;
            } else if (f->bits == 6) {
                v |= ((q[256 + 64 * (kd >> 2) + at] >> (2 * (kd & 3))) & 3) << 4;
            }
        }
        u[i] = (uint8_t)(f->lut ? mxfp4_u8[v] : v);
    }
}

#endif
