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
  the tokenizer, the whole cost of a new schema. A spec past the limits below, or invalid, is a
  `GrammarConstraint` (400) before anything is queued. JSON is compact (no free whitespace between
  tokens: a small model given the choice fills it with spaces).
* `Grammars.matcher(compiled)` is one row's parser state, made on the worker when the row first samples:
  a copy of the compiled grammar's matcher, which is never advanced itself. A copy costs microseconds
  where a build costs up to a second (a 0.9 MB schema: 0.03 ms against 0.4 s; docs/benchmarks.md, "The
  grammar engine"), so the worker never compiles.
* Compiled grammars are kept by spec (its canonical text: equal schemas are one entry), so the `n` choices
  of a request and a client that repeats its schema compile once, and concurrent compiles of one new spec
  wait for the first instead of building it again. The cache is bounded in entries and in bytes of spec
  text; the compiled state measured about 50 times its text (a 212 KB schema: 10 MB), and up to 300
  times for the costliest shape below (25 KB: 7 MB), which `COMPILED_KEPT` bounds. A request holds its
  compiled grammar from submit to answer, so the grammars alive (cached or held) are bounded too:
  `GrammarLimits.live_bytes` of spec text in all, and `client_live_bytes` per client (`grammar_clients`),
  past which a new spec is refused as busy (`GrammarsBusy`, 503).
* What a spec may cost is `GrammarLimits` (`ferrox_batch.grammar_limits`): its compile and its first masks
  are timed here, on the caller's thread (`grammar_probe`), and a spec past either budget is refused with a
  400 naming its field (`GrammarTooCostly`; remembered, so a repeat is refused without compiling). A GBNF
  grammar is converted to Lark in a process of its own, within a time limit (`gbnf`).
* `start_masks(matchers)` starts each constrained row's next mask on a thread of its own while the forward
  runs, collected within the worker's deadline (`mask_pool`: a late row fails alone); `masks(matchers,
  device)` computes them in one llguidance call, waiting for all. Both come as a `[rows, vocab]` bool
  tensor (bits unpacked with torch ops).
* The engine's tokenizer is the checkpoint's own (its `tokenizer.json` text), built on first use (about a
  second) and shared; its end tokens are the model's stop tokens, allowed exactly where the grammar may end.

Limits on a compile, and why these (measured on a 2-vCPU Xeon shared with other work):

* `MAX_SPEC_BYTES` (`structured`, 256 KiB of canonical text), checked before anything is compiled: real
  tool and response schemas are a few KB and large ones about 100 KB; a realistic schema of 212 KB builds
  in 0.1-0.2 s.
* `MAX_GRAMMAR_SYMBOLS`, llguidance's `max_grammar_size`: bytes alone do not bound the work. No llguidance
  limit bounds the build's time directly (its lexer fuel counts regex set-up, which stays small): an object
  of a few thousand optional properties is 30-60 KB but builds in time that grows with the square of their
  count (2,300: 0.5-0.7 s; 4,500: 2.3 s). Its symbols grow with that count, and llguidance checks them
  before the costly part, so a cap on symbols refuses it in milliseconds. 16,384 symbols holds that worst
  shape to about 0.7 s, and is 1.7x what a realistic schema at the byte limit has (about 37 symbols per
  KB: 9,500). Lexer fuel stays at llguidance's default (1,000,000, about 20 ms of regex set-up), as do the
  per-token step limits; they do not bound a mask's forced-token search, which the probe and the worker's
  deadline do.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
from llguidance import grammar_from
import llguidance.numpy
import numpy as np
import torch

from ferrox_batch.cancel import CancelToken
from ferrox_batch.errors import DecodeError, GrammarConstraint
from ferrox_batch.grammar_limits import PROBED_MASKS, GrammarLimits, too_costly
from ferrox_batch.runtime.sampling.gbnf import GbnfConverter, GbnfTimeout
from ferrox_batch.runtime.sampling.grammar_clients import ClientShares, GrammarsBusy, HeldGrammar
from ferrox_batch.runtime.sampling.grammar_probe import first_masks_cpu_s
from ferrox_batch.runtime.sampling.mask_pool import MaskPool, PendingMasks
from ferrox_batch.structured import MAX_SPEC_BYTES, StructuredOutput

__all__ = ["COMPILED_BYTES", "COMPILED_KEPT", "MAX_GRAMMAR_SYMBOLS", "CompiledGrammar", "Grammars", "GrammarsBusy",
           "HeldGrammar"]

#: How many compiled grammars are kept at most.
COMPILED_KEPT = 32
#: How many bytes of spec text the kept grammars may have together (about 100 MB compiled): eight schemas
#: at the byte limit, or `COMPILED_KEPT` small ones.
COMPILED_BYTES = 2 * 1024 * 1024
#: How many specs refused as too costly are remembered (by their text), so a client that repeats one is
#: refused without compiling or probing it again.
REFUSED_KEPT = 256
#: The most grammar symbols a spec may compile to (llguidance's `max_grammar_size`; module docstring).
MAX_GRAMMAR_SYMBOLS = 16_384
#: Fuel for a compile's regex set-up: llguidance's default, about 20 ms.
INITIAL_LEXER_FUEL = 1_000_000
#: JSON compiled compact: separators without spaces, no free whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class CompiledGrammar:
    """A spec compiled for one tokenizer: what a request carries from its submit to the worker."""

    spec: StructuredOutput
    size: int  # bytes of the spec's text: its weight in the cache
    tokenizer: llguidance.LLTokenizer  # the engine's, which `Grammars.matcher` checks
    start: llguidance.LLMatcher  # the grammar at its start, never advanced: each row gets a copy


class Grammars:
    """The grammar engine for one tokenizer: compiles specs and makes matchers (thread-safe).

    `keep`, `keep_bytes`: the compiled cache's bounds, in entries and in bytes of spec text."""

    def __init__(self, tokenizer_json: str, vocab_size: int, end_tokens: Sequence[int], *,
                 keep: int = COMPILED_KEPT, keep_bytes: int = COMPILED_BYTES, live_bytes: int | None = None,
                 limits: GrammarLimits = GrammarLimits()) -> None:
        self._json = tokenizer_json
        self.vocab_size = vocab_size
        self._ends = sorted(set(end_tokens))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._engine_lock = threading.Lock()
        self._limits = llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS,
                                                 initial_lexer_fuel=INITIAL_LEXER_FUEL)
        self._keep = keep
        self._keep_bytes = keep_bytes
        # Reentrant: dropping a compiled grammar inside it (the cache evicting one) runs its finalizer, which
        # takes it again to uncount its bytes.
        self._lock = threading.RLock()  # guards the cache, the builds in flight and the live bytes
        self._kept: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()  # oldest first
        self._kept_bytes = 0
        self._pending: dict[StructuredOutput, concurrent.futures.Future[CompiledGrammar]] = {}
        self.limits = limits
        self._live_limit = limits.live_bytes if live_bytes is None else live_bytes
        self._clients = ClientShares(limits.client_live_bytes)
        self._gbnf = GbnfConverter(limits.gbnf_ms / 1000)
        #: Specs refused as too costly: (what was costly, CPU ms it took, the limit, its flag), oldest first.
        self._refused: OrderedDict[StructuredOutput, tuple[str, float, int, str]] = OrderedDict()
        self._pool = MaskPool(self.fill_row, (vocab_size + 31) // 32, limits.mask_deadline_ms / 1000)
        self._live = 0  # bytes of spec text of the compiled grammars alive (guarded by `_lock`)
        #: Every compiled grammar alive, kept or not: a spec a request still holds is never built twice.
        self._alive: weakref.WeakValueDictionary[StructuredOutput, CompiledGrammar] = weakref.WeakValueDictionary()

    def _engine(self) -> tuple[llguidance.LLTokenizer, llguidance.LLExecutor]:
        with self._engine_lock:
            if self._tokenizer is None or self._executor is None:
                self._tokenizer = llguidance.LLTokenizer(self._json, n_vocab=self.vocab_size,
                                                         eos_token=self._ends or None)
                self._executor = llguidance.LLExecutor()
            return self._tokenizer, self._executor

    def compile(self, spec: StructuredOutput, cancel: CancelToken | None = None) -> CompiledGrammar | HeldGrammar:
        """`spec` compiled, or `GrammarConstraint` naming what is wrong: over `MAX_SPEC_BYTES` (refused
        before any compiling), over the compile-work limits, or invalid; `GrammarTooCostly` (naming
        `spec.source`) when its compile or first masks cost more CPU than `limits` allow. A kept spec is
        answered from the cache; a spec another thread is compiling is waited for. `cancel`: the request's
        token (a GBNF conversion stops when it is cancelled).

        A spec that names its `client` comes back as that client's `HeldGrammar`, priced against the
        client's share of the live-grammar budget (`grammar_clients`) while its request holds it."""
        if spec.client is None:
            return self._compiled(spec, cancel)
        # Priced to its client before it is built: a client's builds in flight must not fill the pool.
        self._clients.take(spec.client, spec, spec.size)
        try:
            compiled = self._compiled(spec, cancel)
        except BaseException:
            self._clients.release(spec.client, spec, spec.size)
            raise
        return self._clients.handle(spec.client, compiled)

    def _compiled(self, spec: StructuredOutput, cancel: CancelToken | None) -> CompiledGrammar:
        size = spec.size
        if size > MAX_SPEC_BYTES:
            raise GrammarConstraint(f"the {_what(spec)} is {size} bytes as compact text, over this server's "
                                    f"limit of {MAX_SPEC_BYTES}")
        with self._lock:
            refused = self._refused.get(spec)
            if refused is not None:
                raise too_costly(spec.source, *refused)
            known = self._kept.get(spec)
            if known is not None:
                self._kept.move_to_end(spec)
                return known
            known = self._alive.get(spec)
            if known is not None:
                self._remember(known)
                return known
            pending = self._pending.get(spec)
            if pending is None:
                if self._live + size > self._live_limit:
                    raise GrammarsBusy(self._live, self._live_limit)
                self._live += size  # counted from the build on, so concurrent builds count too
                pending = self._pending[spec] = concurrent.futures.Future()
                building = True
            else:
                building = False
        if not building:
            return pending.result()  # the builder's grammar, or its refusal raised here too
        try:
            compiled = self._build(spec, size, cancel)
        except BaseException as failed:
            with self._lock:
                del self._pending[spec]
                self._live -= size
            pending.set_exception(failed)
            raise
        # Its bytes stay counted while anything (the cache, a request) holds it.
        weakref.finalize(compiled, self._forget, size)
        with self._lock:
            del self._pending[spec]
            self._alive[spec] = compiled
            self._remember(compiled)
        pending.set_result(compiled)
        return compiled

    def _build(self, spec: StructuredOutput, size: int, cancel: CancelToken | None) -> CompiledGrammar:
        tokenizer, _ = self._engine()
        text = spec.schema or ""
        if spec.kind == "grammar":  # GBNF converted in a process of its own; Lark as it is
            try:
                text = self._gbnf.to_lark(text, cancel)
            except GbnfTimeout:
                raise self._costly(spec, "GBNF grammar whose conversion is", self.limits.gbnf_ms,
                                   self.limits.gbnf_ms, "--grammar-gbnf-ms") from None
        began = time.thread_time()
        try:
            if spec.kind in ("json_object", "json_schema"):
                schema = spec.schema if spec.schema is not None else spec.schema_object()
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            else:
                # Lark as it is (a converted GBNF grammar too); a regex or a choice as llguidance writes them.
                grammar = grammar_from(_FORMATS[spec.kind], text)
            if spec.reasoning is not None:
                grammar = _after_thinking(grammar, spec.reasoning)
        except Exception as bad:  # noqa: BLE001 - the converter raises what its parser meets: the client's 400
            raise GrammarConstraint(f"the {_what(spec)} cannot be compiled: {bad}") from None
        # The build drops the GIL: the worker's Python runs on meanwhile. It runs on this thread, whose CPU
        # time is what it cost.
        start = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
        if start.is_error():
            raise GrammarConstraint(f"the {_what(spec)} cannot be compiled: {start.get_error()}")
        spent = (time.thread_time() - began) * 1e3
        if spent > self.limits.compile_ms:
            raise self._costly(spec, f"{_what(spec)} whose compile is", spent, self.limits.compile_ms,
                               "--grammar-compile-ms")
        budget = self.limits.first_masks_ms
        spent = first_masks_cpu_s(start, self.vocab_size, PROBED_MASKS, budget / 1e3) * 1e3
        if spent > budget:
            raise self._costly(spec, f"{_what(spec)} whose first masks are", spent, budget, "--grammar-first-masks-ms")
        return CompiledGrammar(spec, size, tokenizer, start)

    def _costly(self, spec: StructuredOutput, what: str, spent_ms: float, limit_ms: int, flag: str) -> DecodeError:
        """The refusal of a spec too costly to follow, remembered so that a repeat costs nothing."""
        with self._lock:
            self._refused[spec] = (what, spent_ms, limit_ms, flag)
            while len(self._refused) > REFUSED_KEPT:
                self._refused.popitem(last=False)
        return too_costly(spec.source, what, spent_ms, limit_ms, flag)

    def _remember(self, compiled: CompiledGrammar) -> None:
        """Keep `compiled`, dropping the oldest past either bound (it too, when it alone is past them)."""
        self._kept[compiled.spec] = compiled
        self._kept_bytes += compiled.size
        while self._kept and (len(self._kept) > self._keep or self._kept_bytes > self._keep_bytes):
            _, dropped = self._kept.popitem(last=False)
            self._kept_bytes -= dropped.size

    def _forget(self, size: int) -> None:
        with self._lock:
            self._live -= size

    def live(self) -> int:
        """Bytes of spec text of the compiled grammars alive now (cached or held by requests)."""
        with self._lock:
            return self._live

    def kept(self) -> tuple[int, int]:
        """(entries, bytes of spec text) the compiled cache holds now."""
        with self._lock:
            return len(self._kept), self._kept_bytes

    def held(self, client: str) -> int:
        """Bytes of spec text `client`'s requests hold now (its share's use)."""
        return self._clients.held(client)

    def matcher(self, compiled: CompiledGrammar | HeldGrammar) -> llguidance.LLMatcher:
        """A new row's parser state: a copy of `compiled` at its start (never a compile)."""
        if isinstance(compiled, HeldGrammar):
            compiled = compiled.compiled
        if compiled.tokenizer is not self._tokenizer:
            raise GrammarConstraint("the grammar was compiled for another tokenizer")
        return compiled.start.deep_copy()

    def masks(self, matchers: Sequence[llguidance.LLMatcher], device: torch.device) -> torch.Tensor:
        """`[len(matchers), vocab_size]` bool: True where a token keeps the row's output in its grammar."""
        _, executor = self._engine()
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
        """Stop the mask threads."""
        self._pool.close()


def _after_thinking(grammar: str, reasoning: str) -> str:
    """`grammar` (llguidance's top-level JSON) after free thinking that ends with `</think>`: the thinking is a
    lazy lexeme stopped by the end tag; `tagged`, only when the output opens with `<think>`."""
    top = json.loads(grammar)
    inner = top.get("grammars") or []
    if len(inner) != 1:
        raise ValueError("a grammar of several parts cannot follow a reasoning model's thinking")
    answer = {**inner[0], "name": "answer"}
    start = "think @answer" if reasoning == "implicit" else "(\"<think>\" think)? @answer"
    lark = f'start: {start}\nthink[stop="</think>"]: /(?s:.*)/\n'
    return json.dumps({"grammars": [{"name": "start", "lark_grammar": lark}, answer]})


#: Our kinds -> llguidance's `grammar_from` formats.
_FORMATS = {"lark": "lark", "grammar": "grammar", "regex": "regex", "choice": "choice"}
_NAMES = {"lark": "Lark grammar", "grammar": "grammar", "regex": "regular expression", "choice": "choice"}


def _what(spec: StructuredOutput) -> str:
    return _NAMES.get(spec.kind, "JSON schema")
