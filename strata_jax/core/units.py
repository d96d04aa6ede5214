"""Byte sizes as people write them ("32GiB", "24 GB", "1.5g", 1073741824) and back."""

from __future__ import annotations

import re

from strata_jax.core.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}


def parse_size(value: str | int | float, name: str = "size") -> int:
    """Bytes from an int or a string with an optional unit (binary K/M/G/T and KiB..., decimal KB...).
    name: the option or its command-line flag (a flag shows as `--flag 'value'` in the error)."""
    m = None if isinstance(value, (bool, int, float)) else re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*",
                                                                         str(value))
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    if m and m.group(2).lower() in _UNITS:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    shown = f"{name} {value!r}" if name.startswith("-") else f"{name}={value!r}"
    raise ConfigError(f"{shown} is not a size: write e.g. 32GiB, 24GB, 512MiB or a number of bytes (>= 0).")


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
