"""`GrammarLimits`: what one request's structured output may cost, and the refusals past each bound.

Shared vocabulary (no torch, no llguidance), so the CLI can show the defaults and every layer can quote
them. The grammar engine (`runtime.sampling.grammar`, `grammar_compiler`) enforces them:

* `compile_ms`, `first_masks_ms`: CPU milliseconds a spec's compile, and the first `PROBED_MASKS` masks of
  its grammar, may take on the caller's thread (a prepare thread over HTTP), measured as that thread's CPU
  time so that a busy machine does not refuse a cheap spec. Past either, the spec is refused with a 400
  naming the request field that said it (`GrammarTooCostly`), before anything is queued.
* `mask_deadline_ms`: how long the worker waits, once a step's forward is done (or the row's mask has
  started, if later), for a row's grammar mask; a row whose mask is later, and has used half of it in CPU,
  ends with `GrammarTooSlow` (its own error), and the step goes on without it; no row is waited for past
  four times it (`runtime.sampling.mask_pool`, which also bounds the threads late masks leave running).
* `live_bytes`, `client_live_bytes`: bytes of spec text the compiled grammars alive at once may have, in
  all and per client (an API key's tenant, else the client's address): a new spec past either is refused
  as busy (503; cached grammars no request holds are evicted first, and a client's share is checked before
  its spec is compiled), so one client's long requests with big schemas fill only its own share.
* `gbnf_ms`: CPU milliseconds a GBNF grammar's conversion to Lark may take; it runs in a process of its
  own, killed past it or when the client leaves (`runtime.sampling.gbnf`).

Why these defaults (measured on a 2-vCPU Xeon, the default model's 49k vocabulary): realistic schemas'
first masks take 0.1-2 ms, and the costliest shape the compile bounds admit (2,000 optional properties)
17 ms, where `(x{300}){300}` takes 140 ms and `(x{600}){600}` 0.5-0.8 s (then 0.1 s for each later
token); 50 ms sits between. The costliest compile the symbol bound admits takes about 0.7 s, a realistic
212 KB schema 0.1-0.2 s: 2 s refuses only what would be slower still. A mask of a grammar that passed the
probe takes under 1 ms per step; 200 ms past the forward (a row charged once its mask has used 100 ms of
CPU, 100x that) only cuts a grammar that got costly later on, and bounds what any step waits to 800 ms. A
cheap one whose thread a loaded machine was slow to schedule is not cut, since a row is charged for its
mask's CPU (200 ms of wall alone cut such rows, on two shared cores).
The GBNF converter is quadratic in the worst case (a chain of rules: 77 KB took seconds); real grammars
convert in milliseconds, so 1 s leaves them 100x.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ferrox_batch.errors import DecodeError, GrammarConstraint, InvalidRequest

#: How many of a grammar's first masks the compile probe computes (following the lowest allowed token).
PROBED_MASKS = 3
DEFAULT_COMPILE_MS = 2000
DEFAULT_FIRST_MASKS_MS = 50
DEFAULT_MASK_DEADLINE_MS = 200
#: About 200 MB compiled for typical schemas (about 50 bytes compiled per byte of text).
DEFAULT_LIVE_BYTES = 4 * 1024 * 1024
#: A client's share: four clients at their share fill the server's.
DEFAULT_CLIENT_LIVE_BYTES = 1024 * 1024
DEFAULT_GBNF_MS = 1000

#: Each `GrammarLimits` field's `serve` flag; a Ray Serve config file's key is the flag in snake case
#: (`deploy.serve_args`).
LIMIT_FLAGS: Mapping[str, str] = MappingProxyType({
    "compile_ms": "--grammar-compile-ms",
    "first_masks_ms": "--grammar-first-masks-ms",
    "mask_deadline_ms": "--grammar-mask-deadline-ms",
    "live_bytes": "--max-live-grammar-bytes",
    "client_live_bytes": "--max-client-grammar-bytes",
    "gbnf_ms": "--grammar-gbnf-ms",
})


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """The bounds on one request's structured output (module docstring)."""

    compile_ms: int = DEFAULT_COMPILE_MS
    first_masks_ms: int = DEFAULT_FIRST_MASKS_MS
    mask_deadline_ms: int = DEFAULT_MASK_DEADLINE_MS
    live_bytes: int = DEFAULT_LIVE_BYTES
    client_live_bytes: int = DEFAULT_CLIENT_LIVE_BYTES
    gbnf_ms: int = DEFAULT_GBNF_MS

    def __post_init__(self) -> None:
        for name in LIMIT_FLAGS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


class GrammarTooCostly(InvalidRequest):
    """A spec whose compile or first masks cost more than this server's budget: the client's 400, naming the
    field that said it and the limit."""

    error_code = "grammar_too_costly"


class GrammarTooSlow(GrammarConstraint):
    """A row's grammar mask was not ready within the worker's deadline: that row ends with this error, the
    others go on."""

    error_code = "grammar_too_slow"


def too_costly(field: str | None, what: str, spent_ms: float, limit_ms: int, flag: str) -> GrammarTooCostly:
    return GrammarTooCostly(field or "structured_outputs", f"{spent_ms:.0f} ms",
                            f"asks for a {what} costlier than this server's limit of {limit_ms} ms of CPU "
                            f"(set by its operator with {flag})")


def too_slow(deadline_ms: int) -> DecodeError:
    return GrammarTooSlow(f"its grammar's next mask took longer than this server's deadline of {deadline_ms} ms "
                          "(--grammar-mask-deadline-ms)")
