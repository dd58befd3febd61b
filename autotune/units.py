"""Byte quantities: parse ``"24GiB"``, ``"512MB"``, ``"1.5G"`` and format bytes for people (pure)."""

from __future__ import annotations

import math
import numbers
import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    # Decimal units, as storage vendors use them.
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    # Binary units, as GPU memory is sold and as PyTorch reports it.
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    # One letter, as `free -g` and `ulimit` use them: binary.
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}

_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Turn a memory size into a whole number of bytes.

    Args:
        value: bytes as an ``int``, or a string: a number and an optional unit, e.g. ``"24GiB"``,
            ``"512MB"``, ``"1.5G"``, ``"4096"``. ``KiB``/``MiB``/``GiB``/``TiB`` and the one-letter
            ``K``/``M``/``G``/``T`` are powers of 1024; ``KB``/``MB``/``GB``/``TB`` are powers of
            1000. Case does not matter.

    Returns:
        The size in bytes, rounded down.

    Raises:
        TypeError: ``value`` is neither an int nor a string.
        ValueError: the string cannot be read, or the size is not positive.

    Example:
        >>> parse_bytes("1.5GiB")
        1610612736
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"Invalid memory size {value!r} ({type(value).__name__}): "
            "give bytes as an int or a string such as '24GiB' or '512MB'"
        )
    if isinstance(value, int):
        size = value
    else:
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"Invalid memory size {value!r}: write a number and a unit, "
                "such as '24GiB', '512MB', '1.5G' or '4096' (bytes)"
            )
        size = math.floor(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"Invalid memory size {value!r}: it must be more than 0 bytes")
    return size


def format_bytes(n: float) -> str:
    """Format a byte count with a binary unit, e.g. ``3.10 GiB``.

    Example:
        >>> format_bytes(3 * 2**20)
        '3.00 MiB'
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(f"Invalid byte count {n!r} ({type(n).__name__}): give a number of bytes")
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{sign}{n:.0f} B" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"
