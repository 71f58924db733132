"""Quantities with units: byte sizes, bandwidths, FLOP rates and times.

A quantity is a number in SI base units or a string as datasheets write it (``80GiB``, ``900GB/s``,
``100Gb/s``, ``312TFLOPS``, ``2us``): decimal prefixes are powers of 1000, binary ones of 1024, and in a
bandwidth ``B`` means bytes and ``b`` bits. Negative, NaN, infinite and boolean values raise
:class:`UnitError` (a :class:`ValueError`), and zero does where ``allow_zero=False``. Table: docs/core.md.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

__all__ = [
    "UnitError",
    "format_bandwidth",
    "format_bytes",
    "format_flops",
    "format_seconds",
    "parse_bandwidth",
    "parse_bytes",
    "parse_flops",
    "parse_seconds",
]

# Factors are exact decimals so that "5us" parses to the float nearest 5e-6, not to 5 * 1e-6.
_DECIMAL = {
    p: Decimal(f)
    for p, f in {
        "": "1",
        "k": "1e3",
        "K": "1e3",
        "M": "1e6",
        "G": "1e9",
        "T": "1e12",
        "P": "1e15",
        "E": "1e18",
    }.items()
}
_BINARY = {p: Decimal(2) ** e for p, e in {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50}.items()}

# Byte-size units: B with a decimal or a binary prefix.
_BYTE_UNITS: dict[str, Decimal] = {f"{p}B": f for p, f in {**_DECIMAL, **_BINARY}.items()}

# Bandwidth units: bytes (B/s, Bps) or bits (b/s, bit/s, bps), with a decimal or a binary prefix.
_BANDWIDTH_UNITS: dict[str, Decimal] = {}
for _p, _f in {**_DECIMAL, **_BINARY}.items():
    for _suffix in ("B/s", "Bps"):
        _BANDWIDTH_UNITS[f"{_p}{_suffix}"] = _f
    for _suffix in ("b/s", "bit/s", "bps"):
        _BANDWIDTH_UNITS[f"{_p}{_suffix}"] = _f / 8

# FLOP-rate units, matched case-insensitively (datasheets write TFLOPS, TFLOP/s, Tflops; int8 as TOPS).
_FLOPS_PREFIXES = {p.lower(): f for p, f in _DECIMAL.items()}
_FLOPS_UNITS: dict[str, Decimal] = {
    f"{p}{suffix}": f for p, f in _FLOPS_PREFIXES.items() for suffix in ("flops", "flop/s", "ops", "op/s")
}

# Time units; both the micro sign (U+00B5) and the Greek mu (U+03BC) are accepted.
_TIME_UNITS = {
    unit: Decimal(f)
    for unit, f in {
        "s": "1",
        "ms": "1e-3",
        "us": "1e-6",
        "\u00b5s": "1e-6",
        "\u03bcs": "1e-6",
        "ns": "1e-9",
    }.items()
}

_QUANTITY = re.compile(
    r"^\s*(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[^\s\d.+-][^\s]*)?\s*$"
)


class UnitError(ValueError):
    """A quantity that could not be parsed; ``detail`` is the message without the field name."""

    def __init__(self, field: str, detail: str) -> None:
        self.field = field
        self.detail = detail
        super().__init__(f"{field}: {detail}")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse(
    value: object,
    *,
    field: str,
    units: dict[str, Decimal],
    expected: str,
    allow_zero: bool,
    case_insensitive: bool = False,
) -> float:
    """Parse ``value`` (a number in base units, or a string with one of ``units``) to base units."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise UnitError(field, f"expected {expected}; got {_show(value)}")
    if isinstance(value, str):
        match = _QUANTITY.match(value)
        if match is None:
            raise UnitError(field, f"expected {expected}; got {_show(value)}")
        unit = match["unit"] or ""
        key = unit.lower() if case_insensitive else unit
        if not unit:  # a bare number is in base units
            number = float(Decimal(match["number"]))
        elif key not in units:
            raise UnitError(field, f"unknown unit {unit!r}: expected {expected}; got {_show(value)}")
        else:
            number = float(Decimal(match["number"]) * units[key])
    else:
        number = float(value)
    if math.isnan(number) or math.isinf(number):
        raise UnitError(field, f"not finite: expected {expected}; got {_show(value)}")
    if number < 0:
        raise UnitError(field, f"must not be negative: expected {expected}; got {_show(value)}")
    if number == 0 and not allow_zero:
        raise UnitError(field, f"must be greater than zero: expected {expected}; got {_show(value)}")
    return number


