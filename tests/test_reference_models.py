"""Reference models (LLaMA, GPT-2) and Hugging Face models: planned, tied, applied, trained."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from helpers import (
    SHARDING_PROFILE,
    LocalTensorMode,
    full,
    lift_replicated_locals,
    local_mesh,
    reference_adamw,
    reference_step,
)

import autoshard
from autoshard.models import gpt2, llama
from costmodel import LinkModel

MESHES = [((4,), ("dp",)), ((2, 2), ("dp", "tp")), ((2, 2, 2), ("rep", "dp", "tp"))]


def tiny(name):
    torch.manual_seed(0)
    if name == "llama":
        return llama("tiny", n_layers=2, max_seq_len=16)
    return gpt2("tiny")


def tokens(vocab=256):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (8, 16), generator=g)


def lm_loss(out):
    # Next-token-free stand-in: a smooth scalar of every logit (exercises the whole head).
    return out.float().pow(2).mean()


def plan_tiny(name, shape, names, **kw):
    """(tiny model, tokens, its plan on a fake mesh) with the sharding-friendly test profile."""
    model, x = tiny(name), tokens()
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh(shape, names), profile=SHARDING_PROFILE,
                          loss_fn=lm_loss, memory_budget=None, **kw)
    return model, x, plan


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("shape, names", MESHES)
def test_sharded_training_matches_single_device(world, name, shape, names):
    """Loss and every gradient equal single-device ones, and three AdamW steps keep the
    parameters equal (so optimizer state on sharded parameters is right too)."""
    world(int(torch.tensor(shape).prod()))
    model, x, plan = plan_tiny(name, shape, names)
    assert any("S(" in str(plan.param_spec(f)) for f in plan.params) or any("S(" in s for s in plan.inputs), \
        plan.describe()
    ref = copy.deepcopy(model)
    ref_losses, ref_grads = reference_adamw(ref, (x,), lm_loss)
    with LocalTensorMode(int(torch.tensor(shape).prod())) as mode:
        mesh = local_mesh(shape, names)
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh)
        lift_replicated_locals(sharded, mode)
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        for step in range(3):
            opt.zero_grad()
            loss = lm_loss(sharded(x))
            loss.backward()
            assert full(loss).item() == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-5)
            if step == 2:
                for fqn, p in sharded.named_parameters():
                    torch.testing.assert_close(full(p.grad), ref_grads[fqn], rtol=1e-4, atol=1e-5, msg=fqn)
            opt.step()
        ref_params = dict(ref.named_parameters())
        for fqn, p in sharded.named_parameters():
            got, want = full(p.detach()), ref_params[fqn].detach()
            err = (got - want).abs().max().item()
            assert err <= 1e-4, f"{fqn}: max |sharded - single| = {err:.3g} after 3 AdamW steps"


def test_repeated_layers_are_tied(world):
    """The solver sees one layer: every layer's parameters get layer 0's specs, and the
    tie groups cover the layers' nodes."""
    world(64)
    mesh = autoshard.fake_mesh((8, 8), ("dp", "tp"))
    with torch.device("meta"):
        model = llama("tiny", n_layers=4, dim=256, n_heads=8, ffn_dim=512)
    x = torch.empty(64, 64, dtype=torch.long, device="meta")
    tg = autoshard.trace(model, (x,))
    assert tg.layer_groups == [[f"layers.{i}" for i in range(4)]]
    from autoshard.planning.problem import build_problem
    from costmodel import load_profile

    gp = build_problem(tg, mesh, load_profile("h100-sxm"), None)
    tied = sum(len(t) for t in gp.problem.ties)
    assert len(gp.problem.ties) > 50 and all(len(t) == 4 for t in gp.problem.ties)
    assert tied > 0.75 * gp.problem.num_nodes
    plan = autoshard.plan(model, (x,), mesh, profile="h100-sxm")
    for fqn, place in plan.params.items():
        if fqn.startswith("layers."):
            head = "layers.0." + fqn.split(".", 2)[2]
            assert place.placements == plan.params[head].placements, fqn
            assert place.shard_order == plan.params[head].shard_order, fqn


