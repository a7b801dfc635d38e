"""What a tick costs in time, learnt while the worker runs, and how many prompt tokens fit a step target.

A token budget alone (`max_batch_tokens`) bounds a tick's work in tokens, but
a token of prefill costs different time on different machines, dtypes and
context lengths: a 1,024-token mixed forward took 2 s on a 2-core CPU in fp32,
and every decoding row waited those 2 s for its next token. Stall-free
schedulers bound the step in time instead: they know what a prompt token costs
and admit only as many as keep a decode step under a latency target.

`StepCostModel` learns that cost from the ticks themselves. A tick's time is
close to linear in what it holds, `t = fixed + per_row * rows + per_token *
prompt_tokens` (the weights are read once per forward; each row and each
prompt token adds its matmul rows and attention), so the model fits those
three coefficients by weighted least squares over every tick, forgetting old
ticks geometrically so that it follows the machine's load and the context
lengths being served. `prompt_allowance` inverts the fit: the prompt tokens
that keep a tick with `rows` decoding rows under the target.

It only caps ticks that have rows decoding: a tick of prompts alone stalls
nobody, runs at the full token budget, and teaches the model what a prompt
token costs. Until the fit has seen prompt tokens it allows everything (the
token budget still applies), and the caller keeps the `MIN_PREFILL_CHUNK`
floor, so prompts always advance. Pure Python over floats: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Weight of the past per tick: about the last 30 ticks of each kind count.
FORGETTING = 0.97
#: Feature scales, so that the three coefficients are of similar size (seconds per 100 rows, per 1,000 tokens).
_ROW_SCALE = 100.0
_TOKEN_SCALE = 1000.0
#: A ridge that keeps the equations solvable before every coefficient has been informed (it pulls an
#: uninformed coefficient to 0, which `prompt_allowance` reads as "not known yet").
_RIDGE = 1e-9
#: Ticks holding prompt tokens the fit must have seen before it caps anything.
MIN_PROMPT_TICKS = 3

Matrix = list[list[float]]


def _zeros() -> Matrix:
    return [[0.0] * 3 for _ in range(3)]


def _solve(a: Matrix, b: list[float]) -> list[float]:
    """a x = b for a symmetric positive definite 3x3 `a` (Gaussian elimination; no pivoting needed)."""
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for k in range(3):
        for i in range(k + 1, 3):
            f = m[i][k] / m[k][k]
            for j in range(k, 4):
                m[i][j] -= f * m[k][j]
    x = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        x[i] = (m[i][3] - sum(m[i][j] * x[j] for j in range(i + 1, 3))) / m[i][i]
    return x


@dataclass(slots=True)
class _Equations:
    """Weighted least-squares normal equations of one kind of tick, older ticks weighted down."""

    gram: Matrix = field(default_factory=_zeros)
    moment: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])

    def add(self, x: tuple[float, float, float], seconds: float) -> None:
        for i in range(3):
            self.moment[i] = FORGETTING * self.moment[i] + x[i] * seconds
            for j in range(3):
                self.gram[i][j] = FORGETTING * self.gram[i][j] + x[i] * x[j]


@dataclass(slots=True)
class StepCostModel:
    """Seconds a tick takes as a function of its decoding rows and prompt tokens (module docstring).

    The fit is weighted least squares over two kinds of tick kept apart: ticks with prompt tokens,
    each weighted FORGETTING**(prompt ticks since), and ticks without, weighted FORGETTING**(such
    ticks since). Only prompt ticks inform the per-token cost, so a long run of decode-only ticks
    must not forget it: each kind is forgotten only by newer ticks of its kind. Both sets of
    equations are sums of positive terms, so the fit stays exact however long it runs.
    """

    coef: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _prompt: _Equations = field(default_factory=_Equations)
    _decode: _Equations = field(default_factory=_Equations)
    prompt_ticks: int = 0

    def observe(self, rows: int, prompt_tokens: int, seconds: float) -> None:
        """Fold one tick's measured time into the fit."""
        if (rows == 0 and prompt_tokens == 0) or not seconds >= 0.0 or seconds == float("inf"):
            return
        x = (1.0, rows / _ROW_SCALE, prompt_tokens / _TOKEN_SCALE)
        (self._prompt if prompt_tokens else self._decode).add(x, seconds)
        gram = [[self._prompt.gram[i][j] + self._decode.gram[i][j] + (_RIDGE if i == j else 0.0)
                 for j in range(3)] for i in range(3)]
        self.coef = _solve(gram, [p + d for p, d in zip(self._prompt.moment, self._decode.moment)])
        if prompt_tokens:
            self.prompt_ticks += 1

    def predict(self, rows: int, prompt_tokens: int) -> float:
        """The fit's seconds for a tick of `rows` decoding rows and `prompt_tokens` prompt tokens."""
        return self.coef[0] + self.coef[1] * rows / _ROW_SCALE + self.coef[2] * prompt_tokens / _TOKEN_SCALE

    def seconds_per_prompt_token(self) -> float:
        return self.coef[2] / _TOKEN_SCALE

    def prompt_allowance(self, rows: int, target_seconds: float) -> int | None:
        """Prompt tokens a tick with `rows` decoding rows may hold and stay under `target_seconds`.

        None when no cap applies: no row is decoding, or the fit does not know yet what a prompt token
        costs. 0 when the decode step alone reaches the target (the caller's floor still advances a prompt).
        """
        per_token = self.seconds_per_prompt_token()
        if rows == 0 or self.prompt_ticks < MIN_PROMPT_TICKS or not per_token > 0.0:
            return None
        left = target_seconds - self.predict(rows, 0)
        return max(0, int(left / per_token))

    def tick_tokens(self, max_batch_tokens: int, rows: int, target_ms: int | None) -> int:
        """The token budget of a tick with `rows` decoding rows: `max_batch_tokens`, lowered to what keeps the
        tick under `target_ms` once the fit knows (None: no time target)."""
        if target_ms is None:
            return max_batch_tokens
        allowance = self.prompt_allowance(rows, target_ms / 1000.0)
        return max_batch_tokens if allowance is None else min(max_batch_tokens, rows + allowance)
