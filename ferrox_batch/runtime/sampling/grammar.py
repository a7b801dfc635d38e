"""Grammar-constrained decoding with llguidance: JSON mode and JSON schemas as per-row token masks.

Why llguidance (and not xgrammar, the other engine vLLM and SGLang use): it is one self-contained wheel with
no dependencies, where xgrammar requires transformers and triton at run time (a CPU server would install
both for nothing); its Lark grammars embed JSON schemas (a forced tool call); and although xgrammar's masks
measured 2-4x faster here, both take microseconds per row per token, far under a decode step's cost
(docs/benchmarks.md, "The grammar engine").

What it promises:

* `Grammars.compile(spec)` turns a `StructuredOutput` (a JSON schema, JSON mode, or a Lark grammar with
  embedded schemas: forced tool calls) into a `CompiledGrammar` on the caller's thread (a request's
  submit; over HTTP a prepare thread): the schema translated and llguidance's lexer and parser built for
  the tokenizer, the whole cost of a new schema. A spec past its limits (`grammar_compiler`), or invalid, is a
  `GrammarConstraint` (400) before anything is queued. JSON is compact (no free whitespace between
  tokens: a small model given the choice fills it with spaces).
* `Grammars.matcher(compiled)` is one row's parser state, made on the worker when the row first samples:
  a copy of the compiled grammar's matcher, which is never advanced itself. A copy costs microseconds
  where a build costs up to a second (a 0.9 MB schema: 0.03 ms against 0.4 s; docs/benchmarks.md, "The
  grammar engine"), so the worker never compiles.
* Compiling, the cache of compiled grammars, the live-grammar budget and what a spec may cost
  (`GrammarLimits`: its compile and first masks timed on the caller's thread, a GBNF grammar converted in a
  process of its own) are `grammar_compiler`'s. Here a spec is also priced against its client's share of
  the live-grammar budget (`grammar_clients`), and refused as busy while late masks still run (`mask_pool`).
* `start_masks(matchers)` starts each constrained row's next mask on a thread of its own while the forward
  runs, collected within the worker's deadline (`mask_pool`: a late row fails alone); `masks(matchers,
  device)` computes them in one llguidance call, waiting for all. Both come as a `[rows, vocab]` bool
  tensor (bits unpacked with torch ops).
* The engine's tokenizer is the checkpoint's own (its `tokenizer.json` text), built on first use (about a
  second) and shared; its end tokens are the model's stop tokens, allowed exactly where the grammar may end.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np
import torch

from ferrox_batch.cancel import CancelToken
from ferrox_batch.errors import GrammarConstraint
from ferrox_batch.grammar_limits import GrammarLimits
from ferrox_batch.runtime.sampling.grammar_clients import ClientShares, GrammarsBusy, HeldGrammar
from ferrox_batch.runtime.sampling.grammar_compiler import (
    COMPILED_BYTES,
    COMPILED_KEPT,
    JSON_OPTIONS,
    MAX_GRAMMAR_SYMBOLS,
    CompiledGrammar,
    GrammarCompiler,
)
from ferrox_batch.runtime.sampling.mask_pool import MaskPool, MasksBusy, PendingMasks
from ferrox_batch.structured import StructuredOutput

__all__ = ["COMPILED_BYTES", "COMPILED_KEPT", "JSON_OPTIONS", "MAX_GRAMMAR_SYMBOLS", "CompiledGrammar", "Grammars",
           "GrammarsBusy", "HeldGrammar", "MasksBusy"]

#: Seconds `close` waits for late mask threads to end (each ends when its mask does).
CLOSE_LATE_S = 10.0


class Grammars:
    """The grammar engine for one tokenizer: compiles specs and makes matchers and masks (thread-safe).

    `keep`, `keep_bytes`, `live_bytes`: the compiled cache's bounds (`grammar_compiler.GrammarCompiler`)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, end_tokens: Sequence[int], *,
                 keep: int = COMPILED_KEPT, keep_bytes: int = COMPILED_BYTES, live_bytes: int | None = None,
                 limits: GrammarLimits = GrammarLimits()) -> None:
        self.vocab_size = vocab_size
        self.limits = limits
        self._compiler = GrammarCompiler(tokenizer_json, vocab_size, end_tokens, keep=keep, keep_bytes=keep_bytes,
                                         live_bytes=live_bytes, limits=limits)
        self._clients = ClientShares(limits.client_live_bytes)
        self._pool = MaskPool(self.fill_row, (vocab_size + 31) // 32, limits.mask_deadline_ms / 1000)

    def compile(self, spec: StructuredOutput, cancel: CancelToken | None = None) -> CompiledGrammar | HeldGrammar:
        """`spec` compiled, or `GrammarConstraint` naming what is wrong: over `MAX_SPEC_BYTES` (refused
        before any compiling), over the compile-work limits, or invalid; `GrammarTooCostly` (naming
        `spec.source`) when its compile or first masks cost more CPU than `limits` allow; `MasksBusy` (503)
        while too many late masks still run. A kept spec is answered from the cache; a spec another thread
        is compiling is waited for. `cancel`: the request's token (a GBNF conversion stops when it is
        cancelled).

        A spec that names its `client` comes back as that client's `HeldGrammar`, priced against the
        client's share of the live-grammar budget (`grammar_clients`) while its request holds it."""
        self._pool.check_room()
        if spec.client is None:
            return self._compiler.compile(spec, cancel)
        self._compiler.check(spec)  # a spec refused whatever the budget is a 400, not a 503 of the share
        reservation = self._clients.reserve(spec.client, spec)
        try:
            return HeldGrammar(self._compiler.compile(spec, cancel), reservation)
        except BaseException:
            reservation.release()
            raise

    def live(self) -> int:
        """Bytes of spec text of the compiled grammars alive now (cached or held by requests)."""
        return self._compiler.live()

    def kept(self) -> tuple[int, int]:
        """(entries, bytes of spec text) the compiled cache holds now."""
        return self._compiler.kept()

    def held(self, client: str) -> int:
        """Bytes of spec text `client`'s requests hold now (its share's use)."""
        return self._clients.held(client)

    def matcher(self, compiled: CompiledGrammar | HeldGrammar) -> llguidance.LLMatcher:
        """A new row's parser state: a copy of `compiled` at its start (never a compile)."""
        if isinstance(compiled, HeldGrammar):
            compiled = compiled.compiled
        if compiled.tokenizer is not self._compiler.tokenizer:
            raise GrammarConstraint("the grammar was compiled for another tokenizer")
        return compiled.start.deep_copy()

    def masks(self, matchers: Sequence[llguidance.LLMatcher], device: torch.device) -> torch.Tensor:
        """`[len(matchers), vocab_size]` bool: True where a token keeps the row's output in its grammar."""
        _, executor = self._compiler.engine()
        words = (self.vocab_size + 31) // 32
        bits = np.zeros((len(matchers), words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bits)
        return self.unpack(bits, device)

    def fill_row(self, matcher: llguidance.LLMatcher, bits: np.ndarray, row: int) -> None:
        """Row `row` of `bits` (`[rows, words]` int32) set to `matcher`'s next mask (llguidance drops the GIL)."""
        llguidance.numpy.fill_next_token_bitmask(matcher, bits, row)

    def start_masks(self, matchers: Sequence[llguidance.LLMatcher]) -> PendingMasks:
        """Start every matcher's next mask on threads of its own (`mask_pool`): collected within the deadline."""
        return self._pool.start(matchers)

    def unpack(self, bits: np.ndarray, device: torch.device) -> torch.Tensor:
        """`[rows, vocab_size]` bool from llguidance's `[rows, words]` bits."""
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = (torch.from_numpy(np.ascontiguousarray(bits)).unsqueeze(-1) >> shifts) & 1
        return allowed.view(bits.shape[0], bits.shape[1] * 32)[:, : self.vocab_size].bool().to(device)

    def close(self) -> None:
        """Stop the mask threads (a late one given `CLOSE_LATE_S` to end)."""
        self._pool.close(CLOSE_LATE_S)
