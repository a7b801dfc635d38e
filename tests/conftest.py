"""Shared fixtures: tiny random checkpoints (session-scoped, written once) and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Nothing may reach a model hub from the tests; transformers is a local reference only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from hypothesis import settings  # noqa: E402
from tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

# No deadline: tests never time things (the benchmarks do), and a slow example on a loaded
# machine is not a failure. CI (.ci/run) derandomizes, so a commit's CI result is
# reproducible from the commit alone; a developer's `make test` keeps exploring new examples.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("FERROX_HYPOTHESIS_PROFILE", "dev"))

# Tests run a batcher's worker thread and a reference decode on the test's own thread at
# once; with torch's default two threads each on this 2-core machine, the OpenMP pools
# spin against each other (measured: 40 reference forwards took 2.4-3.5 s instead of
# 0.04 s). One intra-op thread per torch call keeps the suite fast; speed is measured
# by the benchmark scripts, never by tests.
torch.set_num_threads(1)

# The model tests run on the CPU by default; scripts/gpu_check.sh sets this to "cuda".
TEST_DEVICE = os.environ.get("FERROX_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def device() -> str:
    return TEST_DEVICE


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_variant_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One checkpoint per supported variation of the family."""
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return {
        "llama": write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), seed=1),
        "llama-untied-llama3-rope": write_tiny_checkpoint(
            tmp_path_factory.mktemp("llama3"), seed=2, tie=False, rope_scaling=llama3
        ),
        "qwen2": write_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), arch="qwen2", seed=3),
        # Its own head size (24, not 64 / 4), and each head's queries and keys normalised before RoPE.
        "qwen3": write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), arch="qwen3", seed=6, head_dim=24),
        # The second layer without RoPE.
        "smollm3-nope": write_tiny_checkpoint(tmp_path_factory.mktemp("smollm3"), arch="smollm3", seed=7,
                                              no_rope_layers=[1, 0]),
        "mistral-window": write_tiny_checkpoint(
            tmp_path_factory.mktemp("mistral"), arch="mistral", seed=4, sliding_window=7
        ),
        # Two local layers (window 6, their own RoPE base) and a global one; an attention scale that is not
        # head_dim ** -0.5; norms as offsets from one; GeGLU.
        "gemma3": write_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), arch="gemma3_text", seed=8, layers=3,
                                        head_dim=32, sliding_window=6, query_pre_attn_scalar=20),
        # RoPE on 3/4 of each head, longrope's long factors from position 40 (the greedy tests pass it).
        "phi3-longrope": write_tiny_checkpoint(
            tmp_path_factory.mktemp("phi3"), arch="phi3", seed=9, partial_rotary_factor=0.75, max_positions=160,
            rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": LONG_CONTEXT,
                          "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], "long_factor": [2, 2.5, 3, 3.5, 4, 4.5]},
        ),
        "llama-linear-rope": write_tiny_checkpoint(tmp_path_factory.mktemp("linear"), seed=10,
                                                   rope_scaling={"rope_type": "linear", "factor": 3.0}),
        # The base grows with the sequence past position 40.
        "llama-dynamic-rope": write_tiny_checkpoint(tmp_path_factory.mktemp("dynamic"), seed=11,
                                                    max_positions=LONG_CONTEXT,
                                                    rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        # Every multiplier away from 1, the attention's in place of head_dim ** -0.5 (`tiny_families`).
        "granite": write_tiny_checkpoint(tmp_path_factory.mktemp("granite"), arch="granite", seed=13, std=0.15),
        # Norms after each block and over the whole query and key projections, none before.
        "olmo2": write_tiny_checkpoint(tmp_path_factory.mktemp("olmo2"), arch="olmo2", seed=14),
        # Mixtures of experts: a dense layer between two sparse ones (`mlp_only_layers`), a shared expert
        # with its gate and every other layer dense (`decoder_sparse_step`), norms over the whole projections,
        # Granite's multipliers, a window; std 0.15 spreads the router's scores.
        "qwen3_moe": write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe", seed=15, layers=3,
                                           head_dim=24, std=0.15, extra_config={"mlp_only_layers": [1]}),
        "qwen2_moe": write_tiny_checkpoint(tmp_path_factory.mktemp("qwen2_moe"), arch="qwen2_moe", seed=16, layers=3,
                                           std=0.15, extra_config={"decoder_sparse_step": 2}),
        "olmoe": write_tiny_checkpoint(tmp_path_factory.mktemp("olmoe"), arch="olmoe", seed=17, intermediate=48,
                                       std=0.15),
        "granitemoe": write_tiny_checkpoint(tmp_path_factory.mktemp("granitemoe"), arch="granitemoe", seed=18,
                                            intermediate=48, std=0.15),
        "mixtral-window": write_tiny_checkpoint(tmp_path_factory.mktemp("mixtral"), arch="mixtral", seed=19,
                                                intermediate=48, std=0.15, sliding_window=7),
        # Sinks, biases, alternating windows of 5, YaRN, the clamped SwiGLU.
        "gpt_oss": write_tiny_checkpoint(tmp_path_factory.mktemp("gpt_oss"), arch="gpt_oss", seed=20, layers=3,
                                         head_dim=16, intermediate=48, std=0.15, max_positions=256),
        "qwen3-yarn-rope": write_tiny_checkpoint(
            tmp_path_factory.mktemp("yarn"), arch="qwen3", seed=12,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": LONG_CONTEXT,
                          "beta_fast": 16, "mscale": 1.2, "mscale_all_dim": 0.8},
        ),
    }


