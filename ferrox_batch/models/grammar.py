"""Grammar-constrained decoding with llguidance: JSON mode and JSON schemas as per-row token masks.

Why llguidance (and not xgrammar, the other engine vLLM and SGLang use): it is one self-contained wheel with
no dependencies, where xgrammar requires transformers and triton at run time (a CPU server would install
both for nothing); its Lark grammars embed JSON schemas (a forced tool call); and although xgrammar's masks
measured 2-4x faster here, both take microseconds per row per token, far under a decode step's cost
(docs/benchmarks.md, "The grammar engine").

What it promises:

* `Grammars.compile(spec)` turns a `StructuredOutput` (a JSON schema, JSON mode, or a Lark grammar with
  embedded schemas: forced tool calls) into a validated grammar, on the caller's thread: an
  invalid schema is a `GrammarConstraint` (400) before anything is queued. JSON is compact (no free
  whitespace between tokens: a small model given the choice fills it with spaces).
* `Grammars.matcher(grammar)` is one request's parser state, made when it first samples.
* `masks(matchers, vocab)` computes every constrained row's allowed tokens in one llguidance call that
  spreads rows over threads, as a `[rows, vocab]` bool tensor (bits unpacked with torch ops).
* The engine's tokenizer is the checkpoint's own (its `tokenizer.json` text), built on first use (about a
  second) and shared; its end tokens are the model's stop tokens, allowed exactly where the grammar may end.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np
import torch

from ferrox_batch.errors import GrammarConstraint
from ferrox_batch.structured import StructuredOutput

#: How many compiled grammars are kept (a few KB each).
COMPILED_KEPT = 64
#: JSON compiled compact: separators without spaces, no free whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class Grammars:
    """The grammar engine for one tokenizer: compiles specs and makes matchers (thread-safe)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, end_tokens: Sequence[int]) -> None:
        self._json = tokenizer_json
        self.vocab_size = vocab_size
        self._ends = sorted(set(end_tokens))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[StructuredOutput, str] = OrderedDict()  # spec -> grammar, oldest first

    def _engine(self) -> tuple[llguidance.LLTokenizer, llguidance.LLExecutor]:
        with self._lock:
            if self._tokenizer is None or self._executor is None:
                self._tokenizer = llguidance.LLTokenizer(self._json, n_vocab=self.vocab_size,
                                                         eos_token=self._ends or None)
                self._executor = llguidance.LLExecutor()
            return self._tokenizer, self._executor

    def compile(self, spec: StructuredOutput) -> str:
        """The llguidance grammar of `spec`, validated; `GrammarConstraint` naming what is wrong otherwise.

        The last `COMPILED_KEPT` grammars are kept: the choices of one request (`n`) and a client that
        sends the same schema again do not compile it again."""
        with self._lock:
            known = self._compiled.get(spec)
            if known is not None:
                self._compiled.move_to_end(spec)
                return known
        grammar = self._compile(spec)
        with self._lock:
            self._compiled[spec] = grammar
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return grammar

    def _compile(self, spec: StructuredOutput) -> str:
        tokenizer, _ = self._engine()
        try:
            if spec.kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.schema or "")
            else:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.schema_object(), overrides=JSON_OPTIONS)
        except (ValueError, TypeError, RuntimeError) as bad:
            raise GrammarConstraint(f"the JSON schema cannot be compiled: {bad}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarConstraint(f"the JSON schema cannot be compiled: {messages[0] if messages else 'invalid'}")
        return grammar

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        tokenizer, _ = self._engine()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarConstraint(matcher.get_error())
        return matcher

    def masks(self, matchers: Sequence[llguidance.LLMatcher], device: torch.device) -> torch.Tensor:
        """`[len(matchers), vocab_size]` bool: True where a token keeps the row's output in its grammar."""
        _, executor = self._engine()
        words = (self.vocab_size + 31) // 32
        bits = np.zeros((len(matchers), words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bits)
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = (torch.from_numpy(bits).unsqueeze(-1) >> shifts) & 1
        return allowed.view(len(matchers), words * 32)[:, : self.vocab_size].bool().to(device)
