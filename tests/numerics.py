"""Tolerances from the arithmetic, shared by the numeric tests.

A binary float format with p bits of precision (24 for float32, 11 for float16, 8 for bfloat16)
spaces its values 2**(e + 1 - p) apart in the binade [2**e, 2**(e + 1)): `step(x, dtype)` is that
spacing at x (one "ulp"). Rounding to nearest is off by at most half a step, a relative error of at
most u = 2**-p (`unit_roundoff`). Every bound here counts steps or roundings of a format where each
side of a comparison rounds; none comes from a measurement.

* `steps_apart(a, b)`: how many values of their format lie from one result to the other.
* `rounds_alike(exact, error, dtype)`: where a value computed within `error` of `exact` must round to
  the same value of `dtype` as `exact` (it is farther than `error` from every rounding boundary).
* `gamma(n)`: summing n terms in any order, blocked, pairwise or with FMA, errs by at most
  gamma_n = n*u / (1 - n*u) times the sum of the terms' magnitudes.
* `softmax_error(p, ...)`: how far a float32 `exp(l - max) / sum` may be from the exact softmax.
* `log_softmax_error(lp, scale, ...)`: the same for a float32 `log_softmax`.
* `logits_tolerance(config, context, logits, dtype)`: how far two whole forwards of one model, which
  differ only in where and in what order they round, may put a logit apart (see there).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: How many sqrt(K) * u a whole-forward tolerance allows per side. A logit's error is a sum of K
#: rounding errors; modelled as independent, zero-mean and each at most u (of the logits' scale),
#: Hoeffding's inequality puts the sum past LAMBDA * sqrt(K) * u with probability at most
#: 2 * exp(-LAMBDA**2 / 2) = 3e-8 per logit: below 1e-2 for all 49,152 logits of the real model over
#: the prompts of a test. (The worst case, K * u, is reached only when every rounding errs the same
#: way; for the real model's K of about 140,000 it would allow a logit to move by 1%.)
LAMBDA = 6.0

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float64: torch.int64}


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: the largest relative error of one rounding to nearest (half of `eps`, the step at 1)."""
    return torch.finfo(dtype).eps / 2


