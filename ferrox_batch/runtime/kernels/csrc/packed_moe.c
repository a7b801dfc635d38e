/* A mixture of experts' routed half in C, for the int8 kernel's packed experts: the router
 * (`ferrox_moe_route`) and everything after it (`ferrox_packed_moe`), so neither a Python layer loop nor
 * the C layer stack pays a dozen small torch ops per layer for it.
 *
 * ferrox_moe_route: softmax top-k routing (with or without renormalising the k weights), each row from its
 *   own float32 logits: logit[e] = sum over j of x[j] * w[e][j], summed in 16 lanes (lane l takes the
 *   inputs j = l mod 16, in order) that are then added in a fixed tree; the softmax of a row's logits
 *   (its max subtracted, expf, the sum in expert order); the k largest scores, the lowest id first on a tie;
 *   renormalised by their sum in that order. Each row's result depends on that row alone, whatever the
 *   batch and the thread count. -ffp-contract=off keeps every product and sum its own rounding.
 *
 * ferrox_packed_moe: the (row, expert) pairs sorted by expert (stable: by row within an expert); each
 *   pair's row gathered; every expert's gate|up in one ferrox_packed_gemm_experts call; silu_mul; every
 *   down in one call; then each row's outputs as torch's `index_add_` of the weighted results gives them:
 *   per pair in the sorted order, out[row] += result * weight (the product rounded, then the sum), from
 *   zero, in float32 (`out` is float32 [m][hidden] whatever x's dtype). What the Python loop did with those calls, bit for bit,
 *   without the Python. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define LANES 16

static float row_logit(const float *x, const float *w, int64_t k) {
    float lane[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= k; j += LANES)
        for (int l = 0; l < LANES; ++l) lane[l] += x[j + l] * w[j + l];
    for (int l = 0; j + l < k; ++l) lane[l] += x[j + l] * w[j + l];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
    return lane[0];
}

int ferrox_moe_route(const void *x, int x_bf16, int64_t m, int64_t k, const float *w, int64_t experts,
                     int64_t top_k, int renormalize, int64_t *ids, float *weights, int threads) {
    if (m < 0 || k <= 0 || experts <= 0 || top_k <= 0 || top_k > experts) return -1;
    int failed = 0;
#pragma omp parallel num_threads(m * experts * k >= (1 << 18) ? threads : 1) reduction(| : failed)
    {
        float *xr = (float *)malloc(sizeof(float) * (size_t)k);
        float *p = (float *)malloc(sizeof(float) * (size_t)experts);
        unsigned char *taken = (unsigned char *)malloc((size_t)experts);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r) {
            if (xr == NULL || p == NULL || taken == NULL) {
                failed = 1;
                continue;
            }
            row_f32(x, r * k, k, x_bf16, xr);
            for (int64_t e = 0; e < experts; ++e) p[e] = row_logit(xr, w + e * k, k);
            float top = p[0];
            for (int64_t e = 1; e < experts; ++e) top = p[e] > top ? p[e] : top;
            float sum = 0.0f;
            for (int64_t e = 0; e < experts; ++e) {
                p[e] = expf(p[e] - top);
                sum += p[e];
            }
            for (int64_t e = 0; e < experts; ++e) {
                p[e] = p[e] / sum;
                taken[e] = 0;
            }
            float chosen = 0.0f;
            for (int64_t i = 0; i < top_k; ++i) {
                int64_t best = -1;
                for (int64_t e = 0; e < experts; ++e)
                    if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
                taken[best] = 1;
                ids[r * top_k + i] = best;
                weights[r * top_k + i] = p[best];
                chosen += p[best];
            }
            if (renormalize)
                for (int64_t i = 0; i < top_k; ++i) weights[r * top_k + i] = weights[r * top_k + i] / chosen;
        }
        free(xr);
        free(p);
        free(taken);
    }
    return failed ? -3 : 0;
}

int ferrox_packed_moe(const void *x, int x_bf16, int64_t m, int64_t hidden, const int64_t *ids,
                      const float *weights, int64_t top_k, int64_t experts, const int64_t *gate_up,
                      const int64_t *gate_up_counts, int64_t inter, const int64_t *down, const int64_t *down_counts,
                      void *out, int threads) {
    if (m < 0 || hidden <= 0 || top_k <= 0 || experts <= 0 || inter <= 0) return -1;
    const int64_t pairs = m * top_k, act = x_bf16 ? 2 : 4;
    for (int64_t p = 0; p < pairs; ++p)
        if (ids[p] < 0 || ids[p] >= experts) return -1;
    int64_t *lo = (int64_t *)calloc((size_t)experts, sizeof(int64_t));
    int64_t *hi = (int64_t *)calloc((size_t)experts, sizeof(int64_t));
    int64_t *source = (int64_t *)malloc(sizeof(int64_t) * (size_t)(pairs > 0 ? pairs : 1));
    float *scale = (float *)malloc(sizeof(float) * (size_t)(pairs > 0 ? pairs : 1));
    char *gathered = (char *)malloc((size_t)(act * (pairs > 0 ? pairs : 1) * hidden));
    char *gu = (char *)malloc((size_t)(act * (pairs > 0 ? pairs : 1) * 2 * inter));
    char *h = (char *)malloc((size_t)(act * (pairs > 0 ? pairs : 1) * inter));
    char *res = (char *)malloc((size_t)(act * (pairs > 0 ? pairs : 1) * hidden));
    float *sum = (float *)out;
    int status = lo == NULL || hi == NULL || source == NULL || scale == NULL || gathered == NULL || gu == NULL
                 || h == NULL || res == NULL ? -3 : 0;
    if (status == 0) memset(sum, 0, sizeof(float) * (size_t)(m * hidden));
    if (status == 0 && pairs > 0) {
        /* A counting sort: each expert's pairs in row order, as a stable sort of the flat ids gives them. */
        for (int64_t p = 0; p < pairs; ++p) ++hi[ids[p]];
        int64_t at = 0;
        for (int64_t e = 0; e < experts; ++e) {
            lo[e] = at;
            at += hi[e];
            hi[e] = lo[e];
        }
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t slot = hi[ids[p]]++;
            source[slot] = p / top_k;
            scale[slot] = weights[p];
        }
        for (int64_t s = 0; s < pairs; ++s)
            memcpy(gathered + s * hidden * act, (const char *)x + source[s] * hidden * act, (size_t)(hidden * act));
        status = ferrox_packed_gemm_experts(gathered, x_bf16, pairs, hidden, gate_up, gate_up_counts, lo, hi, experts,
                                            2 * inter, gu, threads);
        if (status == 0) status = ferrox_silu_mul(gu, h, pairs, inter, x_bf16, threads);
        if (status == 0)
            status = ferrox_packed_gemm_experts(h, x_bf16, pairs, inter, down, down_counts, lo, hi, experts, hidden,
                                                res, threads);
    }
    if (status == 0 && pairs > 0) {
        /* Columns split over the team; within a column, the pairs in their sorted order. */
#pragma omp parallel for schedule(static) num_threads(pairs * hidden >= 65536 ? threads : 1)
        for (int64_t c0 = 0; c0 < hidden; c0 += 64) {
            const int64_t c1 = c0 + 64 < hidden ? c0 + 64 : hidden;
            for (int64_t s = 0; s < pairs; ++s) {
                float *dst = sum + source[s] * hidden;
                if (x_bf16) {
                    const uint16_t *r = (const uint16_t *)res + s * hidden;
                    for (int64_t c = c0; c < c1; ++c) {
                        const float weighted = bf16_load(r + c) * scale[s];
                        dst[c] = dst[c] + weighted;
                    }
                } else {
                    const float *r = (const float *)res + s * hidden;
                    for (int64_t c = c0; c < c1; ++c) {
                        const float weighted = r[c] * scale[s];
                        dst[c] = dst[c] + weighted;
                    }
                }
            }
        }
    }
    free(lo);
    free(hi);
    free(source);
    free(scale);
    free(gathered);
    free(gu);
    free(h);
    free(res);
    return status;
}
