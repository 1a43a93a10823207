"""Planning requests: what a client may ask, validated, made into a model, and keyed.

A request names its model as data, never as code: a reference model
(``{"reference": "llama", "preset": "8b", "overrides": {...}}``) or a Hugging Face
config class with a config dict (``{"hf_config": "LlamaConfig", "config": {...}}``).
The cache key is a SHA-256 over the canonical request (model description, input
shape, mesh, the profile's content digest, constraints) and the autoshard and torch
versions: at a fixed version the description determines the traced graph.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

HF_CONFIGS = {"LlamaConfig": "LlamaForCausalLM", "GPT2Config": "GPT2LMHeadModel"}


class ModelSpec(BaseModel):
    reference: Literal["llama", "gpt2"] | None = None
    """A reference model of :mod:`autoshard.models`."""
    preset: str = "tiny"
    overrides: dict = Field(default_factory=dict)
    """Config fields changed from the preset."""
    hf_config: Literal["LlamaConfig", "GPT2Config"] | None = None
    """A Hugging Face config class (the model is built from it, nothing is downloaded)."""
    config: dict = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_kind(self):
        if (self.reference is None) == (self.hf_config is None):
            raise ValueError("model: give exactly one of 'reference' (llama, gpt2) or 'hf_config' "
                             f"({', '.join(HF_CONFIGS)})")
        if self.reference is not None:
            from autoshard.models import GPT2_PRESETS, LLAMA_PRESETS, LlamaConfig, TransformerConfig

            presets, cfg = (LLAMA_PRESETS, LlamaConfig) if self.reference == "llama" else \
                (GPT2_PRESETS, TransformerConfig)
            if self.preset not in presets:
                raise ValueError(f"model.preset: expected one of {sorted(presets)} for {self.reference}, "
                                 f"found {self.preset!r}")
            fields = {f.name for f in dataclasses.fields(cfg)}
            unknown = sorted(set(self.overrides) - fields)
            if unknown:
                raise ValueError(f"model.overrides: {unknown} are not {cfg.__name__} fields {sorted(fields)}")
        return self


class MeshSpec(BaseModel):
    shape: list[int]
    axis_names: list[str]

    @model_validator(mode="after")
    def _check(self):
        if not self.shape or any(s < 1 for s in self.shape):
            raise ValueError(f"mesh.shape: expected sizes >= 1, found {self.shape}")
        if len(self.shape) != len(self.axis_names) or len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh: expected one distinct name per axis, found shape {self.shape} and "
                             f"names {self.axis_names}")
        if len(self.shape) > 5 or any(s > 4096 for s in self.shape):
            raise ValueError(f"mesh: at most 5 axes of size <= 4096, found {self.shape}")
        return self


class PlanRequest(BaseModel):
    model: ModelSpec
    batch: int = Field(gt=0, le=1 << 20)
    seq: int = Field(gt=0, le=1 << 20)
    mesh: MeshSpec
    profile: str = "h100-sxm"
    """A shipped profile name, or ``upload:<id>`` for an uploaded one."""
    memory_budget: int | Literal["auto"] | None = "auto"
    pins: dict[str, str] = Field(default_factory=dict)
    time_limit: float = Field(default=60.0, gt=0)
    compute_dtype: str | None = "bfloat16"
    """The dtype every op is priced in (``PlanOptions.compute_dtype``): the shapes planned here
    are float32 master weights, trained by default with bf16 compute; None: as traced."""

    @field_validator("compute_dtype")
    @classmethod
    def _compute_dtype(cls, v):
        from autoshard.options import PlanOptions

        PlanOptions(compute_dtype=v)  # raises with the expected names
        return v

    @field_validator("pins")
    @classmethod
    def _pins(cls, v):
        if len(v) > 1000:
            raise ValueError(f"pins: at most 1000, found {len(v)}")
        return v


def build_model(spec: ModelSpec, batch: int, seq: int):
    """(meta-device model, example inputs) for a validated spec."""
    import torch

    with torch.device("meta"):
        if spec.reference is not None:
            from autoshard.models.catalog import reference

            model = reference(spec.reference, spec.preset, seq=seq, **spec.overrides)
        else:
            import transformers

            cfg = getattr(transformers, spec.hf_config)(**spec.config)
            cfg._attn_implementation = "eager"  # the fused CPU kernel has no sharding rule
            model = getattr(transformers, HF_CONFIGS[spec.hf_config])(cfg)
    return model, (torch.empty(batch, seq, dtype=torch.long, device="meta"),)


def fingerprint(kind: str, canonical: dict, profile_digest: str) -> str:
    import torch

    import autoshard

    text = json.dumps({"kind": kind, "request": canonical, "profile": profile_digest,
                       "autoshard": autoshard.__version__, "torch": torch.__version__}, sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def canonical_plan_request(req: PlanRequest) -> dict:
    """The request minus what does not change the answer (the time limit)."""
    d = req.model_dump()
    d.pop("time_limit", None)
    return d
