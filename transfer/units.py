"""Parsing of bandwidth and latency values written with units (YAML, CLI)."""

from __future__ import annotations

import math
import re

_PREFIXES: dict[str, float] = {
    "": 1.0,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 2.0**10,
    "mi": 2.0**20,
    "gi": 2.0**30,
    "ti": 2.0**40,
}
_LATENCY_UNITS: dict[str, float] = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_NUMBER = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([^\s]*)\s*$")


def _split(value: object, what: str) -> tuple[float, str]:
    match = _NUMBER.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"cannot read {what} {value!r}")
    return float(match.group(1)), match.group(2)


def _finite(value: float, text: object, what: str) -> float:
    """`value` (read from `text`) if it is a finite number, as YAML and JSON allow
    numbers no float holds."""
    try:
        result = float(value)
    except OverflowError:
        result = math.inf
    if not math.isfinite(result):
        shown = repr(text)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise ValueError(f"{what} {shown} is not a finite number")
    return result


def parse_bandwidth(value: float | int | str) -> float:
    """Bytes per second from a number (already B/s) or a string such as '400Gbps', '450GB/s'.

    Network gear is quoted in bits and buses in bytes, so both are accepted; as vendors
    write them, 'Gb/s' and 'Gbps' are bits and 'GB/s' is bytes.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _finite(value, value, "bandwidth")
    number, unit = _split(value, "bandwidth")
    if unit == "":
        return _finite(number, value, "bandwidth")
    lower = unit.lower()
    if lower.endswith("bps"):
        prefix, per_unit = lower[:-3], 1 / 8
    elif lower.endswith("bit/s"):
        prefix, per_unit = lower[:-5], 1 / 8
    elif unit.endswith("B/s"):
        prefix, per_unit = lower[:-3], 1.0
    elif unit.endswith("b/s"):
        prefix, per_unit = lower[:-3], 1 / 8
    else:
        raise ValueError(f"unknown unit in bandwidth {value!r}")
    if prefix not in _PREFIXES:
        raise ValueError(f"unknown unit in bandwidth {value!r}")
    return _finite(number * _PREFIXES[prefix] * per_unit, value, "bandwidth")


def parse_latency(value: float | int | str) -> float:
    """Seconds from a number (already seconds) or a string such as '2us', '1.5ms'."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _finite(value, value, "latency")
    number, unit = _split(value, "latency")
    factor = _LATENCY_UNITS.get(unit.lower()) if unit else 1.0
    if factor is None:
        raise ValueError(f"unknown unit in latency {value!r}")
    return _finite(number * factor, value, "latency")


def parse_size(value: int | str) -> int:
    """Bytes from an integer or a string such as '64MiB', '1G', '1e9'."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number, unit = _split(value, "size")
    factor = _SIZE_UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown unit in size {value!r}")
    result = _finite(number * factor, value, "size")
    if result != int(result):
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return int(result)


def format_bytes(num_bytes: float) -> str:
    """Human-readable size with binary prefixes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def format_seconds(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.2f} us"
