"""`LayerStack`: the decoder's layers in one C call on the CPU, when every projection runs the fp16-weight kernel.

A decode step drives about 240 kernel calls from Python; their checks, allocations and argument
conversions cost about a tenth of a 32-row step on two cores, and the OpenMP team's second thread
waits through all of it. `csrc/layer_stack.c` makes the same calls in the same order on the same
inputs, so its result is the Python loop's bit for bit (tested); this module decides when it applies,
holds the layers' weight addresses, and checks once per forward what the C code then reads unchecked.

It applies to a float32 decoder whose every projection is one bound fp16 panel kernel with no bias
(`Linear.f16_panels`, `GateUp.fused_gemm`): the `fp16w` precision on a CPU with AVX2, FMA and F16C,
for models without attention biases. Anything else keeps the Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ferrox_batch.runtime.architectures.layer_weights import LayerWeights
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.kernels.cpu_kernels import POOL_KINDS, CpuKernels
from ferrox_batch.runtime.kv.batch_inputs import BatchInputs
from ferrox_batch.runtime.kv.prefill_plan import PrefillPlan


class LayerStack:
    """The addresses of every layer's norms and packed weights, in `csrc/layer_stack.c`'s order."""

    __slots__ = ("_weights", "_owners", "_config")

    def __init__(self, weights: torch.Tensor, owners: list[object], config: ModelConfig) -> None:
        self._weights = weights  # int64 [layers, 6]
        self._owners = owners  # what keeps those addresses valid
        self._config = config

    @classmethod
    def bind(cls, layers: Sequence[LayerWeights], config: ModelConfig, dtype: torch.dtype) -> LayerStack | None:
        """The stack for these layers, or None where some layer does not run as the C loop does."""
        c = config
        if dtype != torch.float32 or not layers or c.query_pre_attn_scalar is not None or c.embed_scale != 1.0:
            return None
        if c.sliding_window is not None and c.uniform_window is None:  # one window for every layer, or none
            return None
        hidden, q_width = c.hidden_size, c.num_heads * c.head_dim
        width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        rows: list[list[int]] = []
        owners: list[object] = []
        for layer in layers:
            if not layer.plain:  # per-head norms and layers without RoPE are the Python loop's
                return None
            qkv, o, down = layer.qkv.f16_panels, layer.o.f16_panels, layer.down.f16_panels
            gate_up = layer.gate_up.fused_gemm
            if qkv is None or o is None or down is None or gate_up is None:
                return None
            shapes = ((qkv.in_features, qkv.out_features), (o.in_features, o.out_features),
                      (gate_up.in_features, gate_up.out_features), (down.in_features, down.out_features))
            if shapes != ((hidden, width), (q_width, hidden), (hidden, c.intermediate_size),
                          (c.intermediate_size, hidden)):
                return None
            norms = (layer.input_norm, layer.post_norm)
            if any(n.dtype != torch.float32 or not n.is_cpu or not n.is_contiguous() or n.shape != (hidden,)
                   for n in norms):
                return None
            rows.append([layer.input_norm.data_ptr(), qkv.address, o.address, layer.post_norm.data_ptr(),
                         gate_up.address, down.address])
            owners.extend([layer.input_norm, qkv, o, layer.post_norm, gate_up, down])
        return cls(torch.tensor(rows, dtype=torch.int64), owners, c)

    def run(self, kernels: CpuKernels, h: torch.Tensor, inputs: BatchInputs, plan: PrefillPlan | None,
            pool: torch.Tensor, block_size: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Every layer over `h` (`[rows, hidden]` float32 embeddings, updated in place to the residual
        stream before the last MLP output); returns that output. The caller has checked the inputs'
        slots, positions, key ranges and plan against `pool` (`[layers, slots, 2, kv, d]`)."""
        c = self._config
        rows, hidden = h.shape
        kv, d, inter = c.num_kv_heads, c.head_dim, c.intermediate_size
        if pool.dtype not in POOL_KINDS or pool.shape[0] != self._weights.shape[0] or not pool.is_contiguous():
            raise ValueError(f"the layer stack needs a contiguous pool of one of {list(POOL_KINDS)} per layer; "
                             f"got {pool.dtype} {tuple(pool.shape)}")
        if h.dtype != torch.float32 or not h.is_contiguous() or hidden != c.hidden_size:
            raise ValueError(f"the layer stack takes contiguous float32 [rows, {c.hidden_size}]; got {tuple(h.shape)}")
        index = (inputs.positions, inputs.slots)
        decode = inputs.decode
        if decode is not None:
            index += (decode.tables, decode.lo, decode.hi)
        if plan is not None:
            index += (plan.slots, plan.chunks)
        if any(t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous() for t in index):
            raise ValueError("the layer stack's indices must be contiguous int64 CPU tensors")
        n_dec = 0 if decode is None else decode.count
        width = (c.num_heads + 2 * kv) * d
        pending = torch.empty_like(h)
        x = torch.empty_like(h)
        qkv = torch.empty(rows, width)
        attn = torch.empty(rows, c.num_heads * d)
        qdec = torch.empty(max(n_dec, 1), c.num_heads * d)
        mlp = torch.empty(rows, inter)
        nothing = 0  # a null pointer for a group that is absent
        status = kernels.layer_stack_entry(
            h.data_ptr(), pending.data_ptr(), x.data_ptr(), qkv.data_ptr(), attn.data_ptr(), qdec.data_ptr(),
            mlp.data_ptr(), rows, hidden, inter, self._weights.shape[0], self._weights.data_ptr(),
            pool.data_ptr(), pool.stride(0), POOL_KINDS[pool.dtype], cos.data_ptr(), sin.data_ptr(),
            inputs.positions.data_ptr(), inputs.slots.data_ptr(), c.num_heads, kv, d, c.rms_norm_eps,
            d ** -0.5, n_dec, nothing if decode is None else decode.tables.data_ptr(),
            0 if decode is None else decode.tables.shape[1], nothing if decode is None else decode.lo.data_ptr(),
            nothing if decode is None else decode.hi.data_ptr(), block_size,
            nothing if plan is None else plan.slots.data_ptr(), nothing if plan is None else plan.chunks.data_ptr(),
            0 if plan is None else plan.chunks.shape[0], c.sliding_window or 0, torch.get_num_threads())
        if status != 0:
            raise MemoryError("the layer stack's kernels could not allocate their scratch memory")
        return pending
