/* The gated MLP's activation for a projection that wrote gate and up side by side: out[r][j] =
 * silu(gu[r][j]) * gu[r][n + j], float32 or bf16 in and out (bf16 widened exactly, the product rounded to
 * nearest even once). silu(g) = g / (1 + exp(-g)), torch's formula, with exp's argument held at 88 as
 * f16_gemm.c's gated kernel holds it (-ffast-math's vector expf is not defined past its range).
 * The quantized layers' gated projection calls it from Python and the layer stack from C, so the two
 * agree bit for bit. */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "bf16.h"
#include "kernels.h"

int ferrox_silu_mul(const void *gu, void *out, int64_t rows, int64_t n, int is_bf16, int threads) {
    if (rows < 0 || n < 0) return -1;
#pragma omp parallel for schedule(static) num_threads(rows * n >= 65536 ? threads : 1)
    for (int64_t r = 0; r < rows; ++r) {
        if (is_bf16) {
            const uint16_t *g = (const uint16_t *)gu + r * 2 * n, *u = g + n;
            uint16_t *o = (uint16_t *)out + r * n;
            for (int64_t j = 0; j < n; ++j) {
                const float gj = bf16_load(g + j);
                o[j] = bf16_round(gj / (1.0f + expf(fminf(-gj, 88.0f))) * bf16_load(u + j));
            }
        } else {
            const float *g = (const float *)gu + r * 2 * n, *u = g + n;
            float *o = (float *)out + r * n;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) o[j] = g[j] / (1.0f + expf(fminf(-g[j], 88.0f))) * u[j];
        }
    }
    return 0;
}
