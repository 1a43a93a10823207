"""Byte sizes as people write them: ``70GiB`` in, ``1.500 GiB`` out."""

from __future__ import annotations

import re

from autoshard.errors import ConfigError

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"70GiB"`` -> 75161927680; binary (KiB ...) and decimal (KB ...) units, case-insensitive."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise ConfigError(f"memory size {text!r}: expected a number with an optional unit "
                          f"({', '.join(u for u in UNITS if u)}), e.g. 70GiB")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def parse_budget(text: str) -> float:
    """A memory budget as given on the command line: a size (``"70GiB"``) or a share of the
    device's memory (``"90%"`` -> 0.9)."""
    t = text.strip()
    if t.endswith("%"):
        try:
            share = float(t[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise ConfigError(f"memory budget {text!r}: expected a share of the device's memory in (0%, 100%]")
        return share
    return parse_bytes(text)


def human_bytes(n: float) -> str:
    """The largest binary unit that keeps the number >= 1: ``1.500 GiB``, ``12 B``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{int(n)} B"
