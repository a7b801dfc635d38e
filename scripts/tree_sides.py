"""The two sides of a before/after comparison: this working tree and a detached worktree of a base commit.

`compare_models.py` and `bench_before_after.py` run each side in a process of its own whose PYTHONPATH is that
side's tree and nothing of the other, so each imports its own `ferrox_batch`. The C kernels need no care: each
process compiles them into a private temporary folder and caches nothing on disk
(`runtime/kernels/kernel_build.py`), so the two trees' builds never meet. The base worktree lives in a
temporary folder and is removed on the way out, whatever happened.

Not a program: the scripts beside it import it (a script's own folder is first on its `sys.path`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

#: This working tree's root (the folder above `scripts/`).
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Side:
    """One tree: what the report calls it, where it lies, and the commit it is (or stands on)."""

    name: str
    root: Path
    commit: str

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (the process environment by default) with this tree alone on PYTHONPATH, offline."""
        env = dict(os.environ if base is None else base)
        env["PYTHONPATH"] = str(self.root)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def current_side() -> Side:
    """The working tree, as it is on disk (uncommitted changes included: they are what is being checked)."""
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return Side("new", ROOT, git("rev-parse", "--short", "HEAD") + ("+changes" if dirty else ""))


@contextmanager
def base_side(commit: str) -> Iterator[Side]:
    """A detached worktree of `commit` in a temporary folder, removed (and unregistered) afterwards."""
    full = git("rev-parse", "--verify", f"{commit}^{{commit}}")
    folder = Path(tempfile.mkdtemp(prefix="ferrox-base-"))
    tree = folder / "tree"
    git("worktree", "add", "--detach", "--quiet", str(tree), full)
    try:
        yield Side("base", tree, full[:7])
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False,
                       capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)
