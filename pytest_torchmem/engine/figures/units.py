"""Byte sizes: parsing user-written budgets and formatting figures for people.

Binary (KiB, MiB, GiB, TiB) and decimal (kB, MB, GB, TB) units are both exact
integers; a bare number is bytes.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Final

__all__ = ["parse_bytes", "format_bytes", "format_delta"]

_UNITS: Final[dict[str, int]] = {
    "b": 1,
    "": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# A sign (refused, but named), a decimal number, and a unit: anything from a letter to
# the next space, so that "5 GB/s" is reported as an unknown unit, not as unreadable.
_PATTERN: Final = re.compile(r"^\s*([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]\S*)?\s*$")
_EXPONENT: Final = re.compile(r"^[eE][+-]?[0-9]+$")


def parse_bytes(value: int | str) -> int:
    """Return ``value`` as a whole number of bytes.

    ``value`` is an ``int`` (bytes) or a string such as ``"512 MiB"``,
    ``"1.5 GB"`` or ``"4096"``. Fractions must come out to whole bytes
    (``"1.5 KiB"`` is 1536; ``"0.1 B"`` is an error).
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"a byte size must be an int or a string like '512 MiB', got {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative, got {value}")
        return value
    match = _PATTERN.match(value)
    if match is None:
        raise ValueError(
            f"cannot read {value!r} as a byte size; write e.g. '1.5 GiB', '512 MB' or '4096'"
        )
    sign, number, unit = match.groups()
    unit = unit or ""
    if sign == "-":
        raise ValueError(f"cannot read {value!r} as a byte size: it cannot be negative")
    if _EXPONENT.match(unit):
        raise ValueError(
            f"cannot read {value!r} as a byte size: write it without an exponent, "
            "e.g. '1 GB' or '1000000000'"
        )
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(
            f"unknown unit {unit!r} in {value!r}; use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    try:
        exact = Decimal(number) * factor
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"cannot read {value!r} as a byte size") from None
    if exact != exact.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes ({exact} B)")
    return int(exact)


def format_bytes(nbytes: int) -> str:
    """Format a byte count for people, in binary units: ``'1.50 GiB'``, ``'512 B'``."""
    sign = "-" if nbytes < 0 else ""
    size = abs(nbytes)
    if size < 1024:
        return f"{sign}{size} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            return f"{sign}{size:.2f} {unit}"
    raise AssertionError("unreachable")


def format_delta(new: int, old: int, *, exact: bool = False) -> str:
    """``'+12.00 MiB (+3.1%)'``: the change from ``old`` to ``new``.

    ``exact``: the change as a whole number of bytes, ``'+12582912 (+3.1%)'``.
    """
    delta = new - old
    sign = "+" if delta >= 0 else "-"
    text = f"{sign}{abs(delta) if exact else format_bytes(abs(delta))}"
    if old:
        share = abs(delta) / old
        # a small change to a big figure keeps two significant digits, never "+0.0%"
        percent = f"{share:.1%}" if share >= 0.001 or not share else f"{share * 100:.2g}%"
        text += f" ({sign}{percent})"
    return text
