"""Byte sizes as people write them: "8GB", "16GiB", "512MiB", "auto"."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}


def parse_bytes(text: str | int | float, *, allow_zero: bool = False) -> int:
    """Parse a memory size: ``"8GB"`` (10^9), ``"8GiB"`` or ``"8G"`` (2^30), ``"512MiB"``, or
    bytes: a number without a unit, from 1 MiB (``"24"`` is refused, as the 24 GB it surely
    meant).

    >>> parse_bytes("8GB"), parse_bytes("1.5GiB"), parse_bytes(1024)
    (8000000000, 1610612736, 1024)
    """
    if isinstance(text, int | float) and not isinstance(text, bool):
        if text < 0 or (text == 0 and not allow_zero):
            raise ValueError(f"a memory size must be positive, got {text}")
        return int(text)
    m = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(
            f"cannot read the memory size {text!r}: write a number and a unit, e.g. 8GB, 16GiB, "
            "512MiB (GB = 10^9 bytes, GiB = 2^30), or 'auto' for the device's free memory"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"a memory size must be positive, got {text!r}")
    if not unit and 0 < value < 2**20:  # '24' for 24 GB: a few bytes is no one's budget
        raise ValueError(
            f"{str(text).strip()!r} has no unit, so it is {int(value)} bytes: write {m.group(1)}GB "
            f"or {m.group(1)}GiB (or the bytes, at least 1 MiB)"
        )
    return int(value)


def format_bytes(n: float) -> str:
    """Human-readable size in binary units.

    >>> format_bytes(1536), format_bytes(3 * 2**30)
    ('1.5 KiB', '3.00 GiB')
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
