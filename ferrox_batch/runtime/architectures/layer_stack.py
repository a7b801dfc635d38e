"""`LayerStack`: the decoder's layers in one C call on the CPU, when every projection runs the fp16-weight
kernel, or every one the int8 quantized kernel, or every one the bf16 kernel.

A decode step drives about 240 kernel calls from Python; their checks, allocations and argument
conversions cost about a tenth of a 32-row step on two cores, and the OpenMP team's second thread
waits through all of it. `csrc/layer_stack.c` makes the same calls in the same order on the same
inputs, so its result is the Python loop's bit for bit (tested); this module decides when it applies,
holds the layers' weight addresses, and checks once per forward what the C code then reads unchecked.

It applies to a float32 decoder whose every projection is one bound fp16 panel kernel with no bias
(`Linear.f16_panels`, `GateUp.fused_gemm`): the `fp16w` precision on a CPU with AVX2, FMA and F16C,
for models without attention biases; and to a float32 or bf16 decoder whose every projection is a packed
quantized weight with no bias (`QuantizedLinear.packed_gemm`, `GateUp.packed_gemm`: a GGUF served as
stored, every linear in a format the int8 kernel runs); and to a bf16 decoder whose every projection runs
the batch-invariant bf16 kernel with no bias (`Linear.bf16_panels`, `GateUp.bf16_gemm`). Anything else keeps
the Python loop. The layer kinds it has kernels for are an `AttentionMixer` over global RoPE at its head
size's scale, without norms of its own but on its queries and keys (per head or over the projection, as the
Python loop norms them through the same kernel), and a `GatedMlp` without an output norm or, over packed
quantized weights, a `MoeBlock` of packed experts with a plain softmax top-k router and nothing beside
(`csrc/packed_moe.c`: a mixture of experts' Python glue is a dozen small torch ops a layer); with norms before
both blocks and nothing scaling the residual stream. `declines` says why it does not take a model (the
decoder keeps it, `Decoder.layer_stack_declined`).

Where oneDNN runs the bf16 layers and each also holds our kernel's panels (`Linear`'s `narrow_panels`, for
AMX CPUs), the stack takes only the steps of at most `NARROW_STEP_ROWS` rows (`takes`) and the loop the
rest: a single stream and a few concurrent ones, drafts and all, go through one C call over our panels,
while wide steps keep oneDNN's tile kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ferrox_batch.runtime.architectures.attention_mixer import AttentionMixer
from ferrox_batch.runtime.architectures.gated_mlp import GatedMlp
from ferrox_batch.runtime.architectures.layer import Layer
from ferrox_batch.runtime.architectures.moe import MoeBlock
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.kernels.cpu_kernels import POOL_KINDS, CpuKernels
from ferrox_batch.runtime.kv.batch_inputs import BatchInputs
from ferrox_batch.runtime.kv.prefill_plan import PrefillPlan


#: The weights a stack runs, by `csrc/layer_stack.c`'s `kind` argument.
STACK_KINDS = ("fp16_panels", "quantized", "bf16_panels")
#: The widest step a narrow-only stack takes (module docstring). A lone sequence verifying a full draft of
#: the default 15 tokens is 16 rows (drafting rows share those positions). Beyond that our kernel's compute, not the weights' bytes, bounds a step: at 16 rows of
#: the default model about 4.3 GFLOP, ~11 ms at the ~400 GFLOP/s two avx512_bf16 cores reach, where AMX
#: tiles multiply several times faster and oneDNN's Python loop costs ~4 ms a step on top (Zen 4).
NARROW_STEP_ROWS = 16


#: The columns of a layer's row after the projections' (csrc/layer_stack.c's W_ROUTER .. W_DOWN_COUNTS).
MOE_COLUMNS = 9


def _moe_declined(ffn: MoeBlock) -> str | None:
    """Why the stack cannot run this mixture of experts (None where it can): it runs packed experts with a
    plain softmax top-k router and nothing beside them."""
    if ffn.fused is None or ffn.packed is None:
        return "has experts that are not all the int8 kernel's packed weights"
    if not ffn.plain_router:
        return "has a router other than a plain softmax top-k"
    if ffn.shared is not None or ffn.out_norm is not None or ffn.expert_norm is not None:
        return "has a shared expert or norms of its own"
    return None


def _qk_norm_columns(mixer: AttentionMixer, dtype: torch.dtype) -> list[int] | None:
    """The layer's q and k norm columns (addresses and spans; zeros where it has none), or None where a norm
    is not a contiguous CPU tensor of the stack's dtype."""
    s = mixer.shape
    spans = (s.head_dim, s.head_dim) if mixer.qk_norm_span == "head" else (s.num_heads * s.head_dim,
                                                                           s.num_kv_heads * s.head_dim)
    out = []
    for weight, span in zip((mixer.q_norm, mixer.k_norm), spans):
        if weight is None:
            out.append(0)
        elif weight.dtype != dtype or not weight.is_cpu or not weight.is_contiguous() or weight.shape != (span,):
            return None
        else:
            out.append(weight.data_ptr())
    return [*out, *spans]


