/* The decoder's layer stack in one call on the CPU, for fp16, bf16 or quantized weights: every layer's norms,
 * projections, RoPE and K/V write, attention and gated MLP, through the same kernels the Python loop calls
 * one by one.
 *
 * A 32-row decode step of the default model makes about 240 kernel calls. Driven from Python each
 * costs its checks, an allocation and the ctypes conversion of its arguments, about 9 ms of a 90 ms step
 * on a 2-core AVX2 EPYC, during which the OpenMP team's other thread waits; at one row, where a step's
 * kernels take a few milliseconds, that Python is most of the step. Here the same calls run in the same
 * order on the same inputs, so the result is the Python loop's bit for bit; what goes is the Python
 * between them. The caller checks everything once per forward (shapes, dtypes, the slots, key ranges and
 * block tables) and hands over buffers it owns.
 *
 * Per layer l (weights[l] holds the addresses of its input norm, q|k|v weight, o weight, post-attention
 * norm, gate|up weight and down weight, then, for quantized weights, the segment counts of the four):
 *   h += pending (from layer 1 on); x = norm(h)          rms_norm.c
 *   qkv = x . Wqkv; RoPE on q and k, K and V to the pool   f16_gemm.c, quant_int8.c or bf16_gemm.c; rope_store.c
 *   attn = decode rows (paged_decode.c, their q copied to `qdec`) | prefill rows (prefill_attention.c)
 *          (without attention sinks: no model whose layers have them runs through the stack)
 *   pending = attn . Wo; h += pending; x = norm(h)
 *   mlp = silu(x . Wgate) * (x . Wup); pending = mlp . Wdown
 *   (where the layer has them: q and k RMS-normed per head right after the projection (rms_norm.c's
 *   ferrox_head_norms), and a mixture of experts in place of the MLP (packed_moe.c: its softmax top-k router
 *   and packed experts, `kind` 1 only))
 * `kind` = 0: fp16 panels as f16_gemm.c lays them out, float32 activations, the gated kernel fused.
 * `kind` = 1: quant_int8.c's packed segments ((type, rows, address) triples at the weight's address),
 * activations float32 or bf16 (`is_bf16`), gate|up written to `gu` and multiplied by silu_mul.c.
 * `kind` = 2: bf16_gemm.c's panels, bf16 activations, gate|up written to `gu` and multiplied by silu_mul.c.
 * On return h is the residual stream before the last layer's MLP output, which is left in `pending`
 * (the caller's final norm adds it, as the Python loop does). The pools (layer l's at pool + l *
 * pool_stride elements) hold `pool_kind` elements (half.h).
 * Returns 0, or -1 when a kernel could not allocate its scratch memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

enum {
    W_INPUT_NORM, W_QKV, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, N_QKV, N_O, N_GATE_UP, N_DOWN,
    /* per-head (or whole-projection) norms of the queries and keys: weight addresses (0: none), spans */
    W_Q_NORM, W_K_NORM, Q_SPAN, K_SPAN,
    /* a mixture of experts in place of the gated MLP: the router's float32 weight (0: a dense layer), the
     * expert count, top k, whether the k weights are renormalised, each expert's intermediate width, and
     * the gate|up and down experts' address and segment-count arrays (packed_moe.c) */
    W_ROUTER, N_EXPERTS, TOP_K, RENORM, MOE_INTER, W_GU_EXPERTS, W_GU_COUNTS, W_DOWN_EXPERTS, W_DOWN_COUNTS,
    W_COLS
};

enum { KIND_F16, KIND_QUANT, KIND_BF16 };

/* y = x . W for the layer's weight in column `at` (its segment count in `count`). */
static int project(int kind, const int64_t *w, int at, int count, const void *x, int is_bf16, int64_t rows,
                   int64_t k, int64_t n, void *y, int threads) {
    if (kind == KIND_QUANT)
        return ferrox_packed_gemm(x, is_bf16, rows, k, (const int64_t *)(intptr_t)w[at], w[count], y, threads);
    if (kind == KIND_BF16)
        return ferrox_bf16_gemm((const uint16_t *)x, rows, k, (const uint32_t *)(intptr_t)w[at], n, y, 0, threads);
    return ferrox_f16_gemm((const float *)x, rows, k, (const uint16_t *)(intptr_t)w[at], n, (float *)y, threads);
}

/* The layer's mixture of experts over x (rows x hidden) into `pending`, in its dtype: the router, then
 * ferrox_packed_moe's float32 sums rounded as `out.to(dtype)` rounds them. */
