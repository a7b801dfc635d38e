/* RMSNorm with an optional residual add first, as the Llama reference computes it:
 *
 *   if residual:  h = h + residual            (in place; rounded to h's type, as torch's add)
 *   out = weight * to_type(h_f32 * rsqrt(mean(h_f32^2) + eps))
 *
 * The product with the weight is rounded once more in bf16, exactly as
 * `weight * hidden.to(bfloat16)` does in the reference. One call replaces the seven or eight
 * small torch kernels of a norm (and the add before it); a decode step runs 61 of them.
 *
 * h, residual, out: [rows, dim]; weight: [dim]; all contiguous, one dtype (float32 or bfloat16).
 * Rows are split over a team of `threads` (torch's intra-op thread count) when there are enough
 * of them. With -ffast-math a row holding an infinity comes out all NaN (the reference gives NaN
 * only there); finite inputs are unaffected.
 * Returns 0, or -1 when scratch memory could not be had (out is then unspecified).
 */
#include "bf16.h"
#include "kernels.h"

/* Row `r` of h (plus that row of residual, added into h in place) normed into row `r` of out; `x` is dim
 * floats of scratch. Rows are `stride` elements apart in h and out (dim apart in residual). */
static void norm_row(void *h, const void *residual, const void *weight, void *out, int64_t r, int64_t stride,
                     int64_t dim, float eps, int is_bf16, float *x) {
    row_f32(h, r * stride, dim, is_bf16, x);
    if (residual != NULL) {
        if (is_bf16) {
            const uint16_t *add = (const uint16_t *)residual + r * dim;
            uint16_t *dst = (uint16_t *)h + r * stride;
            for (int64_t j = 0; j < dim; ++j) {
                dst[j] = bf16_round(x[j] + bf16_load(add + j));
                x[j] = bf16_load(dst + j);
            }
        } else {
            const float *add = (const float *)residual + r * dim;
            float *dst = (float *)h + r * stride;
#pragma omp simd
            for (int64_t j = 0; j < dim; ++j) {
                x[j] += add[j];
                dst[j] = x[j];
            }
        }
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t j = 0; j < dim; ++j) squares += x[j] * x[j];
    const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
    if (is_bf16) {
        const uint16_t *w = (const uint16_t *)weight;
        uint16_t *dst = (uint16_t *)out + r * stride;
        for (int64_t j = 0; j < dim; ++j) {
            const uint16_t normed = bf16_round(x[j] * inv);
            dst[j] = bf16_round(bf16_load(w + j) * bf16_load(&normed));
        }
    } else {
        const float *w = (const float *)weight;
        float *dst = (float *)out + r * stride;
#pragma omp simd
        for (int64_t j = 0; j < dim; ++j) dst[j] = w[j] * (x[j] * inv);
    }
}

int ferrox_rms_norm(void *h, const void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
                    float eps, int is_bf16, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(rows * dim >= 65536 ? threads : 1) reduction(| : failed)
    {
        /* One row of float32 scratch per thread; a thread without it still enters the loop (every
         * thread of the team must) and fails the rows it is handed. */
        float *x = (float *)malloc(sizeof(float) * (size_t)(dim > 0 ? dim : 1));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            if (x == NULL) {
                failed = 1;
                continue;
            }
            norm_row(h, residual, weight, out, r, dim, dim, eps, is_bf16, x);
        }
        free(x);
    }
    return failed ? -1 : 0;
}

/* Per-head norms in place: in each of `rows` rows of `width` elements, the `count` elements from `start`,
 * as runs of `span` (a head, or all of them), each normed by the same `weight` of `span` values: what
 * ferrox_rms_norm gives each run as a row of its own. Returns -1 for a count that is not whole runs or a
 * range outside the row, or when scratch memory could not be had. */
int ferrox_head_norms(void *x, int64_t rows, int64_t width, int64_t start, int64_t count, int64_t span,
                      const void *weight, float eps, int is_bf16, int threads) {
    if (rows < 0 || span <= 0 || count < 0 || count % span != 0 || start < 0 || start + count > width) return -1;
    const int64_t runs = count / span, total = rows * runs;
    const int64_t elem = is_bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(rows * count >= 65536 ? threads : 1) reduction(| : failed)
    {
        float *scratch = (float *)malloc(sizeof(float) * (size_t)span);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < total; ++t) {
            if (scratch == NULL) {
                failed = 1;
                continue;
            }
            char *run = (char *)x + ((t / runs) * width + start + (t % runs) * span) * elem;
            norm_row(run, NULL, weight, run, 0, span, span, eps, is_bf16, scratch);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