def test_untied_plan_is_never_cheaper_than_tied_by_much(world):
    """Ties restrict the solver: the untied optimum is never dearer; on identical layers the
    tied one matches it (a 3.4% gap here came from the tagging hooks' identity views, now
    removed from the traced graph)."""
    world(16)
    mesh = autoshard.fake_mesh((4, 4), ("dp", "tp"))
    with torch.device("meta"):
        model = llama("tiny", n_layers=3)
    x = torch.empty(16, 32, dtype=torch.long, device="meta")
    tied = autoshard.plan(model, (x,), mesh, profile="h100-sxm")
    free = autoshard.plan(model, (x,), mesh, profile="h100-sxm", tie_layers=False)
    assert free.summary["step_us"] <= tied.summary["step_us"] + 1e-6
    assert tied.summary["step_us"] == pytest.approx(free.summary["step_us"], rel=1e-6)


class Scale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.w


def test_non_default_shard_order_is_chosen_when_cheaper(world):
    """FSDP on dp over TP on tp: with the batch on dp and the features on tp, a 1-D weight
    stored S(0)[tp,dp] needs one all_gather(dp) forward and one reduce_scatter(dp) backward;
    the default order would need gathers over both axes. The budget forces full sharding."""
    world(4)
    slow_links = dataclasses.replace(SHARDING_PROFILE, intra_node=LinkModel(1.0, 0.01),
                                     inter_node=LinkModel(1.0, 0.01))
    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    model, x = Scale(4096), torch.randn(2, 2, 4096)
    kw = dict(profile=slow_links, memory_budget=70000, input_specs=["S(0)S(2)"])
    plan = autoshard.plan(model, (x,), mesh, **kw)
    assert plan.params["w"].placements == {"dp": "S(0)", "tp": "S(0)"}
    assert plan.params["w"].shard_order == {"0": ["tp", "dp"]}
    steps = {(r["from"], r["to"]): r["steps"] for r in plan.redistributes}
    assert steps[("S(0)[1,0]S(0)", "RS(0)")] == ["all_gather(dp)"]
    assert steps[("P(sum)S(0)", "S(0)[1,0]S(0)")] == ["reduce_scatter(dp)"]
    default = autoshard.plan(model, (x,), mesh, pins={"w": "S(0)S(0)"}, **kw)
    assert default.summary["step_us"] > plan.summary["step_us"] + 100


def test_the_solve_alone_is_predicted_no_slower_than_any_baseline(world):
    """The solve without hand-written seeds (the overlap objective, nothing taken from the
    baselines) is predicted no slower than any hand-written plan; the plan compare() gives
    records that solve beside itself."""
    world(4)
    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    model, x = tiny("llama"), tokens()
    alone = autoshard.plan(model, (x,), mesh, profile=SHARDING_PROFILE, memory_budget=None, seed_baselines=False)
    assert not alone.solver["source"].startswith("baseline"), alone.solver
    res = autoshard.compare(model, (x,), mesh, profile=SHARDING_PROFILE, memory_budget=None)
    assert set(res) == {"autoshard", "ddp", "fsdp", "tp", "fsdp_tp", "fsdp_tp_ac"}
    for name in ("ddp", "fsdp", "tp", "fsdp_tp", "fsdp_tp_ac"):
        assert not isinstance(res[name], str), res[name]
        assert alone.summary.step_us <= res[name].summary.step_us * (1 + 1e-6), name
    recorded = res["autoshard"].summary.solve_alone
    assert recorded["seeded"] or recorded["step_us"] == alone.summary.step_us
    # DDP pins every parameter replicated (buffers are not pinned: the solver places them).
    assert all(res["ddp"].params[f].placements == {"dp": "R", "tp": "R"} for f, _ in model.named_parameters())
    wq = res["tp"].params["layers.0.attn.wq.weight"].placements
    wo = res["tp"].params["layers.0.attn.wo.weight"].placements
    assert (wq, wo) == ({"dp": "R", "tp": "S(0)"}, {"dp": "R", "tp": "S(1)"})
    # FSDP+TP with full recomputation: FSDP+TP's placements, its compute plus the recompute.
    ac, plain = res["fsdp_tp_ac"], res["fsdp_tp"]
    assert ac.recompute["mode"] == "full" and ac.params == plain.params
    assert ac.summary["compute_us"] > plain.summary["compute_us"]


