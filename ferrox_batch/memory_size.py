"""Memory sizes as people write them ("2GiB", "512MiB", "1.5G"), in bytes: one reader for every entry
point that takes a KV memory budget (the CLI's `--kv-memory` and its variable, the Ray Serve config).

Shared vocabulary: no torch, so `ferrox-batch --help` stays quick.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
          "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_memory_size(text: str) -> int:
    """Bytes in `"2GiB"`, `"512MiB"`, `"1.5G"`, `"4096"`: KiB/MiB/GiB/TiB and bare K/M/G/T are powers of
    1024, KB/MB/GB/TB powers of 1000, case-insensitive; a bare number is bytes. ValueError otherwise."""
    match = _SIZE.fullmatch(text)
    unit = match[2].lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size (try 512MiB or 2GiB)")
    value = int(float(match[1]) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"{text!r} is not a positive memory size")
    return value