def _qk_norm_owners(mixer: AttentionMixer) -> list[torch.Tensor]:
    return [t for t in (mixer.q_norm, mixer.k_norm) if t is not None]


class LayerStack:
    """The addresses of every layer's norms and packed weights, in `csrc/layer_stack.c`'s order."""

    __slots__ = ("_config", "_dtype", "_kind", "_narrow_only", "_owners", "_weights", "_window")

    def __init__(self, weights: torch.Tensor, owners: list[object], config: ModelConfig, kind: str,
                 dtype: torch.dtype, narrow_only: bool = False, window: int | None = None) -> None:
        self._weights = weights  # int64 [layers, csrc/layer_stack.c's W_COLS]
        self._owners = owners  # what keeps those addresses valid
        self._config = config
        self._kind = kind
        self._dtype = dtype
        self._narrow_only = narrow_only
        self._window = window

    @property
    def narrow_only(self) -> bool:
        """Whether it runs the narrow steps' copies of the weights, so takes only narrow steps."""
        return self._narrow_only

    def takes(self, rows: int) -> bool:
        """Whether a step of `rows` rows goes through the stack (every step, unless `narrow_only`)."""
        return not self._narrow_only or rows <= NARROW_STEP_ROWS

    @property
    def kind(self) -> str:
        """The weights it runs: one of `STACK_KINDS`."""
        return self._kind

    @staticmethod
    def declines(layers: Sequence[Layer], config: ModelConfig, dtype: torch.dtype) -> str | None:
        """Why the stack cannot run these layers as they are (a layer kind or a setting its C loop does not
        have), or None where it may: `bind` then checks each projection's kernel."""
        if dtype not in (torch.float32, torch.bfloat16):
            return f"the stack runs float32 or bf16 activations, not {dtype}"
        if not layers:
            return "no layers"
        if config.embed_scale != 1.0:
            return "scaled embeddings"
        if config.global_head_dim is not None or config.global_kv_heads is not None or config.kv_source is not None:
            return "its layers differ in head shape or share K/V"
        windows = set()
        for index, layer in enumerate(layers):
            mixer, ffn = layer.mixer, layer.ffn
            if not isinstance(mixer, AttentionMixer):
                return f"layer {index}'s mixer is {type(mixer).__name__}; the stack runs attention"
            if isinstance(ffn, MoeBlock):
                why = _moe_declined(ffn)
                if why is not None:
                    return f"layer {index}'s mixture of experts {why}"
            elif not isinstance(ffn, GatedMlp):
                return (f"layer {index}'s feed-forward block is {type(ffn).__name__}; the stack runs the gated MLP "
                        "and packed experts")
            elif not ffn.plain:
                return f"layer {index}'s MLP normalises its output"
            if not (mixer.plain or mixer.plain_but_qk_norms):
                return f"layer {index}'s attention has other norms of its own, another RoPE kind or another scale"
            if layer.input_norm is None or layer.post_norm is None or layer.residual_scale is not None:
                return f"layer {index} has no norm before a block, or scales what joins the residual stream"
            if layer.after is not None or layer.output_scale is not None:
                return f"layer {index} has a block after its feed-forward block, or scales the residual stream"
            windows.add(mixer.window)
        if len(windows) > 1:  # one window for every layer, or none
            return "its layers attend over different windows"
        return None

    @classmethod
    def bind(cls, layers: Sequence[Layer], config: ModelConfig, dtype: torch.dtype) -> LayerStack | None:
        """The stack for these layers, or None where some layer does not run as the C loop does."""
        c = config
        if cls.declines(layers, config, dtype) is not None:
            return None
        hidden, q_width = c.hidden_size, c.num_heads * c.head_dim
        width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        # `declines` has checked every layer is attention and the gated MLP, all over one window.
        blocks = [(layer.mixer, layer.ffn) for layer in layers]
        window = blocks[0][0].window  # type: ignore[attr-defined]
        if isinstance(blocks[0][0].qkv, QuantizedLinear):  # type: ignore[attr-defined]
            kind = "quantized"
        else:
            kind = "bf16_panels" if dtype == torch.bfloat16 else "fp16_panels"
        rows: list[list[int]] = []
        owners: list[object] = []
        narrow = False
        for layer, (mixer, ffn) in zip(layers, blocks):
            assert isinstance(mixer, AttentionMixer) and isinstance(ffn, GatedMlp | MoeBlock)
            norms = (layer.input_norm, layer.post_norm)
            if any(n is None or n.dtype != dtype or not n.is_cpu or not n.is_contiguous() or n.shape != (hidden,) for n in norms):
                return None
            extra = _qk_norm_columns(mixer, dtype)
            if extra is None:
                return None
            if isinstance(ffn, MoeBlock):
                qkv, o = (getattr(linear, "packed_gemm", None) for linear in (mixer.qkv, mixer.o))
                moe = ffn.fused
                if kind != "quantized" or qkv is None or o is None or moe is None:
                    return None
                if ((qkv.in_features, qkv.out_features), (o.in_features, o.out_features)) != \
                        ((hidden, width), (q_width, hidden)) or moe.shapes[0] != hidden:
                    return None
                assert layer.input_norm is not None and layer.post_norm is not None
                router, gu, gu_counts, down, down_counts = moe.addresses()
                rows.append([layer.input_norm.data_ptr(), qkv.address, o.address, layer.post_norm.data_ptr(), 0, 0,
                             qkv.segment_count, o.segment_count, 0, 0, *extra, router, moe.experts, moe.top_k,
                             int(moe.renormalize), moe.shapes[1], gu, gu_counts, down, down_counts])
                owners.extend([layer.input_norm, qkv, o, layer.post_norm, moe, *_qk_norm_owners(mixer)])
                continue
            linears = (mixer.qkv, mixer.o, ffn.gate_up, ffn.down)
            if kind == "quantized":
                gemms = [getattr(linear, "packed_gemm", None) for linear in linears]
            elif kind == "bf16_panels":
                gemms = [getattr(mixer.qkv, "bf16_panels", None), getattr(mixer.o, "bf16_panels", None),
                         getattr(ffn.gate_up, "bf16_gemm", None), getattr(ffn.down, "bf16_panels", None)]
                narrow = narrow or any(linear.kind != "bf16_panels" for linear in linears)
            else:
                gemms = [getattr(mixer.qkv, "f16_panels", None), getattr(mixer.o, "f16_panels", None),
                         getattr(ffn.gate_up, "fused_gemm", None), getattr(ffn.down, "f16_panels", None)]
            if any(g is None for g in gemms):
                return None
            qkv, o, gate_up, down = gemms
            # The fp16 gated kernel writes silu(gate) * up; the others write gate | up for `silu_mul`.
            up_width = c.intermediate_size if kind == "fp16_panels" else 2 * c.intermediate_size
            shapes = ((qkv.in_features, qkv.out_features), (o.in_features, o.out_features),
                      (gate_up.in_features, gate_up.out_features), (down.in_features, down.out_features))
            if shapes != ((hidden, width), (q_width, hidden), (hidden, up_width), (c.intermediate_size, hidden)):
                return None
            counts = [g.segment_count for g in gemms] if kind == "quantized" else [0, 0, 0, 0]
            assert layer.input_norm is not None and layer.post_norm is not None
            rows.append([layer.input_norm.data_ptr(), qkv.address, o.address, layer.post_norm.data_ptr(),
                         gate_up.address, down.address, *counts, *extra, *[0] * MOE_COLUMNS])
            owners.extend([layer.input_norm, qkv, o, layer.post_norm, gate_up, down, *_qk_norm_owners(mixer)])
        return cls(torch.tensor(rows, dtype=torch.int64), owners, c, kind, dtype, narrow, window)

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
        if h.dtype != self._dtype or not h.is_contiguous() or hidden != c.hidden_size:
            raise ValueError(f"the layer stack takes contiguous {self._dtype} [rows, {c.hidden_size}]; got "
                             f"{h.dtype} {tuple(h.shape)}")
        if cos.dtype != self._dtype or sin.dtype != self._dtype:
            raise ValueError(f"the layer stack's RoPE tables are {self._dtype}; got {cos.dtype}")
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
        dtype = self._dtype
        pending = torch.empty_like(h)
        x = torch.empty_like(h)
        qkv = torch.empty(rows, width, dtype=dtype)
        attn = torch.empty(rows, c.num_heads * d, dtype=dtype)
        qdec = torch.empty(max(n_dec, 1), c.num_heads * d, dtype=dtype)
        mlp = torch.empty(rows, inter, dtype=dtype)
        gu = mlp if self._kind == "fp16_panels" else torch.empty(rows, 2 * inter, dtype=dtype)
        nothing = 0  # a null pointer for a group that is absent
        status = kernels.layer_stack_entry(
            h.data_ptr(), pending.data_ptr(), x.data_ptr(), qkv.data_ptr(), attn.data_ptr(), qdec.data_ptr(),
            mlp.data_ptr(), gu.data_ptr(), rows, hidden, inter, self._weights.shape[0], self._weights.data_ptr(),
            STACK_KINDS.index(self._kind), int(dtype == torch.bfloat16),
            pool.data_ptr(), pool.stride(0), POOL_KINDS[pool.dtype], cos.data_ptr(), sin.data_ptr(),
            inputs.positions.data_ptr(), inputs.slots.data_ptr(), c.num_heads, kv, d, c.rms_norm_eps,
            d ** -0.5, n_dec, nothing if decode is None else decode.tables.data_ptr(),
            0 if decode is None else decode.tables.shape[1], nothing if decode is None else decode.lo.data_ptr(),
            nothing if decode is None else decode.hi.data_ptr(), block_size,
            nothing if plan is None else plan.slots.data_ptr(), nothing if plan is None else plan.chunks.data_ptr(),
            0 if plan is None else plan.chunks.shape[0], self._window or 0, torch.get_num_threads())
        if status != 0:
            raise MemoryError("the layer stack's kernels could not allocate their scratch memory")
        return pending
