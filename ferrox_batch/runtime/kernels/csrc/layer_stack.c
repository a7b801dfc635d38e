/* The decoder's layer stack in one call, for the CPU with fp16 weights: every layer's norms, projections,
 * RoPE and K/V write, attention and gated MLP, through the same kernels the Python loop calls one by one.
 *
 * A 32-row decode step of the default model makes about 240 kernel calls. Driven from Python each
 * costs its checks, an allocation and the ctypes conversion of its arguments, about 9 ms of a 90 ms step
 * on a 2-core AVX2 EPYC, during which the OpenMP team's other thread waits. Here the same calls run in
 * the same order on the same inputs, so the result is the Python loop's bit for bit; what goes is the
 * Python between them. The caller checks everything once per forward (shapes, dtypes, the slots, key
 * ranges and block tables) and hands over buffers it owns.
 *
 * Per layer l (weights[l] holds the addresses of its input norm, q|k|v panels, o panels, post-attention
 * norm, gate|up panels and down panels, in that order; panels as f16_gemm.c lays them out):
 *   h += pending (from layer 1 on); x = norm(h)          rms_norm.c
 *   qkv = x . Wqkv; RoPE on q and k, K and V to the pool   f16_gemm.c, rope_store.c
 *   attn = decode rows (paged_decode.c, their q copied to `qdec`) | prefill rows (prefill_attention.c)
 *   pending = attn . Wo; h += pending; x = norm(h)
 *   mlp = silu(x . Wgate) * (x . Wup); pending = mlp . Wdown
 * On return h is the residual stream before the last layer's MLP output, which is left in `pending`
 * (the caller's final norm adds it, as the Python loop does). Activations are float32; the pools
 * (layer l's at pool + l * pool_stride elements) hold `pool_kind` elements (half.h).
 * Returns 0, or -1 when a kernel could not allocate its scratch memory.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

enum { W_INPUT_NORM, W_QKV, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, W_COLS };

int ferrox_layer_stack(float *h, float *pending, float *x, float *qkv, float *attn, float *qdec, float *mlp,
                       int64_t rows, int64_t hidden, int64_t inter, int64_t layers, const int64_t *weights,
                       char *pool, int64_t pool_stride, int pool_kind, const float *cos, const float *sin,
                       const int64_t *positions, const int64_t *slots, int64_t heads, int64_t kv, int64_t d, float eps,
                       float scale, int64_t n_dec, const int64_t *tables, int64_t max_blocks, const int64_t *lo,
                       const int64_t *hi, int64_t block_size, const int64_t *plan_slots, const int64_t *plan_chunks,
                       int64_t n_chunks, int64_t window, int threads) {
    const int64_t width = (heads + 2 * kv) * d, q_width = heads * d, g = heads / kv;
    const int64_t elem = pool_kind == 0 ? 4 : 2;
    int status = 0;
    for (int64_t l = 0; l < layers && status == 0; ++l) {
        const int64_t *w = weights + l * W_COLS;
        void *layer_pool = pool + l * pool_stride * elem;
        status |= ferrox_rms_norm(h, l > 0 ? pending : NULL, (const void *)(intptr_t)w[W_INPUT_NORM], x, rows, hidden,
                                  eps, 0, threads);
        status |= ferrox_f16_gemm(x, rows, hidden, (const uint16_t *)(intptr_t)w[W_QKV], width, qkv, threads);
        status |= ferrox_rope_store(qkv, cos, sin, positions, slots, layer_pool, rows, heads, kv, d, 0, pool_kind,
                                    threads);
        if (n_dec > 0) {
            for (int64_t r = 0; r < n_dec; ++r) memcpy(qdec + r * q_width, qkv + r * width, sizeof(float) * q_width);
            status |= ferrox_paged_decode(qdec, layer_pool, tables, max_blocks, lo, hi, attn, n_dec, kv, g, d,
                                          block_size, scale, 0, pool_kind, threads);
        }
        if (n_chunks > 0)
            status |= ferrox_prefill_attention(qkv + n_dec * width, width, layer_pool, plan_slots, plan_chunks, n_chunks,
                                               attn + n_dec * q_width, kv, g, d, window, scale, 0, pool_kind, threads);
        status |= ferrox_f16_gemm(attn, rows, q_width, (const uint16_t *)(intptr_t)w[W_O], hidden, pending, threads);
        status |= ferrox_rms_norm(h, pending, (const void *)(intptr_t)w[W_POST_NORM], x, rows, hidden, eps, 0,
                                  threads);
        status |= ferrox_f16_gemm_gated(x, rows, hidden, (const uint16_t *)(intptr_t)w[W_GATE_UP], inter, mlp,
                                        threads);
        status |= ferrox_f16_gemm(mlp, rows, inter, (const uint16_t *)(intptr_t)w[W_DOWN], hidden, pending, threads);
    }
    return status == 0 ? 0 : -1;
}