def parse_bytes(value: object, *, field: str = "value", allow_zero: bool = True) -> int:
    """Parse a byte size: ``80GiB``, ``16GB``, ``512MiB``, ``1.5TB`` or a number of bytes.

    Returns whole bytes, rounded to the nearest byte (``0.1GiB`` is not a whole number of bytes).
    """
    number = _parse(
        value,
        field=field,
        units=_BYTE_UNITS,
        expected="a byte size such as 80GiB, 512MiB, 16GB or a number of bytes",
        allow_zero=allow_zero,
    )
    result = round(number)
    if result == 0 and not allow_zero:
        raise UnitError(field, f"must be at least one byte; got {_show(value)}")
    return result


def parse_bandwidth(value: object, *, field: str = "value", allow_zero: bool = True) -> float:
    """Parse a bandwidth to bytes per second: ``900GB/s``, ``100Gb/s`` (bits), ``25GiB/s`` or a number."""
    return _parse(
        value,
        field=field,
        units=_BANDWIDTH_UNITS,
        expected="a bandwidth such as 900GB/s, 100Gb/s (bits) or a number of bytes per second",
        allow_zero=allow_zero,
    )


def parse_flops(value: object, *, field: str = "value", allow_zero: bool = True) -> float:
    """Parse a FLOP rate to FLOP per second: ``312TFLOPS``, ``19.5 TFLOPS``, ``1.2PFLOPS``, ``624TOPS``."""
    return _parse(
        value,
        field=field,
        units=_FLOPS_UNITS,
        expected="a FLOP rate such as 312TFLOPS, 50GFLOPS or a number of FLOP per second",
        allow_zero=allow_zero,
        case_insensitive=True,
    )


def parse_seconds(value: object, *, field: str = "value", allow_zero: bool = True) -> float:
    """Parse a time to seconds: ``2us``, ``5µs``, ``1.5ms``, ``10ns``, ``1s`` or a number of seconds."""
    return _parse(
        value,
        field=field,
        units=_TIME_UNITS,
        expected="a time such as 2us, 1.5ms, 10ns or a number of seconds",
        allow_zero=allow_zero,
    )


def _scaled(value: float, steps: list[tuple[float, str]], digits: int) -> str:
    for factor, unit in steps:
        if abs(value) >= factor:
            return f"{value / factor:.{digits}f} {unit}"
    factor, unit = steps[-1]
    return f"{value / factor:.{digits}f} {unit}"


def format_bytes(n: float) -> str:
    """A byte size for people, in binary units: ``80.0 GiB``, ``512.0 MiB``, ``100 B``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    steps = [(2.0**50, "PiB"), (2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB")]
    return _scaled(float(n), steps, 1)


def format_bandwidth(bytes_per_s: float) -> str:
    """A bandwidth for people, in decimal units as datasheets give them: ``2039.0 GB/s``."""
    steps = [(1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s"), (1.0, "B/s")]
    return _scaled(float(bytes_per_s), steps, 1)


def format_flops(flop_per_s: float) -> str:
    """A FLOP rate for people: ``312.0 TFLOPS``, ``50.0 GFLOPS``."""
    steps = [(1e15, "PFLOPS"), (1e12, "TFLOPS"), (1e9, "GFLOPS"), (1e6, "MFLOPS"), (1.0, "FLOPS")]
    return _scaled(float(flop_per_s), steps, 1)


def format_seconds(seconds: float) -> str:
    """A time for people with three significant digits: ``1.50 s``, ``12.3 ms``, ``2.00 us``, ``0 s``."""
    if seconds == 0:
        return "0 s"
    for factor, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")):
        if abs(seconds) >= factor or unit == "ns":
            scaled = seconds / factor
            # Three significant digits: 1.50, 12.3, 123.
            decimals = max(0, 2 - int(math.floor(math.log10(abs(scaled))))) if scaled else 0
            return f"{scaled:.{decimals}f} {unit}"
    raise AssertionError("unreachable")