def test_tensor_parallel_pins_of_hugging_face_gpt2_split_its_conv1d_biases_on_their_only_dim():
    """HF GPT-2 stores its linears as Conv1D, (in, out): a column-parallel weight splits dim 1, and
    its 1-D bias on its only dim (the out-features' dim of the weight, 1, is no dim of the bias)."""
    from autoshard.planning.baselines import baseline_pins

    model = _hf_model("gpt2")
    for name in ("tp", "fsdp_tp"):
        pins, _ = baseline_pins(name, model, 2, (2, 2))
        assert str(pins["transformer.h.0.attn.c_attn.weight"]).endswith("S(1)"), name
        assert str(pins["transformer.h.0.attn.c_attn.bias"]).endswith("S(0)"), name
        assert str(pins["transformer.h.0.mlp.c_proj.weight"]).endswith("S(0)"), name  # row-parallel: (in, out)


def test_pins_name_parameters_modules_or_patterns():
    from autoshard.planning.pins import resolve_pins

    fqns = ["embed.weight", "layers.0.attn.wq.weight", "layers.0.attn.wk.weight", "layers.1.attn.wq.weight",
            "layers.10.attn.wq.weight", "head.weight"]
    names = ("dp", "tp")
    assert list(resolve_pins({"layers.1": "RR"}, fqns, names)) == ["layers.1.attn.wq.weight"]  # not layers.10
    assert list(resolve_pins({"layers.0.attn": "RR"}, fqns, names)) == fqns[1:3]
    assert list(resolve_pins({"head.weight": "RR"}, fqns, names)) == ["head.weight"]
    assert list(resolve_pins({"layers.*.wq": "RR"}, fqns, names)) == [fqns[1], fqns[3], fqns[4]]
    later = resolve_pins({"layers": "RR", "layers.0.attn.wq.weight": "S(0)R"}, fqns, names)
    assert str(later["layers.0.attn.wq.weight"]) != str(later["layers.1.attn.wq.weight"])  # later keys win


def test_bad_pins_are_reported(world):
    world(4)
    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    model, x = tiny("llama"), tokens()
    with pytest.raises(autoshard.AutoshardError, match="matches no parameter"):
        autoshard.plan(model, (x,), mesh, profile=SHARDING_PROFILE, pins={"nope.*": "RR"})
    with pytest.raises(autoshard.AutoshardError, match="pin 'layers.0.att' matches no parameter"):
        autoshard.plan(model, (x,), mesh, profile=SHARDING_PROFILE, pins={"layers.0.att": "RR"})
    with pytest.raises(autoshard.AutoshardError, match="has 1 placements, the mesh has 2"):
        autoshard.plan(model, (x,), mesh, profile=SHARDING_PROFILE, pins={"embed": "R"})
    with pytest.raises(autoshard.AutoshardError, match="expected 1 specs"):
        autoshard.plan(model, (x,), mesh, profile=SHARDING_PROFILE, input_specs=["S(0)R", "RR"])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("shape, names", MESHES)
def test_hugging_face_models_plan(world, arch, shape, names):
    """Real code nobody here wrote, built from config classes with no download."""
    world(int(torch.tensor(shape).prod()))
    model = _hf_model(arch, dropout=0.1)  # train mode: dropout ops planned too
    mesh = autoshard.fake_mesh(shape, names)
    x = tokens()
    plan = autoshard.plan(model, (x,), mesh, profile="h100-sxm")
    assert set(plan.params) >= {f for f, _ in model.named_parameters()}
    assert all(len(p.placements) == len(shape) for p in plan.params.values())
    assert plan.summary["step_us"] > 0 and plan.summary.overlap["additive_status"] == "optimal"
    if len(shape) < 3:  # determinism (the 3-D plans take longest; one check is enough)
        again = autoshard.plan(model, (x,), mesh, profile="h100-sxm")
        assert again.params == plan.params and again.nodes == plan.nodes


