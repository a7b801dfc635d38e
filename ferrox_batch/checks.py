"""Integer checks, the position bound and the text check shared by the pure-arithmetic modules.

Rust's `usize` made negative and non-integer sizes impossible; here every
public function checks its integers with `check_int`, so a bad size is a
clear error and never a silently wrong number.
"""

from __future__ import annotations

import math

#: Rust's `usize::MAX`: "no limit" for counts, and the largest position count.
UNLIMITED = 2**64 - 1


def check_int(name: str, value: object, *, minimum: int = 0, maximum: int = UNLIMITED) -> int:
    """Return `value` if it is an int (not a bool) in `[minimum, maximum]`.

    TypeError for a non-integer (floats and bools included: `True` is not a
    count), ValueError for one out of range; both name the argument and value.
    Shared by the pure-arithmetic modules so a bad size is never silently
    turned into a wrong number.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")
    return value


def check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite, non-negative number of seconds, got {value!r}")
    return float(value)


def encodable(text: str) -> bool:
    """Whether `text` encodes to UTF-8: no lone surrogate (which JSON's `\\ud800` escape can carry in)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
