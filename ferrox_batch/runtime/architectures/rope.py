"""Rotary position embeddings: the cos/sin tables every scaling variant makes, and partial rotation.

A table holds one row per position the model can be served at, computed once per decoder in float32 (as
the reference does) and cast to the compute dtype; a forward only indexes it by position. Every variant
is a table, so the kernels never learn which one a model uses:

* plain, `linear`, `yarn`, `llama3` and `frequency_factors` rotate every position by the same frequencies
  (yarn and longrope also scale the table by their attention factor). `frequency_factors` divides each
  frequency's angle by its own factor, as llama.cpp's rope op does with a file's `rope_freqs` (no attention
  factor: llama.cpp scales its tables only for yarn);
* `dynamic` (NTK) and `longrope` change their frequencies with the length of the sequence. The reference
  picks them from the longest position in the forward, so its answer for one sequence depends on what
  it is batched with. Here row `p` holds what the reference uses when the sequence is `p + 1` long,
  the case of a token decoded alone: the same rotation whatever the batch, and a key once written never
  changes. A prompt entirely within the pretrained context is rotated exactly as the reference does.

Partial rotation (Phi-3 rotates the first `rotary_dim` dimensions of each head and passes the rest) is a
table too: the layer builder reorders each query and key head's dimensions (`rotary_permutation`) so the
rotated pairs sit where a full rotation pairs them, `(i, i + head_dim / 2)`, and the table holds cos 1,
sin 0 for the pairs that pass through. Queries and keys are reordered alike, so their dot products, the
only thing attention reads of them, are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.families.rope_scaling import RopeScaling


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The `dim / 2` frequencies of a variant whose frequencies do not depend on the position."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling)
    if scaling.kind == "yarn":
        return _yarn(dim, theta, scaling)
    if scaling.kind == "frequency_factors":
        return inv_freq / _factors(scaling.frequency_factors, dim)
    raise ValueError(f"{scaling.kind} rope frequencies depend on the position: use rope_tables")


def _factors(factors: tuple[float, ...], dim: int) -> torch.Tensor:
    """One factor per rotated frequency, as float32 (the type llama.cpp stores and computes them in)."""
    if len(factors) != dim // 2:
        raise ValueError(f"{len(factors)} frequency factors for {dim // 2} rotated frequencies")
    return torch.tensor(factors, dtype=torch.float32)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between the two wavelength
    # bounds is interpolated smoothly.
    old_ctx = s.original_max_position_embeddings
    assert old_ctx is not None
    low_wavelen = old_ctx / s.low_freq_factor
    high_wavelen = old_ctx / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    # Frequencies that turn fewer than `beta_slow` times over the pretrained context are interpolated
    # (slowed by `factor`), those that turn more than `beta_fast` times are kept, with a linear ramp between.
    original = s.original_max_position_embeddings
    assert original is not None

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def attention_factor(scaling: RopeScaling | None) -> float:
    """What the variant multiplies its cos/sin tables by (1 but for yarn and longrope)."""
    if scaling is None or scaling.kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if scaling.kind == "longrope":
        original = scaling.original_max_position_embeddings
        assert original is not None
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
    return mscale(factor)


def angles(dim: int, theta: float, scaling: RopeScaling | None, positions: int) -> torch.Tensor:
    """`[positions, dim / 2]` float32 rotation angles: row `p` is position `p`'s."""
    pos = torch.arange(positions, dtype=torch.float32)
    if scaling is not None and scaling.kind == "longrope":
        original = scaling.original_max_position_embeddings
        assert original is not None
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        short = 1.0 / (torch.tensor(scaling.short_factor, dtype=torch.float32) * theta ** shape)
        long = 1.0 / (torch.tensor(scaling.long_factor, dtype=torch.float32) * theta ** shape)
        if short.numel() != dim // 2:
            raise ValueError(f"longrope names {short.numel()} factors for {dim // 2} rotated frequencies")
        # The long factors once the sequence is longer than the pretrained context: from position `original`.
        inv = torch.where((pos >= original)[:, None], long[None, :], short[None, :])
        return pos[:, None] * inv
    if scaling is not None and scaling.kind == "dynamic":
        # The base grows with the sequence past the context the config names; row p: a sequence p + 1 long.
        original = scaling.original_max_position_embeddings or positions
        seq_len = torch.clamp(pos + 1, min=original)
        base = theta * ((scaling.factor * seq_len / original) - (scaling.factor - 1)) ** (dim / (dim - 2))
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv = 1.0 / (base[:, None] ** shape[None, :])
        return pos[:, None] * inv
    if scaling is not None and scaling.kind == "frequency_factors":
        # llama.cpp divides the angle, not the frequency: position times frequency, then over the factor.
        return torch.outer(pos, inverse_frequencies(dim, theta, None)) / _factors(scaling.frequency_factors, dim)
    return torch.outer(pos, inverse_frequencies(dim, theta, scaling))