@pytest.mark.parametrize("how", ["init_fn", "full_state_dict"])
def test_meta_device_model_is_sharded_at_load(world, how):
    """A meta-device model gets only its shards allocated (to_empty), then initialized in
    place or loaded from a full state dict; the latter computes the original model's loss."""
    world(4)
    shape, names = (2, 2), ("dp", "tp")
    real, x = tiny("llama"), tokens()
    plan = autoshard.plan(real, (x,), autoshard.fake_mesh(shape, names), profile=SHARDING_PROFILE,
                          loss_fn=lm_loss, memory_budget=None)
    with torch.device("meta"):
        meta = tiny("llama")
    with LocalTensorMode(4):
        mesh = local_mesh(shape, names)
        if how == "init_fn":
            model = autoshard.parallelize(meta, plan, mesh, init_fn=lambda m: m.init_weights())
            loss = full(lm_loss(model(x)))
            assert torch.isfinite(loss) and loss > 0
            assert all(not p.is_meta for p in model.parameters())
            torch.testing.assert_close(full(model.rope_cos), real.rope_cos)
        else:
            with pytest.raises(autoshard.PlanError, match="non-persistent"):
                autoshard.parallelize(copy.deepcopy(meta), plan, mesh, full_state_dict=real.state_dict())
            model = autoshard.parallelize(meta, plan, mesh, init_fn=lambda m: m.init_weights(),
                                          full_state_dict=real.state_dict())
            torch.testing.assert_close(full(lm_loss(model(x))), lm_loss(real(x)), rtol=1e-5, atol=1e-6)
        sharded = [p for p in model.parameters() if any(pl.is_shard() for pl in p.placements)]
        assert sharded, "the plan under test shards nothing"


def _hf_model(arch, dropout=0.0, attention=None):
    """A small Hugging Face model built from its config class, with its default attention
    (``sdpa``: the fused kernel) unless ``attention`` names another (``"eager"``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                 max_position_embeddings=64)
    if arch == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=176, num_key_value_heads=2, **small)
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
                                      attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout)
    elif arch == "bert":  # encoder-only, learned positions, token types made inside forward
        cfg = transformers.BertConfig(intermediate_size=128, hidden_dropout_prob=dropout,
                                      attention_probs_dropout_prob=dropout, **small)
    elif arch == "vit":  # vision: a strided convolution makes the patches
        del small["vocab_size"], small["max_position_embeddings"]
        cfg = transformers.ViTConfig(intermediate_size=128, image_size=16, patch_size=4, num_labels=10,
                                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **small)
    elif arch == "qwen2":  # biased q/k/v projections, grouped-query attention
        cfg = transformers.Qwen2Config(intermediate_size=176, num_key_value_heads=2, **small)
    elif arch == "mistral":  # grouped-query attention, a sliding window wider than the sequence
        cfg = transformers.MistralConfig(intermediate_size=176, num_key_value_heads=2, sliding_window=128, **small)
    elif arch == "gpt_neox":  # fused qkv projection, partial rotary, parallel residual
        cfg = transformers.GPTNeoXConfig(intermediate_size=176, hidden_dropout=dropout, attention_dropout=dropout,
                                         **small)
    elif arch == "llama4":  # complex rotary (torch.polar: no DTensor rule of its own), MoE layers
        cfg = transformers.Llama4TextConfig(intermediate_size=176, intermediate_size_mlp=176, num_local_experts=2,
                                            head_dim=16, num_key_value_heads=2, **small)
    else:
        raise ValueError(arch)
    if attention is not None:
        cfg._attn_implementation = attention
    if arch == "vit":
        return transformers.ViTForImageClassification(cfg)
    if arch == "bert":
        return transformers.BertForMaskedLM(cfg)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def hf_loss(out):
    return out["logits"].float().pow(2).mean()


def plan_hf(arch):
    """(a small Hugging Face model, its input, the loss, the solve's own plan on a fake (2, 2)
    mesh: a hand-written DDP plan, predicted faster, would shard no parameter). Where the free
    optimum itself replicates every parameter (ViT under this profile), the plan is made under
    a budget of 70% of that plan's peak, so that the plan under test shards."""
    model, x = _hf_model(arch), _hf_input(arch)
    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    plan = autoshard.plan(model, (x,), mesh, profile=SHARDING_PROFILE, loss_fn=hf_loss, memory_budget=None,
                          seed_baselines=False)
    if not any("S(" in str(plan.param_spec(f)) for f in plan.params):
        plan = autoshard.plan(model, (x,), mesh, profile=SHARDING_PROFILE, loss_fn=hf_loss, seed_baselines=False,
                              memory_budget=int(0.7 * plan.summary["peak_mem_bytes"]))
    return model, x, hf_loss, plan


