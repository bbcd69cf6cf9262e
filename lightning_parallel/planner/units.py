"""Parsing and printing of byte sizes and parameter counts.

Sizes follow SI and IEC strictly: ``GB`` is 10^9 bytes (the unit of the ZeRO paper's figures, "120 GB" for
16 x 7.5e9 bytes), ``GiB`` is 2^30 bytes (what ``nvidia-smi`` shows as MiB / 1024). A "32 GB" V100 has 32 GiB;
write ``32GiB`` to be exact, ``32GB`` is 2.6 % less.
"""

from __future__ import annotations

import math
import re

__all__ = ["BYTE_UNITS", "COUNT_SUFFIXES", "format_bytes", "format_count", "parse_bytes", "parse_count"]

BYTE_UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
"""Accepted byte units (case-insensitive): SI powers of 1000 and IEC powers of 1024."""

COUNT_SUFFIXES: dict[str, float] = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
"""Accepted suffixes of a parameter count: 125M, 7.5B (= 7.5G), 1T; or plain scientific notation (7.5e9)."""

_NUMBER = r"([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"


def parse_bytes(text: str | int | float, *, name: str = "size") -> int:
    """``"32GB"`` -> 32_000_000_000, ``"80GiB"`` -> 85_899_345_920, ``"512MiB"``, ``"1.5e9"`` (bytes)."""
    if isinstance(text, bool):
        raise ValueError(f"{name}={text!r} is not a size; write e.g. 32GB or 80GiB.")
    if isinstance(text, int | float):
        value, unit = float(text), "B"
    else:
        match = re.fullmatch(rf"\s*{_NUMBER}\s*([A-Za-z]*)\s*", text)
        if match is None:
            raise ValueError(f"{name}={text!r} is not a size; write a number and a unit, e.g. 32GB or 80GiB.")
        value, unit = float(match.group(1)), (match.group(2).upper() or "B")
    if unit not in BYTE_UNITS:
        raise ValueError(
            f"{name}={text!r}: unknown unit {unit!r}. Use one of B, KB, MB, GB, TB (powers of 1000) or "
            "KiB, MiB, GiB, TiB (powers of 1024), e.g. 32GB or 80GiB."
        )
    result = value * BYTE_UNITS[unit]
    if not math.isfinite(result) or result <= 0:
        raise ValueError(f"{name}={text!r} must be a positive size, e.g. 32GB.")
    return round(result)


def parse_count(text: str | int | float, *, name: str = "count") -> int:
    """``"7.5e9"``, ``"7.5B"``, ``"125M"``, ``"1.3G"`` -> an integer number of parameters (> 0)."""
    if isinstance(text, bool):
        raise ValueError(f"{name}={text!r} is not a count; write e.g. 7.5e9, 7.5B or 125M.")
    if isinstance(text, int | float):
        value, suffix = float(text), ""
    else:
        match = re.fullmatch(rf"\s*{_NUMBER}\s*([A-Za-z]?)\s*", text)
        if match is None:
            raise ValueError(f"{name}={text!r} is not a count; write e.g. 7.5e9, 7.5B or 125M.")
        value, suffix = float(match.group(1)), match.group(2).upper()
    if suffix not in COUNT_SUFFIXES:
        raise ValueError(f"{name}={text!r}: unknown suffix {suffix!r}. Use K, M, B (or G), T, or e-notation (7.5e9).")
    result = value * COUNT_SUFFIXES[suffix]
    if not math.isfinite(result) or result < 1:
        raise ValueError(f"{name}={text!r} must be at least 1.")
    return round(result)


def format_bytes(num: float, *, digits: int = 1) -> str:
    """Decimal units, as the ZeRO paper prints them: ``120.0 GB``, ``31.4 GB``, ``512.0 MB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(num) >= scale:
            return f"{num / scale:.{digits}f} {unit}"
    return f"{num:.0f} B"


def format_count(num: float) -> str:
    """``7.5B``, ``124.4M``, ``950K``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(num) >= scale:
            return f"{num / scale:.4g}{suffix}"
    return f"{num:.0f}"
