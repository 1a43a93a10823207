"""Exporters to parallelize_module / HF tp_plan, and the importer back to pins."""

import pytest
import torch
from helpers import SHARDING_PROFILE

import autoshard
from autoshard.export import to_hf_tp_plan, to_parallelize_module_plan, tp_plan_to_pins
from autoshard.models import llama

MEGATRON = {
    "embed": "rowwise",
    "head": "colwise",
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise",
    "layers.*.attn.wo": "rowwise",
    "layers.*.ffn.w1": "colwise",
    "layers.*.ffn.w3": "colwise",
    "layers.*.ffn.w2": "rowwise",
}


@pytest.fixture
def setup(world):
    world(4)
    torch.manual_seed(0)
    model = llama("tiny")
    tokens = torch.randint(0, 256, (8, 16))
    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    return model, tokens, mesh


def test_megatron_plan_round_trips(setup):
    model, tokens, mesh = setup
    megatron = autoshard.compare(model, (tokens,), mesh, baselines=("tp",), profile=SHARDING_PROFILE,
                                 memory_budget=None)["tp"]
    exported = to_hf_tp_plan(megatron, model)
    assert exported == MEGATRON
    styles = to_parallelize_module_plan(megatron, model)
    assert type(styles["layers.0.attn.wq"]).__name__ == "ColwiseParallel"
    assert type(styles["layers.1.ffn.w2"]).__name__ == "RowwiseParallel"
    pins = tp_plan_to_pins(model, exported, megatron.axis_names, data_parallel="ddp")
    for fqn, _ in model.named_parameters():
        assert pins[fqn] == megatron.param_spec(fqn), fqn


def test_imported_hand_plan_is_costed_and_never_beats_ours(setup):
    model, tokens, mesh = setup
    ours = autoshard.plan(model, (tokens,), mesh, profile=SHARDING_PROFILE, memory_budget=None)
    for dp in ("ddp", "fsdp"):
        pins = tp_plan_to_pins(model, MEGATRON, ["dp", "tp"], data_parallel=dp)
        theirs = autoshard.plan(model, (tokens,), mesh, profile=SHARDING_PROFILE, memory_budget=None, pins=pins)
        assert theirs.summary["pinned"] == len(pins)
        assert theirs.param_spec("layers.0.attn.wq.weight") == pins["layers.0.attn.wq.weight"]
        assert ours.summary["step_us"] <= theirs.summary["step_us"] + 1e-6


def test_inexpressible_plans_and_bad_tp_plans_are_reported(setup):
    model, tokens, mesh = setup
    plan = autoshard.plan(model, (tokens,), mesh, profile=SHARDING_PROFILE, memory_budget=None,
                          pins={"norm.weight": "RS(0)"})
    with pytest.raises(autoshard.PlanError, match="norm.weight S\\(0\\)"):
        to_hf_tp_plan(plan, model)
    with pytest.raises(autoshard.PlanError, match="not a mesh axis"):
        to_hf_tp_plan(plan, model, tp_axis="model")
    with pytest.raises(autoshard.PlanError, match="matches no module"):
        tp_plan_to_pins(model, {"layers.*.mlp.up": "colwise"}, ["dp", "tp"])
    with pytest.raises(autoshard.PlanError, match="expected 'colwise' or 'rowwise'"):
        tp_plan_to_pins(model, {"head": "sequence"}, ["dp", "tp"])