def _hf_input(arch):
    if arch == "vit":
        return torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return tokens()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "vit", "qwen2", "mistral", "gpt_neox", "llama4"])
def test_hugging_face_models_run_as_planned(world, arch):
    """Real models nobody here wrote: rotary tables, positions and masks built inside forward,
    a ModelOutput, (GPT-2) an LM head tied to the embedding, (BERT) an encoder-only stack,
    (ViT) a patch convolution, (Qwen2) biased projections, (GPT-NeoX) a fused qkv and partial
    rotary, (Llama 4) a complex rotary table made by an op DTensor has no rule for: parallelize +
    loss.backward() give the single-device loss and gradients, and three AdamW steps the
    single-device parameters, with the default bucketing and overlap passes on the lowered
    programs."""
    world(4)
    model, x, loss_fn, plan = plan_hf(arch)
    assert any("S(" in str(plan.param_spec(f)) for f in plan.params), "the plan under test shards nothing"
    fallback = plan.summary.get("fallback_ops") or {}
    assert not any("attention" in op for op in fallback), fallback
    if arch == "llama4":  # its complex rotary table (polar) is planned elementwise
        assert not fallback, fallback
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), (x,), loss_fn)
    ref = copy.deepcopy(model)
    ref_losses, _ = reference_adamw(ref, (x,), loss_fn)
    with LocalTensorMode(4) as mode:
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, local_mesh((2, 2), ("dp", "tp")))
        lift_replicated_locals(sharded, mode)
        out = sharded(x)
        from transformers.utils import ModelOutput

        assert isinstance(out, ModelOutput)
        loss = loss_fn(out)
        loss.backward()
        torch.testing.assert_close(full(loss), ref_loss, rtol=1e-5, atol=1e-6)
        for fqn, p in sharded.named_parameters():
            torch.testing.assert_close(full(p.grad), ref_grads[fqn], rtol=1e-4, atol=1e-5, msg=fqn)
        if arch == "gpt2":
            assert sharded.lm_head.weight is sharded.transformer.wte.weight
        program = next(iter(sharded.forward.programs.values()))
        for part in (program.forward_program(0), program.backward_program(0)):
            ops = {str(n.target) for n in part.gm.graph.nodes}
            assert any("_scaled_dot_product_flash_attention_for_cpu" in op for op in ops), "no fused kernel runs"
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        for step in range(3):
            if step:
                opt.zero_grad()
                loss = loss_fn(sharded(x))
                loss.backward()
            assert full(loss).item() == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-5)
            opt.step()
        # Adam moves every element by about lr whatever its gradient's size, so float32 rounding
        # in a gradient near zero shows in its parameter: a few elements move up to 5% of lr over
        # three steps (HF GPT-2 with the fused kernel: 22 of 16,384 elements of its embedding
        # beyond 5e-5, the worst 3.3e-4), where a wrong gradient skews most elements by up to 3e-2.
        ref_params = dict(ref.named_parameters())
        for fqn, p in sharded.named_parameters():
            err = (full(p.detach()) - ref_params[fqn].detach()).abs()
            assert err.max().item() <= 1e-3, f"{fqn}: max |sharded - single| = {err.max():.3g} after 3 AdamW steps"
            assert (err > 2e-4).float().mean().item() <= 0.01, f"{fqn}: {(err > 2e-4).sum()} elements moved > 2e-4"


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_hugging_face_keyword_inputs_and_the_models_own_loss(world, arch):
    """``model(input_ids, attention_mask=..., labels=...)`` with the loss computed by the model:
    keyword tensors are planned inputs (named in the plan), the loss is the model's output, and
    loss and gradients equal single-device ones, with the loss outside or lowered with the model."""
    world(4)
    model, x = _hf_model(arch), tokens()
    mask = torch.ones_like(x)
    mask[:, -3:] = 0  # padding: the mask changes the result
    labels = torch.randint(0, 256, x.shape, generator=torch.Generator().manual_seed(2))
    kw = {"attention_mask": mask, "labels": labels}

    def loss_fn(out):
        return out["loss"]

    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), profile=SHARDING_PROFILE,
                          loss_fn=loss_fn, memory_budget=None, example_kwargs=kw)
    assert plan.input_names == ["input0", "attention_mask", "labels"]
    assert autoshard.Plan.from_json(plan.to_json()).keyword_inputs == ["attention_mask", "labels"]
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(x, **kw))
    ref_loss.backward()
    with LocalTensorMode(4):
        mesh = local_mesh((2, 2), ("dp", "tp"))
        for compute_loss in (False, True):
            sharded = autoshard.parallelize(copy.deepcopy(model), plan, mesh, loss_fn=loss_fn,
                                            compute_loss=compute_loss)
            out = sharded(x, **kw)
            loss = out if compute_loss else loss_fn(out)
            loss.backward()
            torch.testing.assert_close(full(loss), ref_loss.detach(), rtol=1e-5, atol=1e-6)
            for (fqn, p), (_, q) in zip(sharded.named_parameters(), ref.named_parameters()):
                torch.testing.assert_close(full(p.grad), q.grad, rtol=1e-4, atol=1e-5, msg=fqn)
        with pytest.raises(autoshard.PlanError, match=r"keyword inputs \['attention_mask'\], the plan was made for "
                                                      r"\['attention_mask', 'labels'\]"):
            sharded(x, attention_mask=mask)


