"""Parsing of human unit strings ("100Mbit", "25GB/s", "10ms") into bytes/s and seconds.

This is the only place in the toolkit that understands unit suffixes; everything else works in
bytes, bytes/s and seconds.
"""

from __future__ import annotations

import re

__all__ = ["parse_bandwidth", "parse_latency", "format_bandwidth", "parse_node_link",
           "NODE_LINK_SYNTAX"]

# The one syntax of a per-node link, in configs, on the command line and in run.json.
NODE_LINK_SYNTAX = "NODE=BANDWIDTH[,LATENCY]"

_NUMBER_UNIT = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-zµ/]*)\s*$")

# Decimal prefixes for bits and bytes; binary prefixes only for bytes ("MiB"), as in iperf/tc usage.
_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _split(value: object, what: str, example: str) -> tuple[float, str]:
    """Split a number-with-unit into its parts, or raise one clear ValueError."""
    if isinstance(value, bool):
        raise ValueError(
            f"{what} {value!r} is not valid; give a number or a string such as {example}."
        )
    if isinstance(value, (int, float)):
        return float(value), ""
    if not isinstance(value, str):
        raise ValueError(
            f"{what} {value!r} is not valid; give a number or a string such as {example}."
        )
    match = _NUMBER_UNIT.match(value)
    if match is None:
        raise ValueError(
            f"{what} {value!r} is not valid; give a number with a unit, such as {example}."
        )
    return float(match.group(1)), match.group(2)


def _byte_multiplier(unit: str) -> float | None:
    """Bytes per unit for a size unit such as "MB", "MiB", "Gbit"; None when unknown."""
    if unit.lower().endswith("bit"):
        prefix = unit[:-3].lower()
        return _DECIMAL[prefix] / 8.0 if prefix in _DECIMAL else None
    if unit.endswith("b"):
        # A lower-case "b" means bits ("Mb", "Gbps"), as network people write it.
        prefix = unit[:-1].lower()
        return _DECIMAL[prefix] / 8.0 if prefix in _DECIMAL else None
    if unit.endswith("B"):
        prefix = unit[:-1].lower()
        if prefix in _DECIMAL:
            return _DECIMAL[prefix]
        if prefix in _BINARY:
            return _BINARY[prefix]
        return None
    return None


def parse_bandwidth(value: object) -> float:
    """Bandwidth in bytes/s from a number (bytes/s) or a string: "100Mbit", "1Gbps", "25GB/s"."""
    example = '"100Mbit", "1Gbit/s" or "25GB/s"'
    number, unit = _split(value, "bandwidth", example)
    if unit:
        base = unit[:-2] if unit.endswith("/s") else unit[:-2] if unit.endswith("ps") else unit
        mult = _byte_multiplier(base) if base else None
        if mult is None:
            raise ValueError(
                f"bandwidth {value!r} has an unknown unit {unit!r}; use bit/s units (bit, Kbit, "
                f"Mbit, Gbit, Tbit, Mbps) or byte/s units (B/s, KB/s, MB/s, GB/s, MiB/s, GiB/s)."
            )
        number *= mult
    if not number > 0 or number == float("inf"):
        raise ValueError(f"bandwidth {value!r} must be a positive finite rate, such as {example}.")
    return number


def parse_latency(value: object) -> float:
    """Latency in seconds from a number (seconds) or a string like "10ms", "200us", "1.5s"."""
    example = '"10ms", "200us" or "0.5s"'
    number, unit = _split(value, "latency", example)
    if unit not in _SECONDS:
        raise ValueError(f"latency {value!r} has an unknown unit {unit!r}; use s, ms, us or ns.")
    number *= _SECONDS[unit]
    if not number >= 0 or number == float("inf"):
        raise ValueError(
            f"latency {value!r} must be zero or a positive finite time, such as {example}."
        )
    return number


def format_bandwidth(bytes_per_s: float) -> str:
    """Short human string in bit/s for a rate in bytes/s (e.g. 12.5e6 -> "100Mbit")."""
    bits = bytes_per_s * 8.0
    for prefix, mult in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if bits >= mult:
            return f"{bits / mult:g}{prefix}bit"
    return f"{bits:g}bit"


def parse_node_link(spec: object) -> tuple[int, float, float | None]:
    """(node, bytes/s, seconds or None) from a per-node link such as "3=100Mbit,20ms"."""
    example = f'{NODE_LINK_SYNTAX}, such as "3=100Mbit,20ms" or "1=1Gbit"'
    if not isinstance(spec, str):
        raise ValueError(f"node link {spec!r} is not valid; give a string {example}.")
    node_text, sep, link_text = spec.partition("=")
    parts = [p.strip() for p in link_text.split(",")]
    if not sep or not node_text.strip().isdigit() or not 1 <= len(parts) <= 2 or not parts[0]:
        raise ValueError(f"node link {spec!r} does not parse; write it as {example}.")
    try:
        bandwidth = parse_bandwidth(parts[0])
        latency = parse_latency(parts[1]) if len(parts) == 2 else None
    except ValueError as err:
        raise ValueError(f"node link {spec!r} does not parse: {err}") from None
    return int(node_text), bandwidth, latency