static int moe_layer(const int64_t *w, const void *x, void *pending, int64_t rows, int64_t hidden, int is_bf16,
                     int threads) {
    const int64_t top_k = w[TOP_K], experts = w[N_EXPERTS];
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(rows * top_k + 1));
    float *weights = (float *)malloc(sizeof(float) * (size_t)(rows * top_k + 1));
    float *sums = is_bf16 ? (float *)malloc(sizeof(float) * (size_t)(rows * hidden + 1)) : (float *)pending;
    int status = ids == NULL || weights == NULL || sums == NULL ? -3 : 0;
    if (status == 0)
        status = ferrox_moe_route(x, is_bf16, rows, hidden, (const float *)(intptr_t)w[W_ROUTER], experts, top_k,
                                  (int)w[RENORM], ids, weights, threads);
    if (status == 0)
        status = ferrox_packed_moe(x, is_bf16, rows, hidden, ids, weights, top_k, experts,
                                   (const int64_t *)(intptr_t)w[W_GU_EXPERTS], (const int64_t *)(intptr_t)w[W_GU_COUNTS],
                                   w[MOE_INTER], (const int64_t *)(intptr_t)w[W_DOWN_EXPERTS],
                                   (const int64_t *)(intptr_t)w[W_DOWN_COUNTS], sums, threads);
    if (status == 0 && is_bf16)
        for (int64_t i = 0; i < rows * hidden; ++i) ((uint16_t *)pending)[i] = bf16_round(sums[i]);
    free(ids);
    free(weights);
    if (is_bf16) free(sums);
    return status;
}

int ferrox_layer_stack(void *h, void *pending, void *x, void *qkv, void *attn, void *qdec, void *mlp, void *gu,
                       int64_t rows, int64_t hidden, int64_t inter, int64_t layers, const int64_t *weights,
                       int kind, int is_bf16, char *pool, int64_t pool_stride, int pool_kind, const void *cos,
                       const void *sin, const int64_t *positions, const int64_t *slots, int64_t heads, int64_t kv,
                       int64_t d, float eps, float scale, int64_t n_dec, const int64_t *tables, int64_t max_blocks,
                       const int64_t *lo, const int64_t *hi, int64_t block_size, const int64_t *plan_slots,
                       const int64_t *plan_chunks, int64_t n_chunks, int64_t window, int threads) {
    const int64_t width = (heads + 2 * kv) * d, q_width = heads * d, g = heads / kv;
    const int64_t elem = pool_kind == 0 ? 4 : 2, act = is_bf16 ? 2 : 4;
    char *qkv_bytes = (char *)qkv, *attn_bytes = (char *)attn;
    int status = 0;
    for (int64_t l = 0; l < layers && status == 0; ++l) {
        const int64_t *w = weights + l * W_COLS;
        void *layer_pool = pool + l * pool_stride * elem;
        status |= ferrox_rms_norm(h, l > 0 ? pending : NULL, (const void *)(intptr_t)w[W_INPUT_NORM], x, rows, hidden,
                                  eps, is_bf16, threads);
        status |= project(kind, w, W_QKV, N_QKV, x, is_bf16, rows, hidden, width, qkv, threads);
        if (w[W_Q_NORM])
            status |= ferrox_head_norms(qkv, rows, width, 0, q_width, w[Q_SPAN], (const void *)(intptr_t)w[W_Q_NORM],
                                        eps, is_bf16, threads);
        if (w[W_K_NORM])
            status |= ferrox_head_norms(qkv, rows, width, q_width, kv * d, w[K_SPAN],
                                        (const void *)(intptr_t)w[W_K_NORM], eps, is_bf16, threads);
        status |= ferrox_rope_store(qkv, cos, sin, positions, slots, layer_pool, rows, heads, kv, d, is_bf16, pool_kind,
                                    threads);
        if (n_dec > 0) {
            for (int64_t r = 0; r < n_dec; ++r)
                memcpy((char *)qdec + r * q_width * act, qkv_bytes + r * width * act, (size_t)(act * q_width));
            status |= ferrox_paged_decode(qdec, layer_pool, tables, max_blocks, lo, hi, attn, n_dec, kv, g, d,
                                          block_size, scale, NULL, is_bf16, pool_kind, threads);
        }
        if (n_chunks > 0)
            status |= ferrox_prefill_attention(qkv_bytes + n_dec * width * act, width, layer_pool, plan_slots,
                                               plan_chunks, n_chunks, attn_bytes + n_dec * q_width * act, kv, g, d,
                                               window, scale, NULL, is_bf16, pool_kind, threads);
        status |= project(kind, w, W_O, N_O, attn, is_bf16, rows, q_width, hidden, pending, threads);
        status |= ferrox_rms_norm(h, pending, (const void *)(intptr_t)w[W_POST_NORM], x, rows, hidden, eps, is_bf16,
                                  threads);
        if (w[W_ROUTER]) {
            status |= moe_layer(w, x, pending, rows, hidden, is_bf16, threads);
            continue;
        }
        if (kind != KIND_F16) {
            status |= project(kind, w, W_GATE_UP, N_GATE_UP, x, is_bf16, rows, hidden, 2 * inter, gu, threads);
            status |= ferrox_silu_mul(gu, mlp, rows, inter, is_bf16, threads);
        } else {
            status |= ferrox_f16_gemm_gated((const float *)x, rows, hidden, (const uint16_t *)(intptr_t)w[W_GATE_UP],
                                            inter, (float *)mlp, threads);
        }
        status |= project(kind, w, W_DOWN, N_DOWN, mlp, is_bf16, rows, inter, hidden, pending, threads);
    }
    return status == 0 ? 0 : -1;
}
