/* The library's entry points, declared once: each kernel's source includes this, so a definition that
 * drifts from its declaration does not compile, and layer_stack.c calls the kernels through it. What
 * each computes and its layouts: the comment at the top of its source. */
#ifndef FERROX_KERNELS_H
#define FERROX_KERNELS_H

#include <stdint.h>

int ferrox_paged_decode(const void *q, const void *pool, const int64_t *tables, int64_t max_blocks,
                        const int64_t *lo, const int64_t *hi, void *out, int64_t n, int64_t kv, int64_t g,
                        int64_t d, int64_t block_size, float scale, const float *sinks, int is_bf16, int pool_kind,
                        int threads);
int ferrox_prefill_attention(const void *q, int64_t q_stride, const void *pool, const int64_t *slots,
                             const int64_t *chunks, int64_t n_chunks, void *out, int64_t kv, int64_t g, int64_t d,
                             int64_t window, float scale, const float *sinks, int is_bf16, int pool_kind,
                             int threads);
int ferrox_rms_norm(void *h, const void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
                    float eps, int is_bf16, int threads);
int ferrox_rope_store(void *qkv, const void *cos, const void *sin, const int64_t *positions, const int64_t *slots,
                      void *pool, int64_t n, int64_t heads, int64_t kv, int64_t d, int is_bf16, int pool_kind,
                      int threads);
int ferrox_f16_gemm_vectorised(void);
int ferrox_f16_gemm(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y, int threads);
int ferrox_f16_gemm_gated(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y,
                          int threads);
int ferrox_quant_supported(int type);
int ferrox_quant_path(void);
int ferrox_quant_gemm(const void *x, int x_bf16, int64_t m, int64_t k, const int64_t *segments, int64_t n_segments,
                      void *y, int threads);
int ferrox_quant_rows(int type, const void *w, int64_t k, const int64_t *rows, int64_t n, void *out, int out_bf16,
                      int threads);
int64_t ferrox_packed_bytes(int type, int64_t rows, int64_t k);
int ferrox_packed_pack(int type, const void *raw, int64_t rows, int64_t k, void *out, int threads);
int ferrox_packed_rows(int type, const void *packed, int64_t k, const int64_t *rows, int64_t n, void *out,
                       int out_bf16, int threads);
int ferrox_packed_path(void);
int ferrox_packed_gemm(const void *x, int x_bf16, int64_t m, int64_t k, const int64_t *segments, int64_t n_segments,
                       void *y, int threads);
int ferrox_packed_gemm_experts(const void *x, int x_bf16, int64_t m, int64_t k, const int64_t *segments,
                               const int64_t *counts, const int64_t *lo, const int64_t *hi, int64_t experts,
                               int64_t n, void *y, int threads);
int ferrox_moe_route(const void *x, int x_bf16, int64_t m, int64_t k, const float *w, int64_t experts,
                     int64_t top_k, int renormalize, int64_t *ids, float *weights, int threads);
int ferrox_packed_moe(const void *x, int x_bf16, int64_t m, int64_t hidden, const int64_t *ids,
                      const float *weights, int64_t top_k, int64_t experts, const int64_t *gate_up,
                      const int64_t *gate_up_counts, int64_t inter, const int64_t *down, const int64_t *down_counts,
                      void *out, int threads);
int ferrox_head_norms(void *x, int64_t rows, int64_t width, int64_t start, int64_t count, int64_t span,
                      const void *weight, float eps, int is_bf16, int threads);
int ferrox_bf16_path(void);
int64_t ferrox_bf16_packed_words(int64_t n, int64_t k);
int ferrox_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint32_t *out, int threads);
int ferrox_bf16_gemm(const uint16_t *x, int64_t m, int64_t k, const uint32_t *w, int64_t n, void *y, int y_f32,
                     int threads);
int ferrox_silu_mul(const void *gu, void *out, int64_t rows, int64_t n, int is_bf16, int threads);
int ferrox_layer_stack(void *h, void *pending, void *x, void *qkv, void *attn, void *qdec, void *mlp, void *gu,
                       int64_t rows, int64_t hidden, int64_t inter, int64_t layers, const int64_t *weights,
                       int kind, int is_bf16, char *pool, int64_t pool_stride, int pool_kind, const void *cos,
                       const void *sin, const int64_t *positions, const int64_t *slots, int64_t heads, int64_t kv,
                       int64_t d, float eps, float scale, int64_t n_dec, const int64_t *tables, int64_t max_blocks,
                       const int64_t *lo, const int64_t *hi, int64_t block_size, const int64_t *plan_slots,
                       const int64_t *plan_chunks, int64_t n_chunks, int64_t window, int threads);

#endif
