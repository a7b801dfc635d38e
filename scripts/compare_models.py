#!/usr/bin/env python3
"""Whether every model family computes the same bits in this working tree as at a base commit.

A change meant to leave the models' arithmetic alone (a refactor of `runtime/architectures/`) promises, on one
machine, the same greedy ids and the same float32 logits, bit for bit. This script checks that promise:

1. It writes tiny random checkpoints ONCE, with this tree's test fixtures, into a temporary folder
   (`compare_cases.py`: every family and variation the tests' tiny checkpoints cover, two of them as quantized
   GGUFs served as stored) and lists beside them the real models found under `~/.cache/ferrox-batch`
   (`$FERROX_HOME`).
2. Each side (this tree as it is on disk, and a detached `git worktree` of `--base`) runs `--dump` in a process
   of its own with only its tree on PYTHONPATH (checked: each must import its own `ferrox_batch`), and both
   read the very same files. Per model and per load (fp32; bf16 and `weights="q8_0"` where they are cheap) it
   records, through `Decoder.forward` on a `PagedKvStore`: the prompts' ids; 32 greedy ids for each of two
   prompts alone and for both batched, with every step's logits; and the logits of a mixed step (the first
   forward of three sequences, then one sequence's second prefill chunk, every position, beside two decodes),
   once with the C kernels and once on torch's ops (`decoder.kernels = None`, no layer stack).
3. The parent compares the two dumps with `torch.equal` and prints one line per model, load and check:
   IDENTICAL, or DIFFERENT with the largest absolute difference (the greedy steps of a real vocabulary, and
   a chunk's every position, are kept as digests of their bits: DIFFERENT then says at which step). The exit
   status is 1 if anything differs or a side fails on a model (ERROR).

    python scripts/compare_models.py --base c14f1695647e572d92c650e2ce4166e4efb67662
    python scripts/compare_models.py --base HEAD~1 --no-real        # tiny checkpoints only: about 30 s
    python scripts/compare_models.py --base HEAD~1 --real all       # also Gemma 3 in bf16, q8_0 and its GGUF

On this project's shared 2-core machine the default run took 3-4 minutes (each side 1-2, nearly all of it
loading and running the real models; the tiny ones take about 10 s a side). One torch thread per side by
default (`--threads`): two OpenMP threads spinning against other processes made the tiny forwards 3-30x
slower, and the count is the same on both sides either way. The C kernels build per process, into a private
temporary folder (`runtime/kernels/kernel_build.py`), so the two trees' builds never meet.

A side may be run alone: `PYTHONPATH=<tree> python scripts/compare_models.py --dump out.pt --models <folder>`,
where `<folder>` holds the `models.json` a parent run wrote (`--keep` keeps the folder).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tree_sides import Side

PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           "def forward(self, x): return self.layers(x) + 1\nPaged attention stores keys"]
NEW_TOKENS = 32
#: Logits up to this many values are kept whole; larger ones (a real vocabulary's every greedy step, every
#: position of a chunk) as a digest of their bits. The mixed step's last-row logits are always kept whole.
KEEP_WHOLE = 1 << 16
MANIFEST = "models.json"


# ------------------------------------------------------------------ one side: load, run, record

def _kept(t: torch.Tensor, whole: bool = False) -> torch.Tensor | str:
    """`t` as float32 on the CPU; a digest of its bits instead where it is large and `whole` is not asked."""
    t = t.detach().float().contiguous().cpu()
    if whole or t.numel() <= KEEP_WHOLE:
        return t.clone()
    return f"sha256:{hashlib.sha256(t.numpy().tobytes()).hexdigest()} shape {tuple(t.shape)}"


def _greedy(decoder: Any, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor | str]]:
    """`NEW_TOKENS` greedy ids for every prompt, all in one batch, one forward per token; and every step's logits."""
    from ferrox_batch.runtime.kv.batch_inputs import SeqChunk

    store = decoder.new_store(16, num_blocks=256)
    for i, ids in enumerate(prompts):
        store.add_sequence(i, len(ids) + NEW_TOKENS)
    logits = decoder.forward([SeqChunk(i, ids) for i, ids in enumerate(prompts)], store)
    out: list[list[int]] = [[] for _ in prompts]
    steps = []
    for _ in range(NEW_TOKENS):
        steps.append(_kept(logits))
        for i in range(len(prompts)):
            out[i].append(int(logits[i].argmax()))
        logits = decoder.forward([SeqChunk(i, [row[-1]]) for i, row in enumerate(out)], store)
    return out, steps


