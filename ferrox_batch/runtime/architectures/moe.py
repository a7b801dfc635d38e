"""`MoeBlock`: a mixture of experts as a layer's feed-forward block.

The router (float32 logits from the block's float32 copy of its weight, then `router.route`) picks each
row's k experts. The `rows * k` (row, expert) pairs are sorted by expert, so each expert's rows are one
contiguous slice of the gathered inputs; each expert with rows runs its gated MLP once over its slice,
on whatever kernel its linears got (`LinearFactory.gate_up_experts`, `experts`: fp16 or bf16 panels,
oneDNN, the int8 kernel over the file's blocks), and one weighted `index_add_` puts the results back on
their rows. The only Python loop is over the experts with rows, one product each: a decode step of one
row reads only its k experts' weights. A shared expert (times its sigmoid gate where there is one) is
added for every row.

On the CPU with the C kernels, a plain softmax top-k router runs in C (`CpuKernels.moe_route`), and where
every expert is the int8 kernel's packed weight the whole routed half is one C call (`fused`,
`kernels.packed_moe`): the same products, SiLU and weighted sum as the steps above, bit for bit, without a
dozen small torch ops a layer (and the C layer stack runs the same two calls).

The sums run in float32 whatever the compute dtype; each row's contributions are added in the order of
its experts' ids (on the CPU). The C router computes each row's choice from that row alone, so with
batch-invariant linears a row's output is the same alone or batched (`batch_invariant`); any other router
runs torch's float32 matmul, whose rounding may follow the batch's size (a row may then differ by a
rounding, and at a near tie in its experts), as does a shared expert's gate: those blocks claim nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from ferrox_batch.runtime.architectures.clamped_swiglu import ClampedSwiGlu
from ferrox_batch.runtime.architectures.forward_context import ForwardContext
from ferrox_batch.runtime.architectures.gate_up import GateUp
from ferrox_batch.runtime.architectures.gated_mlp import GatedMlp
from ferrox_batch.runtime.architectures.linear import Linear
from ferrox_batch.runtime.architectures.norms import norm
from ferrox_batch.runtime.architectures.quantized_linear import QuantizedLinear
from ferrox_batch.runtime.architectures.router import route
from ferrox_batch.runtime.kernels.packed_moe import PackedMoe
from ferrox_batch.runtime.kernels.packed_quant import PackedExperts, PackedQuant
from ferrox_batch.runtime.families.moe_spec import RouterSpec


@dataclass(slots=True)
class MoeBlock:
    router: RouterSpec
    #: The router's float32 `[experts, hidden]` weight, its bias and correction bias (float32) where it has them.
    router_weight: torch.Tensor
    #: Each expert's gated projection: `act(gate(x)) * up(x)`, `[rows, intermediate]`.
    gate_up: tuple[GateUp | ClampedSwiGlu, ...]
    down: tuple[Linear | QuantizedLinear, ...]
    router_bias: torch.Tensor | None = None
    correction: torch.Tensor | None = None
    shared: GatedMlp | None = None
    #: The shared expert's float32 `[1, hidden]` sigmoid gate.
    shared_gate: torch.Tensor | None = None
    out_norm: torch.Tensor | None = None
    #: Every expert's gate/up and down weights run together, where all are the int8 kernel's packed weights
    #: with the SiLU in C and no biases (`packed_experts`): one call each per layer instead of one per expert.
    packed: tuple[PackedExperts, PackedExperts] | None = None
    #: The router's input RMS-normed without a scale, then times this float32 `[hidden]` and `hidden ** -0.5`
    #: (`RouterSpec.input_norm`, `input_scale`); None where the router reads its input as it is.
    router_input_scale: torch.Tensor | None = None
    #: Each chosen weight times its expert's float32 factor (`RouterSpec.expert_scale`).
    expert_scale: torch.Tensor | None = None
    #: An RMSNorm on the experts' input (not the router's: `MoeSpec.expert_norm`).
    expert_norm: torch.Tensor | None = None
    #: `packed`'s routed half in C (the pairs' sort, both projections, the weighted sum: `fused_experts`).
    fused: PackedMoe | None = None
    #: The router is a softmax top-k with nothing else (no bias, correction, groups, scale or input norm):
    #: on the CPU it runs in C (`CpuKernels.moe_route`), each row's choice a function of that row alone.
    plain_router: bool = False


    @property
    def batch_invariant(self) -> bool:
        """Whether each row's output depends on that row alone given batch-invariant linears (on the CPU with
        the C kernels, as the decoder's claim is): a plain router, which runs in C, and no shared expert's
        gate (a float32 torch matmul)."""
        return self.plain_router and self.shared_gate is None

    def linears(self) -> list[Linear | QuantizedLinear | GateUp]:
        experts = [linear.linear if isinstance(linear, ClampedSwiGlu) else linear
                   for pair in zip(self.gate_up, self.down) for linear in pair]
        return experts + ([] if self.shared is None else self.shared.linears())

    def norms(self) -> list[torch.Tensor]:
        own = [t for t in (self.out_norm, self.expert_norm) if t is not None]
        return own + ([] if self.shared is None else self.shared.norms())

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.router_weight, self.router_bias, self.correction, self.shared_gate, self.out_norm,
                               self.router_input_scale, self.expert_scale, self.expert_norm) if t is not None]
        return (sum(linear.nbytes for linear in zip(self.gate_up, self.down) for linear in linear)
                + sum(t.numel() * t.element_size() for t in tensors)
                + (0 if self.shared is None else self.shared.nbytes))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.plain_router and ctx.kernels is not None:
            routed = ctx.kernels.moe_route(x, self.router_weight, self.router.top_k, self.router.renormalize)
        else:
            scores_in = x.float()
            if self.router.input_norm:
                scores_in = scores_in * torch.rsqrt(scores_in.pow(2).mean(-1, keepdim=True) + ctx.eps)
            if self.router_input_scale is not None:
                scores_in = scores_in * self.router_input_scale * (x.shape[1] ** -0.5)
            routed = route(F.linear(scores_in, self.router_weight, self.router_bias), self.router, self.correction,
                           self.expert_scale)
        gate_in = x  # the shared expert's gate reads the block's input, as the router does
        if self.expert_norm is not None:
            x = norm(x, self.expert_norm, ctx.eps, ctx.kernels)
        weights, ids = routed
        if self.packed is not None and self.fused is not None and ctx.kernels is not None:
            out = self.fused(x, ids, weights)
        else:
            out = self._experts_in_python(x, ids, weights, ctx)
        if self.shared is not None:
            shared = self.shared.forward(x, ctx).float()
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(F.linear(gate_in.float(), self.shared_gate))
            out += shared
        out = out.to(x.dtype)
        if self.out_norm is not None:
            out = norm(out, self.out_norm, ctx.eps, ctx.kernels)
        return out

    def _experts_in_python(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           ctx: ForwardContext) -> torch.Tensor:
        """The weighted sum of each row's experts' outputs, float32: the pairs sorted by expert, each expert
        with rows one product over its slice (or every packed expert in one call per projection)."""
        rows, k = x.shape[0], self.router.top_k
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        source = order // k  # each sorted pair's row
        gathered = x[source]
        if self.packed is not None and ctx.kernels is not None:
            # Each expert's rows as a range of the sorted pairs; the kernel skips the experts without any.
            counts_t = torch.bincount(flat, minlength=self.router.experts)
            hi = counts_t.cumsum(0)
            lo = hi - counts_t
            gate_up, down = self.packed
            results = down(ctx.kernels.silu_mul(gate_up(gathered, lo, hi)), lo, hi).float()
        else:
            counts = torch.bincount(flat, minlength=self.router.experts).tolist()
            results = torch.empty(rows * k, x.shape[1], dtype=torch.float32, device=x.device)
            for expert, (end, count) in enumerate(zip(accumulate(counts), counts)):
                if count:
                    part = slice(end - count, end)
                    results[part] = self.down[expert](self.gate_up[expert](gathered[part]))
        results *= weights.flatten()[order, None]
        return torch.zeros(rows, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, source, results)


def plain_router(router: RouterSpec) -> bool:
    """Whether the router is a softmax top-k and nothing else, which the C router runs."""
    return (router.scoring == "softmax" and router.correction_bias is None and router.groups == 1
            and router.scale == 1.0 and not router.bias and not router.input_norm and router.input_scale is None
            and router.expert_scale is None)


def fused_experts(packed: tuple[PackedExperts, PackedExperts] | None, router: RouterSpec,
                  router_weight: torch.Tensor) -> PackedMoe | None:
    """`packed`'s routed half in C (None without `packed`); it carries the router's weight where the router
    is plain, for the layer stack."""
    if packed is None:
        return None
    return PackedMoe(*packed, router.top_k, router.renormalize, router_weight if plain_router(router) else None)


def packed_experts(gate_up: tuple[GateUp | ClampedSwiGlu, ...],
                   down: tuple[Linear | QuantizedLinear, ...]) -> tuple[PackedExperts, PackedExperts] | None:
    """The experts' weights as two `PackedExperts`, where every gate/up projection is the int8 kernel's packed
    weight with its SiLU in C and every down projection one too, none with a bias, all of one shape; else
    None (the block runs one expert at a time)."""
    gates = [g.packed_gemm if isinstance(g, GateUp) else None for g in gate_up]
    downs = [d.stored if isinstance(d, QuantizedLinear) and d.bias is None else None for d in down]
    if any(g is None for g in gates) or not all(isinstance(d, PackedQuant) for d in downs):
        return None
    if len({g.shape for g in gates}) != 1 or len({d.shape for d in downs}) != 1:
        return None
    return PackedExperts(gates), PackedExperts(downs)
