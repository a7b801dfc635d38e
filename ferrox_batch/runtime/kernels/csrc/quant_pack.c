/* Repacking a GGUF weight's rows into quant_packed.h's layout (once, at load), and decoding rows of the
 * packed layout back to floats (an embedding's lookups, and a check of the packing). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_packed.h"

/* One file block (a unit) of one row: its u values (MXFP4: its codes), in input order, and its head
 * entries for that row written into the packed head at `head` (row r of 16). */
static void unpack_file_unit(int type, const uint8_t *b, uint8_t *u, uint8_t *head, int r) {
    switch (type) {
    case QT_Q8_0:
        memcpy(head + 2 * r, b, 2);
        for (int i = 0; i < 32; ++i) u[i] = (uint8_t)(b[2 + i] ^ 0x80u);
        return;
    case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: {
        const int qs_at = type == QT_Q4_0 ? 2 : type == QT_Q4_1 ? 4 : 6;
        memcpy(head + 2 * r, b, 2);
        if (type == QT_Q4_1) memcpy(head + 32 + 2 * r, b + 2, 2);
        uint32_t qh = 0;
        if (type == QT_Q5_0) memcpy(&qh, b + 2, sizeof qh);
        for (int i = 0; i < 16; ++i) {
            u[i] = (uint8_t)((b[qs_at + i] & 15) | (((qh >> i) & 1u) << 4));
            u[i + 16] = (uint8_t)((b[qs_at + i] >> 4) | (((qh >> (i + 16)) & 1u) << 4));
        }
        return;
    }
    case QT_Q4_K: {
        int sc[8], mn[8];
        q4_k_scales(b + 4, sc, mn);
        memcpy(head + 2 * r, b, 2);
        memcpy(head + 32 + 2 * r, b + 2, 2);
        for (int j = 0; j < 8; ++j) {
            head[64 + 16 * j + r] = (uint8_t)sc[j];
            head[192 + 16 * j + r] = (uint8_t)mn[j];
        }
        for (int g = 0; g < 4; ++g)
            for (int l = 0; l < 32; ++l) {
                u[64 * g + l] = b[16 + 32 * g + l] & 15;
                u[64 * g + 32 + l] = b[16 + 32 * g + l] >> 4;
            }
        return;
    }
    case QT_Q6_K:
        memcpy(head + 2 * r, b + 208, 2);
        for (int s = 0; s < 16; ++s) head[32 + 16 * s + r] = b[192 + s];
        for (int h = 0; h < 2; ++h)
            for (int g = 0; g < 4; ++g)
                for (int l = 0; l < 32; ++l) {
                    const int low = (b[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 15;
                    const int top = (b[128 + 32 * h + l] >> (2 * g)) & 3;
                    u[128 * h + 32 * g + l] = (uint8_t)(low | top << 4);
                }
        return;
    case QT_MXFP4:
        head[r] = b[0];
        for (int i = 0; i < 16; ++i) {
            u[i] = b[1 + i] & 15;
            u[i + 16] = b[1 + i] >> 4;
        }
        return;
    default:
        return;
    }
}

/* Row r's 32 u values `u` into the quants of one block (zeroed before the first row is written). */
static void put_ints(const packed_fmt_t *f, const uint8_t *u, int r, uint8_t *q) {
    for (int i = 0; i < 32; ++i) {
        const int kd = i >> 2, at = 4 * r + (i & 3);
        if (f->bits == 8) {
            q[64 * kd + at] = u[i];
            continue;
        }
        q[64 * (kd >> 1) + at] |= (uint8_t)((u[i] & 15) << (4 * (kd & 1)));
        if (f->bits == 5) {
            uint64_t mask;
            memcpy(&mask, q + 256 + 8 * kd, sizeof mask);
            mask |= (uint64_t)((u[i] >> 4) & 1u) << at;
            memcpy(q + 256 + 8 * kd, &mask, sizeof mask);
        } else if (f->bits == 6) {
            q[256 + 64 * (kd >> 2) + at] |= (uint8_t)(((u[i] >> 4) & 3) << (2 * (kd & 3)));
        }
    }
}

int64_t ferrox_packed_bytes(int type, int64_t rows, int64_t k) {
    packed_fmt_t f;
    if (!packed_fmt(type, &f)) return -2;
    if (rows < 0 || k <= 0 || k % f.unit_k != 0) return -1;
    return (rows + PG - 1) / PG * packed_group_bytes(&f, k);
}

/* `rows` rows of k weights in the file's blocks (`raw`, rows back to back) into `out`, of
 * ferrox_packed_bytes(type, rows, k) bytes. */
int ferrox_packed_pack(int type, const void *raw, int64_t rows, int64_t k, void *out, int threads) {
    packed_fmt_t f;
    if (!packed_fmt(type, &f)) return -2;
    if (rows < 0 || k <= 0 || k % f.unit_k != 0) return -1;
    const int64_t units = k / f.unit_k, unit_bytes = packed_unit_bytes(&f), groups = (rows + PG - 1) / PG;
    const int64_t row_bytes = units * quant_block_bytes(type), group_bytes = units * unit_bytes;
    memset(out, 0, (size_t)(groups * group_bytes));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; ++g) {
        uint8_t u[256];
        for (int64_t t = 0; t < units; ++t) {
            uint8_t *unit = (uint8_t *)out + g * group_bytes + t * unit_bytes;
            for (int r = 0; r < PG && g * PG + r < rows; ++r) {
                const uint8_t *b = (const uint8_t *)raw + (g * PG + r) * row_bytes + t * quant_block_bytes(type);
                unpack_file_unit(type, b, u, unit, r);
                for (int j = 0; j < f.unit_k / 32; ++j) put_ints(&f, u + 32 * j, r, unit + f.head + j * f.qbytes);
            }
        }
    }
    return 0;
}

/* out[i] = row rows[i] of the packed weight, decoded as gguf dequantizes: n rows of k float32, or that
 * rounded to bf16 when `out_bf16`. The indices are not checked here (the caller knows the row count). */
int ferrox_packed_rows(int type, const void *packed, int64_t k, const int64_t *rows, int64_t n, void *out,
                       int out_bf16, int threads) {
    packed_fmt_t f;
    if (!packed_fmt(type, &f)) return -2;
    if (k <= 0 || n < 0 || k % f.unit_k != 0) return -1;
    const int64_t units = k / f.unit_k, unit_bytes = packed_unit_bytes(&f), group_bytes = units * unit_bytes;
#pragma omp parallel for schedule(static) num_threads(n * k >= 65536 ? threads : 1)
    for (int64_t i = 0; i < n; ++i) {
        const int64_t g = rows[i] / PG;
        const int r = (int)(rows[i] % PG);
        uint8_t u[32];
        for (int64_t t = 0; t < units; ++t) {
            const uint8_t *unit = (const uint8_t *)packed + g * group_bytes + t * unit_bytes;
            for (int j = 0; j < f.unit_k / 32; ++j) {
                float d[2], m;
                packed_scales(type, unit, j, r, d, &m);
                packed_ints(&f, unit + f.head + j * f.qbytes, r, u);
                const int64_t at = i * k + t * f.unit_k + 32 * j;
                for (int l = 0; l < 32; ++l) {
                    /* d * (u - o) + m: the product exact, so this is gguf's float32 value bit for bit. */
                    const float w = d[l >> 4] * (float)((int)u[l] - f.zero) + m;
                    if (out_bf16)
                        ((uint16_t *)out)[at + l] = bf16_round(w);
                    else
                        ((float *)out)[at + l] = w;
                }
            }
        }
    }
    return 0;
}