def _mixed(decoder: Any, prompts: list[list[int]]) -> dict[str, torch.Tensor | str]:
    """One step mixing a second prefill chunk (every position's logits) with two sequences' decodes."""
    from ferrox_batch.runtime.kv.batch_inputs import SeqChunk

    store = decoder.new_store(16, num_blocks=256)
    long = prompts[0] + prompts[1]
    half = len(long) // 2
    for i, ids in enumerate([*prompts, long]):
        store.add_sequence(i, len(ids) + 2)
    first = decoder.forward([SeqChunk(0, prompts[0]), SeqChunk(1, prompts[1]), SeqChunk(2, long[:half])], store)
    nxt = [int(first[0].argmax()), int(first[1].argmax())]
    logits, spans = decoder.forward_every([SeqChunk(2, long[half:]), SeqChunk(0, [nxt[0]]), SeqChunk(1, [nxt[1]])],
                                          store, [0])
    return {"first": _kept(first, whole=True), "step": _kept(logits, whole=True), "chunk positions": _kept(spans[0])}


def _run_one(entry: dict[str, Any], load: dict[str, Any]) -> dict[str, Any]:
    from ferrox_batch.runtime.loading.loader import load_model

    began = time.monotonic()
    model = load_model(entry["path"], device="cpu", dtype=load["dtype"], weights=load["weights"],
                       int8_activations=load["int8_activations"])
    loaded = time.monotonic() - began
    decoder = model.decoder
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    record: dict[str, Any] = {"prompt ids": prompts, "precision": model.precision}
    for i, ids in enumerate(prompts):
        got, steps = _greedy(decoder, [ids])
        record[f"greedy ids, prompt {i} alone"] = got[0]
        record[f"greedy logits, prompt {i} alone"] = steps
    got, steps = _greedy(decoder, prompts)
    record["greedy ids, batched"] = got
    record["greedy logits, batched"] = steps
    for name, value in _mixed(decoder, prompts).items():
        record[f"mixed step, C kernels: {name}"] = value
    decoder.kernels = None  # torch's ops, as the tests switch them off
    if hasattr(decoder, "layer_stack"):
        decoder.layer_stack = None  # the stack is the kernels' too
    for name, value in _mixed(decoder, prompts).items():
        record[f"mixed step, torch ops: {name}"] = value
    record["seconds"] = {"load": loaded, "run": time.monotonic() - began - loaded}
    return record


def dump(out: Path, models: Path, threads: int) -> None:
    import ferrox_batch

    if threads:
        torch.set_num_threads(threads)
    manifest = json.loads((models / MANIFEST).read_text())
    result: dict[str, Any] = {"package": ferrox_batch.__file__, "runs": {}}
    for entry in manifest["models"]:
        for load in entry["loads"]:
            key = f"{entry['name']} [{load['label']}]"
            began = time.monotonic()
            try:
                result["runs"][key] = _run_one(entry, load)
            except Exception as error:  # reported as a difference by the parent, not a crash of the run
                result["runs"][key] = {"error": f"{type(error).__name__}: {error}"}
            print(f"  {key}: {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
    torch.save(result, out)


# ------------------------------------------------------------------ the parent: write once, run both, compare

def run_side(side: Side, script: Path, models: Path, out: Path, threads: int) -> float:
    """Run `--dump` for `side`: this file, with only `side`'s tree on PYTHONPATH; how long it took."""
    began = time.monotonic()
    print(f"# {side.name} ({side.commit}, {side.root}):", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, str(script), "--dump", str(out), "--models", str(models),
                    "--threads", str(threads)], cwd=side.root, env=side.env(), check=True)
    return time.monotonic() - began