def rope_tables(config: ModelConfig, kind: str, device: torch.device, dtype: torch.dtype,
                positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cos, sin)` of one RoPE kind (`ModelConfig.rope_kind`), each `[positions, head_dim]` in `dtype` (by
    default every position the model can be served at), in the half-split layout (`apply_rope`); "none"
    rotates by nothing (cos 1, sin 0). Row `p` depends on `p` alone, whatever `positions` is."""
    d, r = config.rope_shape(kind)
    positions = config.max_position_embeddings if positions is None else positions
    if kind == "none":
        return (torch.ones(positions, d, device=device, dtype=dtype),
                torch.zeros(positions, d, device=device, dtype=dtype))
    if kind == "local":
        assert config.local_rope_theta is not None
        theta, scaling = config.local_rope_theta, None
    else:
        theta, scaling = config.rope_theta, config.rope_scaling
    if scaling is not None and scaling.kind == "dynamic" and scaling.original_max_position_embeddings is None:
        raise ValueError("dynamic rope scaling needs the context it stretches")
    if config.proportional_rope and kind != "local":
        # The first r/2 of a whole head's frequencies (the rest pass through), as the reference spaces them.
        freqs = torch.outer(torch.arange(positions, dtype=torch.float32),
                            inverse_frequencies(d, theta, scaling)[: r // 2])
    else:
        freqs = angles(r, theta, scaling, positions)
    # Pairs (i, i + d/2) for i < r/2 rotate; the pairs past them pass through at angle 0 (cos 1, sin 0).
    half = torch.zeros(positions, d // 2)
    half[:, : r // 2] = freqs
    emb = torch.cat((half, half), dim=-1)
    factor = attention_factor(scaling)
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        rotated = torch.zeros(d, dtype=torch.bool)
        rotated[: r // 2] = True
        rotated[d // 2: d // 2 + r // 2] = True
        cos = torch.where(rotated, cos * factor, cos)
        sin = torch.where(rotated, sin * factor, sin)
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


class RopeTables:
    """The cos/sin tables of each RoPE kind a model's layers use, over the positions its forwards have reached.

    A row depends on its own position alone, so the tables grow as the sequences do (doubling, never past
    `max_position_embeddings`) instead of holding every position the config names: what a checkpoint's
    metadata claims allocates nothing at load, and the tables hold at most twice the positions the longest
    sequence so far has reached (and had K/V stored for)."""

    #: Rows computed at load (every position, for a model with fewer).
    INITIAL_ROWS = 4096

    def __init__(self, config: ModelConfig, kinds: Iterable[str], device: torch.device, dtype: torch.dtype) -> None:
        self._config, self._kinds, self._device, self._dtype = config, sorted(set(kinds)), device, dtype
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._compute(min(config.max_position_embeddings, self.INITIAL_ROWS))

    @property
    def rows(self) -> int:
        """How many positions the tables hold."""
        return next(iter(self.tables.values()))[0].shape[0]

    def cover(self, top: int) -> bool:
        """Make the tables hold position `top` (below `max_position_embeddings`); whether they grew."""
        if top < self.rows:
            return False
        self._compute(min(self._config.max_position_embeddings, max(2 * self.rows, top + 1)))
        return True

    def _compute(self, rows: int) -> None:
        self.tables = {kind: rope_tables(self._config, kind, self._device, self._dtype, rows) for kind in self._kinds}


def rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """For each dimension of a reordered head, the reference's dimension it holds: the reference rotates
    pairs `(i, i + rotary_dim / 2)` of its first `rotary_dim` dimensions; reordered, they are the pairs
    `(i, i + head_dim / 2)` a full rotation uses, and the dimensions passed through fill the rest."""
    half, rhalf = head_dim // 2, rotary_dim // 2
    rest = (head_dim - rotary_dim) // 2
    first = list(range(rhalf)) + list(range(rotary_dim, rotary_dim + rest))
    second = list(range(rhalf, rotary_dim)) + list(range(rotary_dim + rest, head_dim))
    assert len(first) == len(second) == half
    return torch.tensor(first + second, dtype=torch.long)


def reorder_heads(weight: torch.Tensor, heads: int, head_dim: int, order: torch.Tensor) -> torch.Tensor:
    """`weight`'s output rows `[heads * head_dim, ...]` with each head's dimensions taken in `order`."""
    rows = weight.reshape(heads, head_dim, *weight.shape[1:])
    return rows[:, order].reshape(weight.shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, head_dim]` by per-token `cos`/`sin` `[T, 1, head_dim]` (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