def _replicas_agree(t) -> bool:
    """Whether every rank that holds the same shard of DTensor ``t`` holds the same values."""
    mesh, parts = t.device_mesh, t._local_tensor._local_tensors
    shard_axes = [a for a, p in enumerate(t.placements) if p.is_shard()]
    groups: dict = {}
    for rank, local in parts.items():
        coord = tuple(int(c) for c in (mesh.mesh == rank).nonzero()[0])
        groups.setdefault(tuple(coord[a] for a in shard_axes), []).append(local)
    return all(torch.equal(g[0], other) for g in groups.values() for other in g[1:])


def test_dropout_masks_agree_wherever_the_plan_replicates(world):
    """GPT-2 in train mode (dropout 0.1) on (2, 2): a random op draws the same values on every rank
    that holds the same shard (under LocalTensorMode all ranks share one generator, so without
    the keyed draws replicas would differ), a new mask every step, and training stays finite."""
    world(4)
    model, x = _hf_model("gpt2", dropout=0.1), tokens()
    model.train()

    def loss_fn(out):
        return out["logits"].float().pow(2).mean()

    # A fast device: the tiny model is data-parallel on dp and replicated on tp.
    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), profile="h100-sxm",
                          loss_fn=loss_fn, memory_budget=None, input_specs=["S(0)R"])
    with LocalTensorMode(4):
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, local_mesh((2, 2), ("dp", "tp")))
        program = None
        losses = []
        for _ in range(2):
            out = sharded(x)
            assert not all(p.is_shard() for p in out["logits"].placements), "no replicas to compare"
            assert _replicas_agree(out["logits"]), out["logits"].placements
            loss = loss_fn(out)
            loss.backward()
            losses.append(full(loss).item())
            for fqn, p in sharded.named_parameters():
                assert _replicas_agree(p.grad), fqn
            program = next(iter(sharded.forward.programs.values()))
        keyed = [n for n in program.forward_program(0).gm.graph.nodes if "random_fill" in str(n.target)]
        assert len(keyed) == 7  # every dropout of the model
    model.eval()
    eval_loss = loss_fn(model(x)).item()
    assert losses[0] != losses[1] and eval_loss not in losses and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_encoder_decoders_write_their_decoder_input_through_views(world, arch):
    """Hugging Face's encoder-decoders make the decoder's input from the labels by writes through
    views (``shifted[:, 1:] = labels[:, :-1]``, ``shifted[:, 0] = start``), unread in the traced
    graph: planned as they are, the writes landed in moved copies and every gradient was wrong.
    Made functional at trace time (:mod:`autoshard.graph.viewwrites`), the plan gives the
    single-device loss and gradients, and no op of the model falls back to replicated."""
    transformers = pytest.importorskip("transformers")
    world(4)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if arch == "bart":
        model = transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))
    else:
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0))
    x = torch.randint(3, 256, (8, 16), generator=g)
    kw = {"labels": torch.randint(3, 256, (8, 12), generator=g)}

    def loss_fn(out):
        return out["loss"]

    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), profile=SHARDING_PROFILE,
                          loss_fn=loss_fn, memory_budget=None, example_kwargs=kw, seed_baselines=False)
    assert not plan.summary["fallback_ops"], plan.summary["fallback_ops"]
    assert any(e["op"] == "aten.slice_scatter.default" for e in plan.nodes.values())
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(x, **kw))
    ref_loss.backward()
    with LocalTensorMode(4):
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, local_mesh((2, 2), ("dp", "tp")), loss_fn=loss_fn)
        loss = loss_fn(sharded(x, **kw))
        loss.backward()
        torch.testing.assert_close(full(loss), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for (fqn, p), (_, q) in zip(sharded.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(full(p.grad), q.grad, rtol=1e-4, atol=1e-5, msg=fqn)


def test_outputs_the_loss_does_not_read_are_returned(world):
    """CLIP returns ``logits_per_image`` (a transpose the contrastive loss does not read) beside its
    own loss: the trace keeps that output although nothing in the step reads it (dropping it made
    the lowered forward fail on a node no longer in the graph), and the sharded model returns it
    with the single-device value, loss and gradients."""
    transformers = pytest.importorskip("transformers")
    world(4)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4)))
    x = torch.randint(0, 256, (8, 16), generator=g)
    kw = {"pixel_values": torch.randn(8, 3, 16, 16, generator=g), "return_loss": True}

    def loss_fn(out):
        return out["loss"]

    plan = autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), profile=SHARDING_PROFILE,
                          loss_fn=loss_fn, memory_budget=None, example_kwargs=kw, seed_baselines=False)
    ref = copy.deepcopy(model)
    want = ref(x, **kw)
    want["loss"].backward()
    with LocalTensorMode(4):
        sharded = autoshard.parallelize(copy.deepcopy(model), plan, local_mesh((2, 2), ("dp", "tp")), loss_fn=loss_fn)
        out = sharded(x, **kw)
        out["loss"].backward()
        torch.testing.assert_close(full(out["loss"]), want["loss"].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(full(out["logits_per_image"]), want["logits_per_image"].detach(),
                                   rtol=1e-5, atol=1e-5)
        for (fqn, p), (_, q) in zip(sharded.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(full(p.grad), q.grad, rtol=1e-4, atol=1e-5, msg=fqn)
