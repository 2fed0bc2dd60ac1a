"""Byte sizes as users write them in budgets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_torchmem.engine.figures.units import format_bytes, format_delta, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("512 MiB", 512 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("1.5 GB", 1_500_000_000),
        ("2kb", 2000),
        ("2 KiB", 2048),
        ("0.5 TiB", 2**39),
        ("  7 b ", 7),
        ("1TB", 10**12),
        (".5 KiB", 512),
    ],
)
def test_parse_binary_and_decimal_units_exactly(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        ("12 parsecs", ValueError, "unknown unit 'parsecs'"),
        ("-5 MiB", ValueError, "cannot read '-5 MiB'"),
        (-5, ValueError, "cannot be negative"),
        ("0.1 B", ValueError, "not a whole number of bytes"),
        ("lots", ValueError, "cannot read 'lots'"),
        (1.5, TypeError, "must be an int or a string"),
        (True, TypeError, "must be an int or a string"),
        ("", ValueError, "cannot read ''"),
    ],
)
def test_bad_sizes_name_the_value(text: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse_bytes(text)  # type: ignore[arg-type]


def test_format() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(-2048) == "-2.00 KiB"
    assert format_delta(110, 100) == "+10 B (+10.0%)"
    assert format_delta(90, 100) == "-10 B (-10.0%)"
    assert format_delta(5, 0) == "+5 B"
    assert format_delta(32 * 2**20 + 1024, 32 * 2**20) == "+1.00 KiB (+0.0031%)"
    assert format_delta(100, 100) == "+0 B (+0.0%)"


@given(st.integers(min_value=0, max_value=2**50))
def test_int_round_trip(n: int) -> None:
    assert parse_bytes(str(n)) == n
    assert parse_bytes(f"{n} B") == n


@given(st.integers(min_value=0, max_value=2**20), st.sampled_from(["KiB", "MiB", "GiB", "kB", "MB", "GB"]))
def test_unit_round_trip(n: int, unit: str) -> None:
    factor = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "kB": 10**3, "MB": 10**6, "GB": 10**9}[unit]
    assert parse_bytes(f"{n} {unit}") == n * factor
    assert parse_bytes(f"{n}.5 {unit}") == n * factor + factor // 2


_FACTORS = {
    "B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}  # fmt: skip


@given(st.integers(min_value=0, max_value=2**50), st.sampled_from(sorted(_FACTORS)))
def test_any_byte_count_written_exactly_in_any_unit_round_trips(n: int, unit: str) -> None:
    """Bytes -> text -> bytes: ``n`` bytes in ``unit`` is a finite decimal (units are
    powers of 2 or of 10), written out in full it parses back to ``n``, in any case."""
    from decimal import Decimal, localcontext

    with localcontext() as context:
        context.prec = 100  # the quotient in full: up to 40 decimals for TiB
        text = format(Decimal(n) / _FACTORS[unit], "f")
    assert parse_bytes(f"{text} {unit}") == n
    assert parse_bytes(f"{text}{unit.upper()}") == n
    assert parse_bytes(f"  {text} {unit.lower()}  ") == n


@given(st.integers(min_value=0, max_value=4095), st.sampled_from([0, 10, 20, 30, 40]))
def test_format_then_parse_round_trips_when_the_figure_is_exact(quarters: int, shift: int) -> None:
    """Bytes -> text -> bytes -> text: ``format_bytes`` writes bytes below 1 KiB, else
    two decimals of the largest binary unit under the figure; when those are exact
    (quarter units here), its text parses back to the bytes and formats the same."""
    n = quarters % 1024 if shift == 0 else max(quarters, 4) << shift >> 2
    text = format_bytes(n)
    assert parse_bytes(text) == n
    assert format_bytes(parse_bytes(text)) == text
