"""Parsing and printing quantities with units (tessera.core.units)."""

from __future__ import annotations

import math

import pytest

from tessera.core.units import (
    UnitError,
    format_bandwidth,
    format_bytes,
    format_flops,
    format_seconds,
    parse_bandwidth,
    parse_bytes,
    parse_flops,
    parse_seconds,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1KiB", 1024),
        ("2TiB", 2 * 2**40),
        ("16GB", 16 * 10**9),
        ("1.5TB", 1_500_000_000_000),
        ("4kB", 4000),
        ("4KB", 4000),
        ("100MB", 100 * 10**6),
        ("16160MiB", 16160 * 2**20),
        ("80 GiB", 80 * 2**30),
        ("1024B", 1024),
        ("1073741824", 2**30),
        ("1e9", 10**9),
        (1073741824, 2**30),
        (2.0e9, 2 * 10**9),
        (0, 0),
    ],
)
def test_parse_bytes(text: object, expected: int) -> None:
    result = parse_bytes(text)
    assert result == expected
    assert isinstance(result, int)


def test_binary_and_decimal_prefixes_differ() -> None:
    assert parse_bytes("1GiB") == 1_073_741_824
    assert parse_bytes("1GB") == 1_000_000_000


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("900GB/s", 900e9),
        ("2039GB/s", 2039e9),
        ("25GB/s", 25e9),
        ("4.8TB/s", 4.8e12),
        ("56.25GB/s", 56.25e9),
        ("1GiB/s", 2.0**30),
        ("25GBps", 25e9),
        # bits: a small b, divided by 8
        ("100Gb/s", 12.5e9),
        ("200Gb/s", 25e9),
        ("100Gbit/s", 12.5e9),
        ("100Gbps", 12.5e9),
        ("8b/s", 1.0),
        (12.5e9, 12.5e9),
        ("12500000000", 12.5e9),
    ],
)
def test_parse_bandwidth(text: object, expected: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(expected, rel=1e-15)


def test_bits_versus_bytes() -> None:
    assert parse_bandwidth("100GB/s") == 8 * parse_bandwidth("100Gb/s")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("312TFLOPS", 312e12),
        ("19.5TFLOPS", 19.5e12),
        ("19.5 TFLOPS", 19.5e12),
        ("1.2PFLOPS", 1.2e15),
        ("50GFLOPS", 50e9),
        ("GFLOPS", None),  # a unit without a number is not a quantity
        ("156TFLOP/s", 156e12),
        ("67Tflops", 67e12),
        ("624TOPS", 624e12),
        ("1e12", 1e12),
        (19.5e12, 19.5e12),
    ],
)
def test_parse_flops(text: object, expected: float | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match="FLOP rate"):
            parse_flops(text)
    else:
        assert parse_flops(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2us", 2e-6),
        ("5\u00b5s", 5e-6),  # micro sign
        ("5\u03bcs", 5e-6),  # Greek mu
        ("1.5ms", 1.5e-3),
        ("10ns", 10e-9),
        ("1s", 1.0),
        ("80us", 80e-6),
        (0.25, 0.25),
        (0, 0.0),
    ],
)
def test_parse_seconds(text: object, expected: float) -> None:
    # Exact: the factors are decimal, so "5us" is the float nearest 5e-6.
    assert parse_seconds(text) == expected


@pytest.mark.parametrize(
    ("parse", "value", "fragment"),
    [
        (parse_bytes, "80 gigs", "byte size"),
        (parse_bytes, "16Gb", "unknown unit 'Gb'"),  # bits are not a memory size
        (parse_bytes, "GiB", "byte size"),
        (parse_bytes, "", "byte size"),
        (parse_bytes, "-1GB", "negative"),
        (parse_bytes, -5, "negative"),
        (parse_bytes, float("nan"), "finite"),
        (parse_bytes, float("inf"), "finite"),
        (parse_bytes, True, "byte size"),
        (parse_bytes, None, "byte size"),
        (parse_bytes, [1], "byte size"),
        (parse_bandwidth, "900GB", "unknown unit 'GB'"),
        (parse_bandwidth, "fast", "bandwidth"),
        (parse_bandwidth, "nan", "bandwidth"),
        (parse_flops, "312TB/s", "unknown unit"),
        (parse_flops, "-1TFLOPS", "negative"),
        (parse_seconds, "2 parsecs", "unknown unit"),
        (parse_seconds, "1.2.3s", "time"),
        (parse_seconds, "-2us", "negative"),
    ],
)
def test_bad_values_say_what_was_expected(parse, value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match="expected") as info:
        parse(value, field="memory")
    message = str(info.value)
    assert fragment in message
    assert message.startswith("memory: ")
    assert "\n" not in message
    assert isinstance(info.value, UnitError)
    assert info.value.field == "memory"
    assert not info.value.detail.startswith("memory")


def test_zero_allowed_unless_refused() -> None:
    assert parse_seconds("0us") == 0.0
    assert parse_bandwidth(0) == 0.0
    for parse, zero in ((parse_bytes, "0GiB"), (parse_bandwidth, "0GB/s"), (parse_flops, "0TFLOPS")):
        with pytest.raises(ValueError, match="greater than zero"):
            parse(zero, allow_zero=False)
    with pytest.raises(ValueError, match="at least one byte"):
        parse_bytes(0.4, allow_zero=False)


def test_format_bytes() -> None:
    assert format_bytes(80 * 2**30) == "80.0 GiB"
    assert format_bytes(512 * 2**20) == "512.0 MiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(100) == "100 B"
    assert format_bytes(2 * 2**40) == "2.0 TiB"


def test_format_seconds() -> None:
    assert format_seconds(1.5) == "1.50 s"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(2e-6) == "2.00 us"
    assert format_seconds(10e-9) == "10.0 ns"
    assert format_seconds(0) == "0 s"
    assert format_seconds(1234.0) == "1234 s"


def test_format_rates() -> None:
    assert format_bandwidth(2039e9) == "2.0 TB/s"
    assert format_bandwidth(900e9) == "900.0 GB/s"
    assert format_flops(312e12) == "312.0 TFLOPS"
    assert format_flops(50e9) == "50.0 GFLOPS"


def test_round_trip_through_text() -> None:
    for n in (80 * 2**30, 512 * 2**20):
        number, unit = format_bytes(n).split()
        assert parse_bytes(f"{number}{unit}") == n
    assert math.isclose(parse_flops(format_flops(19.5e12).replace(" ", "")), 19.5e12)
