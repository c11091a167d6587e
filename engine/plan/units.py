"""Byte sizes as people write them (12GiB, 12G, 141GB, 12884901888) and back."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, field: str = "size") -> int:
    """'12GiB' -> 12884901888. Kubernetes' 'Gi'/'G' suffixes are accepted too."""
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"{field} must be positive, got {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"{field} {text!r} is not a size such as 12GiB, 24G or 141GB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{field} must be positive, got {text!r}")
    return value


def format_bytes(num_bytes: int | float) -> str:
    """Binary units, three significant figures: 1.07 GiB."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"