def _difference(a: Any, b: Any) -> str | None:
    """None when `a` and `b` are the same bits; else how they differ."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"shapes {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        if torch.equal(a, b):
            return None
        return f"max abs diff {float((a.double() - b.double()).abs().nan_to_num(float('inf')).max()):.3g}"
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and any(
            isinstance(x, torch.Tensor) for x in a):
        diffs = [(i, d) for i, (x, y) in enumerate(zip(a, b)) if (d := _difference(x, y)) is not None]
        if not diffs:
            return None
        return f"{len(diffs)} of {len(a)} steps differ, the first at step {diffs[0][0]}: {diffs[0][1]}"
    if a == b:
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        return f"first differs at index {first}"
    return f"{str(a)[:80]!r} vs {str(b)[:80]!r}"


def compare(base: dict[str, Any], new: dict[str, Any]) -> int:
    differing = 0
    for key in dict.fromkeys([*base["runs"], *new["runs"]]):
        before, after = base["runs"].get(key, {"error": "not run"}), new["runs"].get(key, {"error": "not run"})
        if "error" in before or "error" in after:
            print(f"{key}: ERROR (base: {before.get('error', 'ran')}; new: {after.get('error', 'ran')})")
            differing += 1
            continue
        for check in before:
            if check == "seconds":
                continue
            diff = _difference(before[check], after.get(check))
            print(f"{key} {check}: {'IDENTICAL' if diff is None else f'DIFFERENT ({diff})'}")
            differing += diff is not None
    return differing


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the commit to compare this working tree against")
    p.add_argument("--real", choices=("none", "default", "all"), default="default",
                   help="real models: none; SmolLM2 in fp32, bf16 and q8_0 and its Q4_1 GGUF as stored, Gemma 3 in "
                        "fp32 (default); also Gemma 3 in bf16 and q8_0 and its Q4_K_M GGUF (all)")
    p.add_argument("--no-real", dest="real", action="store_const", const="none", help="same as --real none")
    # One thread by default: on a shared 2-core machine two OpenMP threads spin against other processes
    # (measured: tiny forwards 3-30x slower under a load of 6); either way both sides use the same count.
    p.add_argument("--threads", type=int, default=1, help="torch threads on each side (0: torch's default)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (checkpoints and dumps)")
    p.add_argument("--dump", type=Path, help=argparse.SUPPRESS)  # one side's run: write its record here
    p.add_argument("--models", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dump:
        dump(args.dump, args.models, args.threads)
        return 0
    if not args.base:
        p.error("--base is required")
    from compare_cases import write_models
    from tree_sides import base_side, current_side

    began = time.monotonic()
    script = Path(__file__).resolve()  # both sides run this file: only the package under test differs
    work = Path(tempfile.mkdtemp(prefix="ferrox-compare-"))
    models = work / "models"
    entries = write_models(models, args.real)
    (models / MANIFEST).write_text(json.dumps({"models": entries}, indent=1))
    print(f"# {len(entries)} models written or found in {time.monotonic() - began:.0f} s under {work}", flush=True)
    new = current_side()
    with base_side(args.base) as base:
        seconds = {side.name: run_side(side, script, models, work / f"{side.name}.pt", args.threads)
                   for side in (base, new)}
        dumps = {side.name: torch.load(work / f"{side.name}.pt", weights_only=False) for side in (base, new)}
        for side in (base, new):  # each side must have imported its own tree
            package = Path(dumps[side.name]["package"]).resolve()
            if side.root.resolve() not in package.parents:
                raise SystemExit(f"the {side.name} side imported {package}, not its own tree {side.root}")
        print(f"# base {base.commit} against new {new.commit}; sides took {seconds['base']:.0f} s and "
              f"{seconds['new']:.0f} s")
    differing = compare(dumps["base"], dumps["new"])
    print(f"# {'all IDENTICAL' if not differing else f'{differing} checks DIFFERENT'}; "
          f"{time.monotonic() - began:.0f} s in all")
    if args.keep:
        print(f"# kept {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
