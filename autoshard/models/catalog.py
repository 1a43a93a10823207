"""The reference model families by name (``llama-8b``, ``gpt2-small``, ``moe-deepseek-v3``): the CLI,
the plan service and the benchmarks build their models from here. Apart from ``autoshard.models``
because the MoE family builds on that module's blocks."""

from __future__ import annotations

import torch.nn as nn

from autoshard.errors import ConfigError
from autoshard.models.dense import GPT2_PRESETS, LLAMA_PRESETS, gpt2, llama
from autoshard.models.moe import MOE_PRESETS, moe


def families() -> dict[str, tuple]:
    """Reference model families: name -> (constructor, presets)."""
    return {"llama": (llama, LLAMA_PRESETS), "gpt2": (gpt2, GPT2_PRESETS), "moe": (moe, MOE_PRESETS)}


def parse_reference(name: str) -> tuple[str, str]:
    """``"llama-8b"`` -> ``("llama", "8b")``, checked against the families and their presets."""
    family, _, preset = name.partition("-")
    known_families = families()
    if family not in known_families or preset not in known_families[family][1]:
        known = [f"{f}-{p}" for f, (_, presets) in known_families.items() for p in presets]
        raise ConfigError(f"reference model {name!r}: expected one of {known}")
    return family, preset


def reference(family: str, preset: str, seq: int | None = None, **overrides) -> nn.Module:
    """A reference model (``reference("llama", "8b", seq=4096, n_layers=2)``); ``seq`` raises a
    RoPE model's ``max_seq_len`` (its RoPE tables) to fit sequences that long."""
    known = families()
    if family not in known:
        raise ConfigError(f"reference model family: expected one of {sorted(known)}, found {family!r}")
    make, presets = known[family]
    if seq is not None and "max_seq_len" in presets.get(preset, {}):
        overrides.setdefault("max_seq_len", max(seq, presets[preset]["max_seq_len"]))
    return make(preset, **overrides)
