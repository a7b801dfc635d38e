#!/usr/bin/env python3
"""What a constrained row costs the worker: building its grammar (before) against copying a compiled one (now).

A row used to build its own `llguidance.LLMatcher` from the grammar text when it first sampled, on the
worker; now `Grammars.compile` builds one at submit and each row takes `Grammars.matcher(compiled)`, a copy.
For each schema: its size, the compile at submit (once per schema), and the per-row cost both ways (medians),
with the default model's tokenizer. A schema over the byte limit is measured on llguidance directly (the
engine refuses it; shown as such).

    python scripts/bench_grammar_rows.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llguidance  # noqa: E402

from ferrox_batch.bench.batcher import default_model  # noqa: E402
from ferrox_batch.bench.schemas import optional_properties, tool_schemas  # noqa: E402
from ferrox_batch.errors import GrammarConstraint  # noqa: E402
from ferrox_batch.runtime.device import cpu_description  # noqa: E402
from ferrox_batch.runtime.sampling.grammar import JSON_OPTIONS, Grammars  # noqa: E402
from ferrox_batch.structured import StructuredOutput  # noqa: E402

VOCAB = 49152
SCHEMAS = {
    "50 tools": tool_schemas(50),
    "205 tools": tool_schemas(205),
    "2,300 optional properties": optional_properties(2300),
}


def median_ms(action, times: int) -> float:
    samples = []
    for _ in range(times):
        began = time.perf_counter()
        action()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1e3


def main() -> int:
    tokenizer_json = Path(default_model(os.environ), "tokenizer.json").read_text()
    grammars = Grammars(tokenizer_json, VOCAB, [])
    grammars.compile(StructuredOutput.json_object())  # the tokenizer, built once per server
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=VOCAB)
    print(f"# cpu: {cpu_description()}; llguidance {version('llguidance')}; vocab {VOCAB}")
    print("| schema | KB | compile at submit, ms (once) | per row before: build, ms | per row now: copy, ms |")
    print("|---|---|---|---|---|")
    for name, schema in SCHEMAS.items():
        spec = StructuredOutput.json_schema(schema)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        before = median_ms(lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0), 3)
        try:
            began = time.perf_counter()
            compiled = grammars.compile(spec)
            compile_ms = f"{(time.perf_counter() - began) * 1e3:.0f}"
            now = median_ms(lambda: grammars.matcher(compiled), 200)
        except GrammarConstraint as refused:
            compile_ms = "refused" if "bytes" in refused.detail else f"refused: {refused.detail}"
            start = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            now = median_ms(start.deep_copy, 200)
        print(f"| {name} | {len(spec.schema) / 1e3:.0f} | {compile_ms} | {before:.0f} | {now:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
