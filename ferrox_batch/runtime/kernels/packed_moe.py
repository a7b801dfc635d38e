"""`PackedMoe`: a mixture of experts' routed half in C over the int8 kernel's packed experts
(`csrc/packed_moe.c`): the softmax top-k router and, given each row's experts and weights, the sorted
pairs, both projections of every expert, the SiLU and the weighted sum back onto the rows (`route_softmax`
routes in C for any block with a plain softmax top-k router).

Why: driven from Python the same work is a dozen small torch ops per layer (the router's product, the
softmax and top-k, the sort, the gather, the products, the weighting, `index_add_`), each paying its
dispatch at every layer of every decode step. The C entry points make the calls the Python loop made on
the experts in the same order, so the experts' half is the loop's bit for bit; the router is its own
arithmetic (`route`), each row's result a function of that row alone.
"""

from __future__ import annotations

import torch

from ferrox_batch.runtime.kernels.packed_quant import PackedExperts, PackedLibrary
from ferrox_batch.runtime.kernels.quant_gemm import check_status, input_rows


class PackedMoe:
    """Every expert's gate|up (`gate_up`, SiLU-gated) and down (`down`) packed weights, and the router's
    float32 `[experts, hidden]` weight where its softmax top-k may run in C (`router_weight`, for the layer
    stack; None where it may not)."""

    __slots__ = ("_down", "_gate_up", "_lib", "_renormalize", "_router", "_top_k")

    def __init__(self, gate_up: PackedExperts, down: PackedExperts, top_k: int,
                 renormalize: bool, router_weight: torch.Tensor | None = None) -> None:
        (n_gu, hidden), (n_down, inter) = gate_up.shape, down.shape
        if gate_up.experts != down.experts or n_gu != 2 * inter or n_down != hidden:
            raise ValueError(f"experts' gate|up {gate_up.experts} x {gate_up.shape} and down {down.experts} x "
                             f"{down.shape} do not make one gated MLP")
        if not 0 < top_k <= gate_up.experts:
            raise ValueError(f"top_k {top_k} outside 1..{gate_up.experts}")
        if router_weight is not None and (router_weight.dtype != torch.float32 or not router_weight.is_contiguous()
                                          or router_weight.shape != (gate_up.experts, hidden)):
            raise ValueError(f"the router's weight is contiguous float32 [{gate_up.experts}, {hidden}]; got "
                             f"{router_weight.dtype} {tuple(router_weight.shape)}")
        self._lib = gate_up.library
        self._gate_up, self._down = gate_up, down
        self._top_k, self._renormalize = top_k, renormalize
        self._router = router_weight

    @property
    def experts(self) -> int:
        return self._gate_up.experts

    @property
    def top_k(self) -> int:
        return self._top_k

    @property
    def renormalize(self) -> bool:
        return self._renormalize

    @property
    def shapes(self) -> tuple[int, int]:
        """`(hidden, intermediate)`."""
        return self._down.shape

    def addresses(self) -> tuple[int, int, int, int, int]:
        """The router weight's address (0: none) and the gate|up and down experts' address and count arrays,
        as `csrc/layer_stack.c` reads them; valid while this object lives."""
        return (0 if self._router is None else self._router.data_ptr(), self._gate_up.addresses.data_ptr(),
                self._gate_up.counts.data_ptr(), self._down.addresses.data_ptr(), self._down.counts.data_ptr())

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each row's experts' outputs, float32 `[m, hidden]`, for x `[m, hidden]`
        (float32 or bf16; the experts run in its dtype) and its `[m, k]` int64 ids and float32 weights
        (ids outside the experts are refused in C)."""
        hidden, inter = self.shapes
        rows, flag = input_rows(x, hidden)
        m = rows.shape[0]
        if ids.shape != (m, self._top_k) or ids.dtype != torch.int64 or weights.shape != (m, self._top_k) \
                or weights.dtype != torch.float32:
            raise ValueError(f"ids and weights are int64 and float32 [{m}, {self._top_k}]; got {ids.dtype} "
                             f"{tuple(ids.shape)}, {weights.dtype} {tuple(weights.shape)}")
        ids, weights = ids.contiguous(), weights.contiguous()
        out = torch.empty(m, hidden, dtype=torch.float32)
        gu, down = self._gate_up, self._down
        status = self._lib.moe(rows.data_ptr(), flag, m, hidden, ids.data_ptr(), weights.data_ptr(), self._top_k,
                               gu.experts, gu.addresses.data_ptr(), gu.counts.data_ptr(), inter,
                               down.addresses.data_ptr(), down.counts.data_ptr(), out.data_ptr(),
                               torch.get_num_threads())
        check_status("the experts", status)
        return out


def route_softmax(lib: PackedLibrary, x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights, ids)`, float32 and int64 `[m, k]`: each of x's `[m, hidden]` rows' k experts by the softmax
    of its float32 logits against `router_weight` (contiguous float32 `[experts, hidden]`), renormalised
    over the k where asked; each row's result a function of that row alone (`csrc/packed_moe.c`)."""
    experts, hidden = router_weight.shape
    if router_weight.dtype != torch.float32 or not router_weight.is_contiguous() or not 0 < top_k <= experts:
        raise ValueError(f"a router of contiguous float32 [experts, hidden] and 1 <= top_k <= experts; got "
                         f"{router_weight.dtype} {tuple(router_weight.shape)}, top_k {top_k}")
    rows, flag = input_rows(x, hidden)
    m = rows.shape[0]
    ids = torch.empty(m, top_k, dtype=torch.int64)
    weights = torch.empty(m, top_k, dtype=torch.float32)
    status = lib.route(rows.data_ptr(), flag, m, hidden, router_weight.data_ptr(), experts, top_k, int(renormalize),
                       ids.data_ptr(), weights.data_ptr(), torch.get_num_threads())
    check_status("the router", status)
    return weights, ids
