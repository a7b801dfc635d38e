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
from ferrox_batch.runtime.device import cpu_description  # noqa: E402

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
    began = time.perf_counter()
    ll_tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=VOCAB)
    ll_setup = time.perf_counter() - began
    began = time.perf_counter()
    xg_compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB), max_threads=1)
    xg_setup = time.perf_counter() - began
    print(f"# cpu: {cpu_description()}; llguidance {version('llguidance')}, xgrammar {version('xgrammar')}; "
          f"vocab {VOCAB}; one row, one thread; tokenizer set-up once: llguidance {ll_setup * 1e3:.0f} ms, "
          f"xgrammar {xg_setup * 1e3:.0f} ms")
    print("| schema | engine | compile ms | mask us per token (median / p90) | tokens |")
    print("|---|---|---|---|---|")
    for name, schema in SCHEMAS.items():
        documents = []
        while sum(len(d) for d in documents) < 300:  # several random valid documents, 300 tokens in all
            documents.append(document(llg, tokenizer_json, schema, rng))
        for engine in ("llguidance", "xgrammar"):
            times = []
            compile_ms = []
            for tokens in documents:
                began = time.perf_counter()
                if engine == "llguidance":
                    grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
                    matcher = llg.LLMatcher(ll_tokenizer, grammar, log_level=0)
                    bits = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
                else:
                    matcher = xgr.GrammarMatcher(xg_compiler.compile_json_schema(json.dumps(schema),
                                                                                 any_whitespace=False))
                    bits = xgr.allocate_token_bitmask(1, VOCAB)
                compile_ms.append((time.perf_counter() - began) * 1e3)
                for t in tokens:
                    began = time.perf_counter()
                    if engine == "llguidance":
                        llguidance.numpy.fill_next_token_bitmask(matcher, bits, 0)
                        times.append(time.perf_counter() - began)
                        matcher.consume_token(t)
                    else:
                        matcher.fill_next_token_bitmask(bits, 0)
                        times.append(time.perf_counter() - began)
                        matcher.accept_token(t)
            p90 = sorted(times)[int(0.9 * len(times))]
            print(f"| {name} | {engine} | {compile_ms[0]:.1f} first, {statistics.median(compile_ms[1:] or compile_ms):.1f} "
                  f"again | {statistics.median(times) * 1e6:.0f} / {p90 * 1e6:.0f} | {len(times)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