#: The pretrained context of the tiny checkpoints whose RoPE changes past it (longrope, dynamic): longer than
#: every test prompt, so a prompt is rotated as the reference rotates it, and shorter than a prompt and its
#: 32-token greedy continuation, so the continuation crosses it.
LONG_CONTEXT = 40


@pytest.fixture(scope="session")
def tiny_model(tiny_llama_dir: Path):
    from ferrox_batch.runtime.loading.loader import load_model

    return load_model(tiny_llama_dir, device=TEST_DEVICE, dtype="float32")


def default_model_dir() -> Path:
    home = Path(os.environ.get("FERROX_HOME") or Path.home() / ".cache" / "ferrox-batch")
    return home / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from ferrox_batch.runtime.loading.fetch import fetch_default_model

    home = default_model_dir().parent.parent
    return fetch_default_model(home, progress=False, log=lambda *_: None)


@pytest.fixture(scope="session")
def tiny_batch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied, larger-scale weights: greedy outputs vary token to token, with clear argmax margins."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-batch"), tie=False, std=0.15, seed=5)


@pytest.fixture(scope="session")
def tiny_batch_model(tiny_batch_dir: Path):
    from ferrox_batch.runtime.loading.loader import load_model

    return load_model(tiny_batch_dir, device=TEST_DEVICE, dtype="float32")


@pytest.fixture(scope="module")
def server(tiny_batch_model):
    """The server tests' default: the tiny batch checkpoint served, one server per test module, as
    `(base_url, batcher)`. A module that needs another configuration defines its own `server`."""
    from server_helpers import served, tiny_batcher

    batcher = tiny_batcher(tiny_batch_model)
    with served(batcher) as (base_url, _app):
        yield base_url, batcher


@pytest.fixture(scope="module")
def client(server):
    """The official `openai` client on the module's `server`."""
    from server_helpers import openai_client

    with openai_client(server[0], timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def kernels_built_with():
    """The kernels built with one flag set, each set compiled once per session (`kernel_builds.BuildsByFlags`)."""
    from kernel_builds import BuildsByFlags

    return BuildsByFlags()


@pytest.fixture(scope="session")
def forced_kernel_builds(kernels_built_with):
    """`kernel_builds.forced_builds` once per session: this machine's build and, on x86, the AVX2-only and
    plain-C ones (each a compile of its own, so the tests that compare the paths share them)."""
    from kernel_builds import forced_builds

    return forced_builds(kernels_built_with)
