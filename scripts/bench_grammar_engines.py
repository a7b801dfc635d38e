#!/usr/bin/env python3
"""llguidance against xgrammar on this CPU: what choosing the grammar engine rested on.

For each JSON schema: the time to compile it (a new schema's first-request cost) and the time of one token
mask, single row, single thread, along the same token sequence for both engines (a valid document the
default model's tokenizer spells, made by sampling random allowed tokens under llguidance), medians.

xgrammar is not a dependency of ferrox-batch (it needs transformers and triton at run time); to run this,
install it beside the test extra without its dependencies:

    .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi
    python scripts/bench_grammar_engines.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrox_batch.bench.batcher import default_model  # noqa: E402
from ferrox_batch.models.device import cpu_description  # noqa: E402

VOCAB = 49152
SCHEMAS = {
    "flat object": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                     "ok": {"type": "boolean"}},
                    "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested arrays": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array",
                                                                             "items": {"type": "string"}}},
        "required": ["id", "tags"]}}}, "required": ["items"]},
}


def document(llg, tokenizer_json: str, schema: dict, rng: np.random.Generator, max_tokens: int = 120) -> list[int]:
    tok = llg.LLTokenizer(tokenizer_json, n_vocab=VOCAB)
    grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
    m = llg.LLMatcher(tok, grammar, log_level=0)
    out = []
    while not m.is_stopped() and len(out) < max_tokens:
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
        allowed = np.nonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:VOCAB])[0]
        allowed = allowed[allowed != tok.eos_token]
        if len(allowed) == 0:
            break
        token = int(rng.choice(allowed))
        m.consume_token(token)
        out.append(token)
    return out


def main() -> int:
    import llguidance as llg
    import llguidance.numpy
    import transformers
    import xgrammar as xgr

    model = default_model(__import__("os").environ)
    tokenizer_json = Path(model, "tokenizer.json").read_text()
    hf = transformers.AutoTokenizer.from_pretrained(model)
    rng = np.random.default_rng(0)
    print(f"# cpu: {cpu_description()}; llguidance {version('llguidance')}, xgrammar {version('xgrammar')}; "
          f"vocab {VOCAB}; one row, one thread")
    print("| schema | engine | compile ms | mask us per token (median) | tokens |")
    print("|---|---|---|---|---|")
    for name, schema in SCHEMAS.items():
        tokens = document(llg, tokenizer_json, schema, rng)
        # llguidance
        began = time.perf_counter()
        tok = llg.LLTokenizer(tokenizer_json, n_vocab=VOCAB)
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        matcher = llg.LLMatcher(tok, grammar, log_level=0)
        compile_ms = (time.perf_counter() - began) * 1e3
        bits = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
        times = []
        for t in tokens:
            began = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, bits, 0)
            times.append(time.perf_counter() - began)
            matcher.consume_token(t)
        print(f"| {name} | llguidance | {compile_ms:.1f} (tokenizer included) | "
              f"{statistics.median(times) * 1e6:.0f} | {len(tokens)} |")
        # xgrammar
        began = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB)
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        xm = xgr.GrammarMatcher(compiled)
        compile_ms = (time.perf_counter() - began) * 1e3
        mask = xgr.allocate_token_bitmask(1, VOCAB)
        times = []
        for t in tokens:
            began = time.perf_counter()
            xm.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - began)
            xm.accept_token(t)
        print(f"| {name} | xgrammar | {compile_ms:.1f} (tokenizer info included) | "
              f"{statistics.median(times) * 1e6:.0f} | {len(tokens)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
