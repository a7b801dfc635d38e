"""The CPU kernels in `csrc/`: their typed, checked entry points.

The hot spots of a CPU step where torch's generic kernels fall short:

* paged decode attention (`csrc/paged_decode.c`): torch gathers every
  sequence's paged context into a contiguous tensor and then runs SDPA over
  it, reading each K/V byte, writing it and reading it again. The kernel reads
  K and V straight from the pool through the block tables, once, one sequence
  per task so each pass streams whole slots (one sequence and KV head per task
  when the sequences are too few to fill the team: a single stream). Inside the real model's decode
  step (bf16, batch 32, contexts of 70-260, 2 threads): 0.47 ms per layer,
  and the whole step 56 ms against 67-73 ms with gather + SDPA. On x86 with
  AVX2 it is register-blocked: up to three query heads of a KV head are scored
  against 4 slots at once and their values accumulated in registers across the
  whole sequence, with each slot prefetched ahead: 1.4x its earlier 8-slot form
  per 32-row step from DRAM on an fp16 pool (2-core AVX2 EPYC, 32 sequences x
  142 positions, `scripts/bench_decode_attention.py`). The pool may be stored narrower
  than the queries (fp16 or bf16 under float32), widened exactly on load;
  from DRAM an fp16 pool measured 0.98-1.47x the float32 one over three runs
  (`scripts/bench_decode_attention.py`), within this machine's noise; inside
  the decoder's 32-row step, fp16 K/V cut the kernel's time by about a fifth,
  and the `fp16w` precision stores them so (`runtime.device.choose_kv_dtype`).
* prefill attention (`csrc/prefill_attention.c`): torch gathers, widens and
  runs SDPA once per prompt chunk and layer, which for the chunks of a burst
  (tens to a few hundred rows) costs several times the arithmetic. The kernel
  takes every chunk of a forward in one call (`prefill_plan`): each chunk's
  K/V is widened once into float32 scratch, keys transposed, and tasks of 4
  rows x one KV head score all their query heads against 16 keys at a time
  in registers. 1.6-3.4x the torch path per layer on the default model's
  prefill groups, and shape (a)'s prefill attention 0.71-0.80 s -> 0.33-0.36 s
  in process (`scripts/bench_prefill_attention.py`, 2-core AVX2 EPYC).
* RMSNorm with the residual add before it (`csrc/rms_norm.c`): one call
  instead of the seven or eight small kernels the reference formula takes;
  a decode step runs 61 norms.
* RoPE and the K/V write (`csrc/rope_store.c`): one pass over the fused QKV
  projection rotates q and k in place and writes K and V into the pool at
  their slots, rounded to the pool's dtype, instead of torch's slices,
  concatenation, products, stack, cast and `index_copy_` (about ten small
  kernels a layer, most too small for torch to split over threads): 2.9-5.3x
  torch's ops per layer of the default model at 32 and 1,024 rows
  (`scripts/bench_rope_store.py`, 2-core AVX2 EPYC).
* linear layers with fp16 weights (`csrc/f16_gemm.c`): the weight stored in
  fp16 panels of 8 output columns and widened in registers, float32
  arithmetic, each thread sweeping its rows past one slice of its own columns
  at a time. A forward's linears of the default model measured 1.07-1.20x
  fbgemm's fp16 GEMM at 32-1,024 rows and 0.99-1.24x at one row
  (`scripts/bench_weight_formats.py`, 2-core AVX2 EPYC): fbgemm repacks
  every 6-row slice of the input in each thread and streams the weight past
  each slice. A gated variant computes the MLP's `silu(gate) * up` in the
  same pass (`runtime.architectures.gate_up`), so the `[rows, 2n]` projection is never
  written out.
* linear layers and embedding rows with weights in GGUF's quantized blocks
  (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K, as the file stores them), two ways:
  `pack_quant` repacks a weight once for integer dot products and multiplies
  with x quantized per 32-block to int8 (`csrc/quant_int8.c`, the layers'
  default: each row's result depends on that row alone, and the three paths
  give the same bits); `bind_quant_linear` keeps the file's blocks and decodes
  4 weight rows at a time into float32 in a scratch of its own, once per call,
  sweeping every input row past them (`csrc/quant_gemm.c`, the weight-only
  kernel: the widened weights' product up to summation order). On a 2-core
  Emerald Rapids VM the int8 kernel ran the 1B-shaped model's projections
  2.6-6.8x the weight-only kernel's speed at one row and 1.3-2.1x at 512
  (`scripts/bench_quant_gemm.py`). `quant_rows` decodes only the rows a
  forward's tokens name.
* linear layers with bf16 weights and activations (`csrc/bf16_gemm.c`,
  `pack_bf16`): oneDNN's bf16 GEMM orders each output's sum by the batch's
  row count, so a request's logits change with the batch it shares; this one
  sums each output in one fixed order (`vdpbf16ps` where the CPU has it, the
  same steps as FMAs elsewhere, the same bits), so each row's result depends
  on that row alone. A decode step's projections of the default model ran
  0.91-1.15x oneDNN's at 1-256 rows on a 2-core Zen 4 EPYC (faster at one
  row; `scripts/bench_bf16_gemm.py`).

They are built once per process by `kernel_build` (the system's GCC, flags
for the CPU that runs them, nothing cached); `cpu_kernels()` returns None
when they cannot be, and the decoder then keeps torch's ops (the two paths
agree to float rounding, tested). They run on the calling thread's OpenMP
team, and ctypes drops the GIL for each call. One more entry point,
`csrc/layer_stack.c`, runs the decoder's whole layer loop over these kernels
in one call (`runtime.architectures.layer_stack` checks its inputs).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from ferrox_batch.runtime.kernels.kernel_build import build_library
from ferrox_batch.runtime.kernels.packed_gemm import (
    F16_PANEL,
    PackedF16Gemm,
    pack_f16_gated,
    pack_f16_panels,
    slice_panels,
)
from ferrox_batch.runtime.kernels.packed_bf16 import Bf16Library, PackedBf16
from ferrox_batch.runtime.kernels.packed_moe import route_softmax
from ferrox_batch.runtime.kernels.packed_quant import PackedLibrary, PackedQuant
from ferrox_batch.runtime.kernels.quant_gemm import QuantGemm, check_status
from ferrox_batch.runtime.kv.prefill_plan import PrefillPlan
from ferrox_batch.runtime.quant.formats import BY_GGML_TYPE, QuantFormat

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: What the kernels' pools may hold (their `pool_kind`, csrc/half.h): the activation dtypes, or fp16.
POOL_KINDS = {**_DTYPES, torch.float16: 2}
#: `ferrox_quant_path()`'s answer: which loops the quantized kernel was built with (csrc/quant_gemm.c).
QUANT_PATHS = ("scalar", "avx2", "avx512")


class CpuKernels:
    """Typed, checked entry points into the compiled library (CPU tensors only)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self._decode = library.ferrox_paged_decode
        self._decode.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr, i32, i32, i32]
        self._decode.restype = i32
        self._norm = library.ferrox_rms_norm
        self._norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32, i32, i32]
        self._norm.restype = i32
        self._rope_store = library.ferrox_rope_store
        self._rope_store.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32, i32]
        self._rope_store.restype = i32
        self._prefill = library.ferrox_prefill_attention
        self._prefill.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, f32, ptr, i32, i32, i32]
        self._prefill.restype = i32
        self._layer_stack = library.ferrox_layer_stack
        self._layer_stack.argtypes = [ptr] * 8 + [i64] * 4 + [ptr, i32, i32, ptr, i64, i32] + [ptr] * 4 + [i64] * 3 \
            + [f32, f32] + [i64, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, i64, i32]
        self._layer_stack.restype = i32
        self._silu_mul = library.ferrox_silu_mul
        self._silu_mul.argtypes = [ptr, ptr, i64, i64, i32, i32]
        self._silu_mul.restype = i32
        self._f16_gemm = library.ferrox_f16_gemm
        self._f16_gemm.argtypes = [ptr, i64, i64, ptr, i64, ptr, i32]
        self._f16_gemm.restype = i32
        self._f16_gemm_gated = library.ferrox_f16_gemm_gated
        self._f16_gemm_gated.argtypes = [ptr, i64, i64, ptr, i64, ptr, i32]
        self._f16_gemm_gated.restype = i32
        #: Whether the fp16-weight linear was built with AVX2, FMA and F16C (else scalar: correct, slow).
        self.f16_gemm_vectorised = bool(library.ferrox_f16_gemm_vectorised())
        self._head_norms = library.ferrox_head_norms
        self._head_norms.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, f32, i32, i32]
        self._head_norms.restype = i32
        self._packed = PackedLibrary(library)

        #: The int8 kernel's loops (`packed_quant.PACKED_PATHS`).
        self.packed_path = self._packed.path
        self._bf16 = Bf16Library(library)
        #: The bf16 kernel's loops (`packed_bf16.BF16_PATHS`).
        self.bf16_path = self._bf16.path
        self._quant_gemm = library.ferrox_quant_gemm
        self._quant_gemm.argtypes = [ptr, i32, i64, i64, ptr, i64, ptr, i32]
        self._quant_gemm.restype = i32
        self._quant_rows = library.ferrox_quant_rows
        self._quant_rows.argtypes = [i32, ptr, i64, ptr, i64, ptr, i32, i32]
        self._quant_rows.restype = i32
        #: The quantized kernel's loops: "scalar", "avx2" or "avx512" (float32 FMAs, bf16 activations widened).
        self.quant_path = QUANT_PATHS[library.ferrox_quant_path()]
        self._library = library  # keeps the mapping alive as long as the kernels

    @property
    def layer_stack_entry(self) -> ctypes._CFuncPtr:
        """`ferrox_layer_stack` (`csrc/layer_stack.c`), called only through `runtime.architectures.layer_stack`, which
        checks what it reads."""
        return self._layer_stack

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def paged_decode(
        self,
        q: torch.Tensor,
        pool: torch.Tensor,
        tables: torch.Tensor,
        lo: torch.Tensor,
        hi: torch.Tensor,
        block_size: int,
        scale: float,
        *,
        ranges_checked: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one new token per sequence over its paged context.

        q `[n, kv, g, d]` (float32 or bfloat16; the result is the same) and pool `[slots, 2, kv, d]`
        (float32, bfloat16 or float16: a KV cache may be stored narrower than q); tables `[n, max_blocks]`,
        lo and hi `[n]` int64. Sequence i attends to positions `lo[i] .. hi[i] - 1` through its
        table. The kernel reads the pool unchecked, so the ranges and block ids are checked
        here (`check_decode_ranges`) unless the caller already did (`ranges_checked`: the
        decoder checks once per forward, not once per layer).

        `sinks` `[kv * g]` (float32, contiguous, CPU; query head `h * g + j` of q's `[kv, g]`): each head's
        learned sink logit (gpt-oss), which joins its softmax's max and denominator with no value, so
        out = sum_t exp(s_t - m) v_t / (exp(sink - m) + sum_t exp(s_t - m)). None: no sink, the same bits as
        without the argument. A sequence with no keys still gets zeros.
        """
        n, kv, g, d = q.shape
        _check_dtypes("paged decode", q)
        sinks_at = _sinks_address("paged decode", sinks, kv * g)
        if pool.dtype not in POOL_KINDS:
            raise ValueError(f"paged decode needs a pool in one of {list(POOL_KINDS)}; got {pool.dtype}")
        if pool.dim() != 4 or pool.shape[1:] != (2, kv, d):
            raise ValueError(f"pool is {tuple(pool.shape)}, expected [slots, 2, {kv}, {d}]")
        for name, t in (("tables", tables), ("lo", lo), ("hi", hi)):
            if t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int64 CPU tensor")
        if tables.dim() != 2 or tables.shape[0] != n or lo.shape != (n,) or hi.shape != (n,):
            raise ValueError(f"tables {tuple(tables.shape)}, lo {tuple(lo.shape)}, hi {tuple(hi.shape)} "
                             f"do not match {n} sequences")
        if block_size < 1 or pool.shape[0] % block_size:
            raise ValueError(f"a pool of {pool.shape[0]} slots is not whole blocks of {block_size}")
        if not ranges_checked:
            self.check_decode_ranges(tables, lo, hi, block_size, pool.shape[0] // block_size)
        q = q.contiguous()
        _check_cpu_contiguous(q, pool)
        out = torch.empty_like(q)
        status = self._decode(q.data_ptr(), pool.data_ptr(), tables.data_ptr(), tables.shape[1], lo.data_ptr(),
                              hi.data_ptr(), out.data_ptr(), n, kv, g, d, block_size, scale, sinks_at,
                              _DTYPES[q.dtype], POOL_KINDS[pool.dtype], torch.get_num_threads())
        if status != 0:
            raise MemoryError("paged decode attention could not allocate its scratch memory")
        return out

    def prefill_attention(self, q: torch.Tensor, pool: torch.Tensor, plan: PrefillPlan, scale: float,
                          window: int | None, *, plan_checked: bool = False,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of a forward's prompt chunks over their paged contexts, `[rows, heads * d]`.

        q `[rows, heads, d]` (float32 or bfloat16; rows may be strided, as in the fused projection), the
        chunks' rows in plan order; pool as `paged_decode`'s. Row i of a chunk that starts at position s
        attends to positions up to s + i, and with a `window` only the last `window` of them. The plan's
        slots are checked against the pool here unless the caller already did (`plan_checked`). `sinks`
        `[heads]`: each query head's sink logit, as `paged_decode`'s.
        """
        rows, heads, d = q.shape
        _check_dtypes("prefill attention", q)
        sinks_at = _sinks_address("prefill attention", sinks, heads)
        if pool.dtype not in POOL_KINDS:
            raise ValueError(f"prefill attention needs a pool in one of {list(POOL_KINDS)}; got {pool.dtype}")
        if pool.dim() != 4 or pool.shape[1] != 2 or pool.shape[3] != d or heads % pool.shape[2]:
            raise ValueError(f"pool is {tuple(pool.shape)}, expected [slots, 2, kv, {d}] with kv dividing {heads}")
        if rows != plan.rows:
            raise ValueError(f"{rows} query rows for a plan of {plan.rows}")
        if window is not None and window < 1:
            raise ValueError(f"a sliding window holds at least one position; got {window}")
        if not plan_checked:
            plan.check(pool.shape[0])
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        _check_cpu_contiguous(pool)
        if not q.is_cpu:
            raise ValueError("the CPU kernels take contiguous CPU tensors")
        kv = pool.shape[2]
        out = torch.empty(rows, heads * d, dtype=q.dtype)
        status = self._prefill(q.data_ptr(), q.stride(0), pool.data_ptr(), plan.slots.data_ptr(),
                               plan.chunks.data_ptr(), plan.chunks.shape[0], out.data_ptr(), kv, heads // kv, d,
                               window or 0, scale, sinks_at, _DTYPES[q.dtype], POOL_KINDS[pool.dtype],
                               torch.get_num_threads())
        if status != 0:
            raise MemoryError("prefill attention could not allocate its scratch memory")
        return out

    @staticmethod
    def check_decode_ranges(tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, block_size: int,
                            num_blocks: int) -> None:
        """Raise unless every key range lies inside its table and every block id a range reads inside the
        pool. Entries outside the ranges are never read, and may hold anything: the pages a sliding lease
        gave back behind its window are negative (`runtime.kv.sliding.RELEASED`), padding is 0."""
        if lo.numel() == 0:
            return
        width = tables.shape[1] * block_size
        if int(lo.min()) < 0 or bool((hi < lo).any()) or int(hi.max()) > width:
            raise ValueError(f"a key range is outside its block table ({width} positions)")
        pages = torch.arange(tables.shape[1])[None, :]
        read = (pages >= (lo // block_size)[:, None]) & (pages * block_size < hi[:, None])
        if bool(read.any()):
            blocks = tables[read]
            if int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks:
                raise ValueError(f"a block table points outside the KV pool of {num_blocks} blocks")

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, pool: torch.Tensor, heads: int, *, checked: bool = False) -> None:
        """RoPE on the q and k heads of `qkv` `[n, (heads + 2 kv) * d]` *in place* (tables `[P, d]` indexed
        by `positions`), then K and V written to `pool` `[slots, 2, kv, d]` at `slots`, rounded to the
        pool's dtype (float32, bfloat16 or float16). The kernel reads the tables and writes the pool
        unchecked, so the positions and slots are checked here (`check_rope_store`) unless the caller
        already did (`checked`: the decoder checks once per forward, not once per layer)."""
        n = qkv.shape[0]
        _check_dtypes("rope store", qkv, cos, sin)
        if pool.dtype not in POOL_KINDS:
            raise ValueError(f"rope store needs a pool in one of {list(POOL_KINDS)}; got {pool.dtype}")
        if pool.dim() != 4 or pool.shape[1] != 2:
            raise ValueError(f"pool is {tuple(pool.shape)}, expected [slots, 2, kv, d]")
        kv, d = pool.shape[2], pool.shape[3]
        if heads < 1 or kv < 1 or d < 2:
            raise ValueError(f"rope store needs at least one query head and one KV head of size 2 or more; got "
                             f"{heads} query heads and a pool of {tuple(pool.shape)}")
        if qkv.dim() != 2 or qkv.shape[1] != (heads + 2 * kv) * d or d % 2:
            raise ValueError(f"qkv is {tuple(qkv.shape)}, expected [n, {(heads + 2 * kv) * d}] for {heads} query "
                             f"heads and {kv} KV heads of an even size {d}")
        if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != d:
            raise ValueError(f"rope tables {tuple(cos.shape)} and {tuple(sin.shape)}, expected [positions, {d}]")
        for name, t in (("positions", positions), ("slots", slots)):
            if t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous() or t.shape != (n,):
                raise ValueError(f"{name} must be a contiguous int64 CPU tensor of {n}")
        if not checked:
            self.check_rope_store(positions, slots, cos.shape[0], pool.shape[0])
        _check_cpu_contiguous(qkv, cos, sin, pool)
        status = self._rope_store(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                                  slots.data_ptr(), pool.data_ptr(), n, heads, kv, d, _DTYPES[qkv.dtype],
                                  POOL_KINDS[pool.dtype], torch.get_num_threads())
        if status != 0:
            raise MemoryError("rope store could not allocate its scratch memory")

    @staticmethod
    def check_rope_store(positions: torch.Tensor, slots: torch.Tensor, num_positions: int, num_slots: int) -> None:
        """Raise unless every position indexes the rope tables and every slot the pool, each slot once
        (rows are written by different threads: two rows on one slot would mix)."""
        if positions.numel() == 0:
            return
        if int(positions.min()) < 0 or int(positions.max()) >= num_positions:
            raise ValueError(f"a position is outside the rope tables' {num_positions}")
        if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
            raise ValueError(f"a slot is outside the KV pool's {num_slots}")
        if slots.unique().numel() != slots.numel():
            raise ValueError("two rows would write the same KV slot")

    def rms_norm(self, h: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """`weight * norm(h)`, after `h += residual` *in place* when a residual is given."""
        rows, dim = h.shape
        _check_dtypes("rms norm", h, weight, *([] if residual is None else [residual]))
        if weight.shape != (dim,) or (residual is not None and residual.shape != h.shape):
            raise ValueError(f"rms norm of {tuple(h.shape)}: weight {tuple(weight.shape)}"
                             + ("" if residual is None else f", residual {tuple(residual.shape)}"))
        if residual is not None:
            residual = residual.contiguous()
        _check_cpu_contiguous(h, weight, *([] if residual is None else [residual]))
        out = torch.empty_like(h)
        status = self._norm(h.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                            out.data_ptr(), rows, dim, eps, _DTYPES[h.dtype], torch.get_num_threads())
        if status != 0:
            raise MemoryError("rms norm could not allocate its scratch memory")
        return out

    def head_norms(self, qkv: torch.Tensor, start: int, count: int, span: int, weight: torch.Tensor,
                   eps: float) -> None:
        """RMSNorm in place, in each row of `qkv` `[rows, width]`, the `count` values from `start` as runs of
        `span` (a head, or all of them), each by `weight` `[span]`: each run exactly as `rms_norm` norms a
        row of its own."""
        _check_dtypes("head norms", qkv, weight)
        _check_cpu_contiguous(qkv, weight)
        if qkv.dim() != 2 or weight.shape != (span,):
            raise ValueError(f"head norms of {tuple(qkv.shape)} by a weight {tuple(weight.shape)} over runs of {span}")
        status = self._head_norms(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], start, count, span, weight.data_ptr(),
                                  eps, _DTYPES[qkv.dtype], torch.get_num_threads())
        if status != 0:
            raise ValueError(f"head norms: {count} values from {start} in rows of {qkv.shape[1]} are not runs of "
                             f"{span} within the row (or no scratch memory)")

    def moe_route(self, x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A softmax top-k router's `(weights, ids)` for x's rows, in C (`packed_moe.route_softmax`)."""
        return route_softmax(self._packed, x, router_weight, top_k, renormalize)

    #: The packings `f16_linear` and `f16_gated_linear` read (`packed_gemm`).
    pack_f16_panels = staticmethod(pack_f16_panels)
    pack_f16_gated = staticmethod(pack_f16_gated)

    def f16_linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
        """`x @ w.T` for float32 `x` `[..., k]` and a weight packed by `pack_f16_panels` (its `n` is
        `out_features`), accumulated in float32 in the order of k."""
        return self.bind_f16_linear(panels, out_features)(x)

    def f16_gated_linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
        """`silu(x @ gate.T) * (x @ up.T)` for a weight packed by `pack_f16_gated` (`out_features` = n,
        the rows of each half): each half summed as `f16_linear` sums, the product formed in registers."""
        return self.bind_f16_gated_linear(panels, out_features)(x)

    def bind_f16_linear(self, panels: torch.Tensor, out_features: int) -> PackedF16Gemm:
        """`f16_linear` bound to one packed weight, checked now rather than on every call (`packed_gemm`)."""
        return PackedF16Gemm(self._f16_gemm, panels, out_features, -(-out_features // F16_PANEL))

    def bind_f16_gated_linear(self, panels: torch.Tensor, out_features: int) -> PackedF16Gemm:
        """`f16_gated_linear` bound to one packed weight, as `bind_f16_linear`."""
        return PackedF16Gemm(self._f16_gemm_gated, panels, out_features, 2 * slice_panels(out_features))

    def bind_quant_linear(self, segments: Sequence[tuple[QuantFormat, torch.Tensor]], in_features: int) -> QuantGemm:
        """`x @ w.T` for a weight of `in_features` inputs kept in quantized blocks: `segments` are `(format,
        [rows, format.row_bytes(in_features)] uint8)` pairs stacked in order along the outputs (a fused
        projection may mix formats). Checked now, once; each call checks only its input (`quant_gemm`)."""
        return QuantGemm(self._quant_gemm, segments, in_features)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of a `[rows, 2n]` projection holding gate then up (float32 or bf16, contiguous,
        CPU): `[rows, n]` in its dtype, the product rounded once (`csrc/silu_mul.c`, what the layer stack
        runs for quantized projections)."""
        _check_dtypes("silu_mul", gu)
        _check_cpu_contiguous(gu)
        if gu.dim() != 2 or gu.shape[1] % 2:
            raise ValueError(f"silu_mul takes [rows, 2n] gate then up; got {tuple(gu.shape)}")
        rows, n = gu.shape[0], gu.shape[1] // 2
        out = torch.empty(rows, n, dtype=gu.dtype)
        if self._silu_mul(gu.data_ptr(), out.data_ptr(), rows, n, _DTYPES[gu.dtype], torch.get_num_threads()) != 0:
            raise ValueError("silu_mul: negative sizes")
        return out

    def pack_bf16(self, weight: torch.Tensor) -> PackedBf16:
        """An `[n, k]` weight (rounded to bf16) packed for the batch-invariant bf16 kernel: `x @ w.T` for bf16
        x, each row's result a function of that row alone (`packed_bf16`)."""
        return PackedBf16(self._bf16, weight)

    def pack_quant(self, segments: Sequence[tuple[QuantFormat, torch.Tensor]], in_features: int) -> PackedQuant:
        """A weight of `in_features` inputs kept in quantized blocks (`(format, [rows, format.row_bytes(k)]
        uint8)` segments stacked along the outputs), repacked for the int8 kernel: `x @ w.T` with x
        quantized per 32-block, and row lookups (`packed_quant`)."""
        return PackedQuant(self._packed, segments, in_features)

    def quant_rows(self, fmt: QuantFormat, raw: torch.Tensor, index: torch.Tensor, k: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` `[n]` (int64) of a `[rows, fmt.row_bytes(k)]` quantized table, decoded: `[n, k]` in
        `dtype`, float32 exactly as gguf's reference dequantizes, or that rounded to bfloat16 (nearest even,
        as torch casts). The kernel reads the rows unchecked, so the indices are checked here (their min and
        max: two reductions over a forward's tokens)."""
        if dtype not in _DTYPES:
            raise ValueError(f"quantized rows decode to one of {list(_DTYPES)}; got {dtype}")
        if BY_GGML_TYPE.get(fmt.ggml_type) != fmt:
            raise ValueError(f"the quantized kernels do not decode {fmt.name} (GGML type {fmt.ggml_type})")
        row_bytes = fmt.row_bytes(k)
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes:
            raise ValueError(f"a {fmt.name} table of rows of {k} is [rows, {row_bytes}] uint8; got {raw.dtype} "
                             f"{tuple(raw.shape)}")
        if index.dtype != torch.int64 or index.dim() != 1:
            raise ValueError(f"row indices are a 1-D int64 tensor; got {index.dtype} {tuple(index.shape)}")
        index = index.contiguous()
        _check_cpu_contiguous(raw, index)
        n = index.shape[0]
        if n and (int(index.min()) < 0 or int(index.max()) >= raw.shape[0]):
            raise ValueError(f"a row index is outside the table's {raw.shape[0]} rows")
        out = torch.empty(n, k, dtype=dtype)
        status = self._quant_rows(fmt.ggml_type, raw.data_ptr(), k, index.data_ptr(), n, out.data_ptr(),
                                  _DTYPES[dtype], torch.get_num_threads())
        check_status("quantized rows", status)
        return out


def _check_dtypes(what: str, *tensors: torch.Tensor) -> None:
    # Called a few hundred times a decode step, so the common case is a few identity tests.
    first = tensors[0].dtype
    if first in _DTYPES and all(t.dtype is first for t in tensors):
        return
    dtypes = {t.dtype for t in tensors}
    raise ValueError(f"{what} needs tensors of one dtype in {list(_DTYPES)}; got {sorted(map(str, dtypes))}")


def _sinks_address(what: str, sinks: torch.Tensor | None, heads: int) -> int | None:
    """The address of an attention's sink logits (None: no sinks, NULL to the kernel), checked: the kernel
    reads `heads` float32s there, one per query head."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32 or sinks.shape != (heads,) \
            or not sinks.is_cpu or not sinks.is_contiguous():
        got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"{what}'s sinks are a contiguous float32 CPU tensor [{heads}] (one per query head); "
                         f"got {got}")
    return sinks.data_ptr()


def _check_cpu_contiguous(*tensors: torch.Tensor) -> None:
    if not all(t.is_cpu and t.is_contiguous() for t in tensors):
        raise ValueError("the CPU kernels take contiguous CPU tensors")


@functools.lru_cache(maxsize=1)  # one build per process; the result never changes
def cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, or None when this machine cannot build them (the reason is logged)."""
    return build_library(CpuKernels)