def step(x: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s values at |x| (float64), the subnormal spacing below the normal range."""
    info = torch.finfo(dtype)
    x = torch.as_tensor(x, dtype=torch.float64).abs()
    _, exponent = torch.frexp(x)  # x = m * 2**exponent with m in [0.5, 1): the binade starts at 2**(exponent - 1)
    spacing = torch.ldexp(torch.full_like(x, info.eps), exponent - 1)
    subnormal = info.smallest_normal * info.eps
    return torch.where(x < info.smallest_normal, torch.full_like(x, subnormal), spacing)


def steps(n: float, x: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """n steps of `dtype` at x."""
    return n * step(x, dtype)


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many values of the tensors' (shared, floating) dtype lie from a to b: 0 when equal, 1 for
    neighbours, counted across binades and through zero (+0 and -0 are one value). Finite inputs only."""
    if a.dtype != b.dtype or a.dtype not in _INT_VIEW:
        raise TypeError(f"steps_apart needs two tensors of one float dtype, got {a.dtype} and {b.dtype}")
    if not bool(a.isfinite().all() and b.isfinite().all()):
        raise ValueError("steps_apart counts between finite values only")

    return (_ordered(a) - _ordered(b)).abs()


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Sign and magnitude bits -> one integer line (int64): the magnitude bits count steps from zero."""
    bits = t.contiguous().view(_INT_VIEW[t.dtype]).long()
    magnitude = bits & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def _from_ordered(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `_ordered`."""
    sign = 1 << (torch.finfo(dtype).bits - 1)
    bits = torch.where(k < 0, -k - sign, k)  # a negative value's bits, read as a signed integer
    return bits.to(_INT_VIEW[dtype]).view(dtype)


def rounds_alike(exact: torch.Tensor, error: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """True where every value within `error` of `exact` rounds to nearest in `dtype` alike: `exact` is
    farther than `error` from both half-way points around its nearest value of `dtype`. (The conversion
    from float64 goes through float32, so `error` must be at least float32's half step at `exact`, as
    any float32 computation's is.)"""
    exact = exact.double()
    nearest = exact.to(dtype)
    k = _ordered(nearest)
    up, down = _from_ordered(k + 1, dtype).double(), _from_ordered(k - 1, dtype).double()
    nearest = nearest.double()
    distance = torch.minimum(((nearest + up) / 2 - exact).abs(), (exact - (nearest + down) / 2).abs())
    return distance > torch.as_tensor(error, dtype=torch.float64)


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """The worst relative error of a sum of n terms (to the sum of their magnitudes): n*u / (1 - n*u)."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{n} terms are too many for a bound in {dtype}")
    return nu / (1 - nu)


#: torch's `exp` on the CPU: Sleef's 1-ulp exp under AVX2 and AVX-512, the C library's below that.
TORCH_EXP_ULPS = 1
#: torch's softmax on the CPU may take its faster exp, documented within 20 ulps.
TORCH_SOFTMAX_EXP_ULPS = 20


def softmax_error(p: torch.Tensor, *, exp_ulps: float, logit_error: float = 0.0) -> torch.Tensor:
    """Per element, how far a float32 `exp(l - max) / sum(...)` along the last axis may be from the
    exact softmax `p` (float64) of its logits, when each logit reaches it off by at most `logit_error`.

    Each term's relative error: the logit (a shift dl of the logits moves p_i by
    p_i * (dl_i - sum_j p_j dl_j), so at most 2 * logit_error), the subtraction of the max (u * (m - l_i)
    in the exponent), exp (`exp_ulps` ulps, 2u each), the sum of the row's n non-zero terms (gamma_n;
    the zeros add exactly) and the division (u). The subtraction's share, p_i * u * (m - l_i) +
    p_i * u * sum_j p_j (m - l_j), is at most u / e + p_i * u * ln(n): x * exp(-x) <= 1/e, and
    sum_j p_j (m - l_j) is at most the entropy.
    """
    p = p.double()
    u = unit_roundoff(torch.float32)
    n = (p > 0).sum(-1, keepdim=True).clamp(min=1).double()
    row_sum = n * u / (1 - n * u)  # gamma_n, row by row
    relative = 2 * logit_error + 2 * exp_ulps * u + row_sum + u + n.log() * u
    return p * relative + u / math.e


def log_softmax_error(lp: torch.Tensor, scale: float, *, exp_ulps: float) -> torch.Tensor:
    """Per element, how far a float32 `log_softmax` along the last axis may be from the exact log-softmax
    `lp` of the same float32 logits, whose largest magnitude is `scale`.

    lp_i = (l_i - m) - log s with s = sum_j exp(l_j - m) over the row's n terms. s errs relatively by at
    most gamma_n (the sum) + 2 * exp_ulps * u (each exp) + u * sum_j p_j (m - l_j) (each shifted input's
    rounding, carried through exp), and that last sum is at most the entropy, ln n; log s then errs by that
    relative error, plus its own rounding of a value <= ln n. The shift and the final subtraction round
    once each (u * |lp_i| each), or, where torch adds m + log s first and subtracts that from l_i, once at
    u * (scale + ln n) and once at u * |lp_i|; the bound covers either order.
    """
    lp = lp.double()
    u = unit_roundoff(torch.float32)
    n = int(lp.isfinite().sum(-1).max().clamp(min=1))
    ln_n = math.log(n)
    relative_sum = gamma(n) + 2 * exp_ulps * u + u * ln_n
    return 2 * u * lp.abs() + relative_sum / (1 - relative_sum) + 2 * u * ln_n + u * (scale + ln_n)


# --- whole forwards ---------------------------------------------------------------------------------

#: Single roundings per layer on a logit's path besides the accumulations: two residual adds, RoPE
#: (two products and a sum), each norm's scaling and weight (two each), SiLU's exp and quotient and
#: its product with up, the softmax's exp and division.
_ELEMENTWISE_PER_LAYER = 16


def float32_terms(config, context: int) -> int:
    """K: the terms summed in float32 along one logit's path through a forward over `context` positions.

    Per layer: the norm's sum of squares and the QKV projection (hidden each), a score (head_dim), the
    softmax's sum and the values' weighted sum (context each), the output projection (heads * head_dim),
    the second norm and gate/up (hidden each), down (intermediate), and the single roundings. Then the
    final norm and the lm_head (hidden each).
    """
    hidden, heads, head_dim = config.hidden_size, config.num_heads, config.head_dim
    per_layer = (4 * hidden + head_dim + 2 * context + heads * head_dim + config.intermediate_size
                 + _ELEMENTWISE_PER_LAYER)
    return config.num_layers * per_layer + 2 * hidden


#: Roundings to bfloat16 per layer on a logit's path when the model runs in bfloat16 (matmuls sum in
#: float32 inside, which `float32_terms` covers): the two residual adds; each norm's cast and weight
#: product (two each); the four weight matrices (rounded once at load) and the four projections'
#: outputs; RoPE's output; attention (its scores, probabilities and output); SiLU and its product.
_BFLOAT16_PER_LAYER = 2 + 4 + 4 + 4 + 1 + 3 + 2


def bfloat16_roundings(config) -> int:
    """R: bfloat16 roundings along one logit's path; past the layers: the embedding's weights, the final
    norm's two, the lm_head's weights and its output."""
    return config.num_layers * _BFLOAT16_PER_LAYER + 5


def logits_tolerance(config, context: int, logits: torch.Tensor, dtype: torch.dtype = torch.float32,
                     *, sides: int = 2) -> float:
    """How far `sides` forwards of one model (each in float32, or one in `dtype` against exact/float32
    ones) may put a logit apart, when they differ only in where and in what order they round.

    Each side's error is LAMBDA * sqrt(K) * u_float32 (+ LAMBDA * sqrt(R) * u_dtype for a bfloat16 or
    float16 side) of the logits' scale, the largest |logit|: every layer's input is renormalised, so a
    relative error carries through a layer without growing, and lands on the logits relative to their
    size. Two float32 sides (ours and a reference, two schedules of ours) count twice; a lower-precision
    side against float32 counts its own roundings once and float32's twice.
    """
    scale = float(logits.detach().abs().max())
    u32 = unit_roundoff(torch.float32)
    per_side = LAMBDA * math.sqrt(float32_terms(config, context)) * u32
    tolerance = sides * per_side
    if dtype != torch.float32:
        tolerance += LAMBDA * math.sqrt(bfloat16_roundings(config)) * unit_roundoff(dtype)
    return tolerance * scale


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, config, context: int,
                        dtype: torch.dtype = torch.float32, *, sides: int = 2, note: object = "") -> None:
    """`got` and `want` within `logits_tolerance` (measured from `want`'s scale)."""
    tolerance = logits_tolerance(config, context, want, dtype, sides=sides)
    worst = float((got.detach().cpu().double() - want.detach().cpu().double()).abs().max())
    assert worst <= tolerance, f"{note}: logits {worst:.3g} apart, tolerance {tolerance:.3g}"


def assert_decisive(logits_per_step: list[torch.Tensor], config, context: int, note: object = "") -> None:
    """Every step of a greedy continuation is decided by the arithmetic, not by where a side rounds.

    `logits_per_step[i]`: one float32 evaluation's logits for the token at position `context + i`. Each float32
    forward is within half of `logits_tolerance` of the exact logits, so a top-two margin wider than
    twice the tolerance here is still positive in every other float32 evaluation: any two pick the
    same token, and a test may compare greedy tokens for equality.
    """
    for i, logits in enumerate(logits_per_step):
        top = logits.detach().double().flatten().topk(2).values
        tolerance = logits_tolerance(config, context + i, logits)
        assert float(top[0] - top[1]) > 2 * tolerance, (
            f"{note}: step {i}'s top two logits are {float(top[0] - top[1]):.3g} apart, within twice the "
            f"tolerance {tolerance:.3g}: another machine could pick the other token")


def assert_same_linear(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`got` is `F.linear(x, weight, bias)` up to the two sides' summation orders and output roundings."""
    want = F.linear(x, weight, bias)
    # Both sides sum the k products in float32, in their own order (gamma_{k+1} of the magnitudes, the
    # bias included, each), then round to the output dtype, at most twice (once more if the bias is
    # added after); in fp32 that rounding is the accumulator's own, already counted in gamma.
    magnitudes = x.float().abs() @ weight.float().abs().T + (0 if bias is None else bias.float().abs())
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    rounding = 0.0
    if got.dtype != torch.float32:
        rounding = steps(2, exact, got.dtype) + steps(2, want.float(), got.dtype)
    bound = 2 * gamma(x.shape[-1] + 1) * magnitudes.double() + rounding
    assert bool(((got.double() - want.double()).abs() <= bound).all())
