import argparse
import json
import re

import pytest

import autoshard
from autoshard.cli import main, microbatch_count, parse_bytes


def test_demo_writes_a_plan(world, tmp_path, capsys):
    world(64)
    out = tmp_path / "plan.json"
    rc = main(["demo", "--model", "gpt", "--layers", "1", "--dim", "64", "--heads", "4", "--vocab", "128",
               "--batch", "8", "--seq", "16", "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "on mesh {'dp': 8, 'tp': 8}" in text and "predicted step" in text
    assert json.loads(out.read_text())["mesh"]["shape"] == [8, 8]
    assert main(["show", str(out)]) == 0
    assert "embed.weight" in capsys.readouterr().out


def test_bad_input_exit_code_2(capsys, tmp_path):
    assert main(["demo", "--mesh", "dp=x"]) == 2
    assert "expected 'name=size,...'" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["show", str(bad)]) == 2
    assert "plan version: expected 1, found None" in capsys.readouterr().err


def test_parse_bytes():
    assert parse_bytes("70GiB") == 70 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    with pytest.raises(Exception, match="expected a number"):
        parse_bytes("lots")


def test_explain_and_diff(world, tmp_path, capsys):
    world(64)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    small = ["--model", "gpt", "--layers", "1", "--dim", "64", "--heads", "4", "--vocab", "128", "--batch", "8",
             "--seq", "16"]
    assert main(["demo", *small, "-o", str(a)]) == 0
    assert main(["demo", *small, "--mesh", "dp=8,tp=8", "--profile", "cpu-gloo", "-o", str(b)]) == 0
    capsys.readouterr()
    assert main(["explain", str(a)]) == 0
    out = capsys.readouterr().out
    assert "[layers.0]" in out and "layers.0.attn.wq.weight" in out and "per device" in out
    assert main(["diff", str(a), str(a)]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["diff", str(a), str(b)]) == 0
    assert "profile: h100-sxm@bfloat16 -> cpu-gloo" in capsys.readouterr().out


def test_demo_pins_and_compare(world, capsys):
    world(4)
    small = ["demo", "--mesh", "dp=2,tp=2", "--model", "gpt", "--layers", "1", "--dim", "64", "--heads", "4",
             "--vocab", "128", "--batch", "8", "--seq", "16"]
    assert main(small + ["--pin", "head.weight=RS(0)", "--compare"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s*head\.weight\s+dp=R tp=S\(0\)", out, flags=re.M), out
    for name in ("autoshard", "ddp", "fsdp", "tp", "fsdp_tp"):
        assert f"\n{name} " in out
    # The "autoshard" row is the pinned plan printed above (it used to be an unpinned re-solve).
    assert main(small + ["--pin", "*=S(0)S(0)", "--compare"]) == 0
    out = capsys.readouterr().out
    planned = float(re.search(r"predicted step: ([\d.]+) ms", out).group(1))
    row = float(re.search(r"^autoshard\s+([\d.]+)", out, flags=re.M).group(1))
    assert row == pytest.approx(planned, abs=0.01), out
    assert main(small) == 0  # unpinned: cheaper, so an unpinned "autoshard" row would differ
    free = float(re.search(r"predicted step: ([\d.]+) ms", capsys.readouterr().out).group(1))
    assert free < planned - 0.01
    assert main(small + ["--pin", "head.weight"]) == 2
    assert "expected FQN=SPEC" in capsys.readouterr().err
    assert main(small + ["--pin", "nothing.here=RR"]) == 2
    assert "matches no parameter" in capsys.readouterr().err


def test_plan_then_lower_a_factory_model(world, tmp_path, monkeypatch, capsys):
    """`autoshard plan MODULE:FACTORY` then `autoshard lower MODULE:FACTORY --plan`: one rank's
    programs on a fake process group, each collective with its group, bytes and overlap window,
    and the programs' code written out."""
    world(4)
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "from autoshard.models import llama\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return llama('tiny', n_layers=1, max_seq_len=16), torch.randint(0, 256, (8, 16))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from helpers import SHARDING_PROFILE

    SHARDING_PROFILE.save(tmp_path / "slow.json")  # slow compute: the plan shards, so collectives run
    plan = tmp_path / "plan.json"
    assert main(["plan", "mymodels:make", "--mesh", "dp=4", "--profile", str(tmp_path / "slow.json"),
                 "-o", str(plan)]) == 0
    # The predicted step prices the executor's buckets (parallelize's 25 MiB), or none with 0.
    unbucketed = tmp_path / "plan0.json"
    assert main(["plan", "mymodels:make", "--mesh", "dp=4", "--profile", str(tmp_path / "slow.json"),
                 "--bucket-mb", "0", "-o", str(unbucketed)]) == 0
    with_buckets, without = (json.loads(f.read_text())["summary"] for f in (plan, unbucketed))
    assert with_buckets["simulated"]["bucket_mb"] == 25.0 and "bucket_mb" not in without["simulated"]
    # A bucket is one collective's latency for several (its step may still end later: it waits
    # for its last member).
    assert with_buckets["simulated"]["bucket_saved_us"] > 0
    assert with_buckets["simulated"]["comm_us"] < without["simulated"]["comm_us"]
    capsys.readouterr()
    out = tmp_path / "programs"
    assert main(["lower", "mymodels:make", "--plan", str(plan), "--rank", "3", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"backward \(rank 3\): \d+ nodes, [1-9]\d* collectives", text), text
    assert re.search(r"(all_reduce|reduce_scatter)\s+group \[0, 1, 2, 3\]\s+[\d.]+ MiB, waited \d+ nodes later",
                     text), text
    code = (out / "backward.rank3.py").read_text()
    assert re.search(r"_c10d_functional\.(all_reduce|reduce_scatter)", code) and "wait_tensor" in code
    assert main(["lower", "mymodels:make", "--plan", str(plan), "--rank", "4"]) == 2
    assert "expected 0 <= rank < 4" in capsys.readouterr().err


def test_version_and_a_factory_in_the_current_folder(tmp_path, monkeypatch, capsys):
    """`autoshard --version`; `autoshard plan mymodels:make` finds mymodels.py in the current
    folder, as `python -m` does (the console script's sys.path does not hold it)."""
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and re.match(r"autoshard \d+\.\d+", capsys.readouterr().out)
    (tmp_path / "cwdmodels.py").write_text("def make():\n    raise RuntimeError('found me')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    with pytest.raises(RuntimeError, match="found me"):
        main(["plan", "cwdmodels:make", "--mesh", "dp=2"])


def test_a_bug_is_a_traceback_and_bad_input_is_exit_2(world, tmp_path, monkeypatch, capsys):
    """A bare ValueError from inside the tool is a bug: it propagates (Python prints the
    traceback, exit 1) instead of being reported as bad input. User errors of every package
    (autoshard's, the cost model's spec and profile errors) are one line and exit 2."""
    (tmp_path / "bugmodels.py").write_text("def make():\n    raise ValueError('an internal bug')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="an internal bug"):
        main(["plan", "bugmodels:make", "--mesh", "dp=2"])
    (tmp_path / "bad.json").write_text('{"version": 999}')
    world(2)
    bad = str(tmp_path / "bad.json")
    assert main(["demo", "--mesh", "dp=2", "--model", "gpt", "--layers", "1", "--profile", bad]) == 2
    assert "profile version" in capsys.readouterr().err
    assert main(["plan", "bugmodels:nothere", "--mesh", "dp=2"]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    assert main(["demo", "--mesh", "dp=2", "--model", "gpt", "--layers", "1", "--dim", "64", "--heads", "3"]) == 2
    assert "must be divisible by n_heads" in capsys.readouterr().err
    assert main(["demo", "--mesh", "dp=2", "--dim", "64"]) == 2
    assert "--dim size the small GPT: expected --model gpt with them, found --model llama-8b" in capsys.readouterr().err
    assert not issubclass(autoshard.AutoshardError, ValueError)


def test_ranks_chooses_the_mesh(world, tmp_path, monkeypatch, capsys):
    world(4)
    small = ["--model", "gpt", "--layers", "1", "--dim", "64", "--heads", "4", "--vocab", "128", "--batch", "8",
             "--seq", "16", "--time-limit", "10"]
    assert main(["demo", *small, "--ranks", "4", "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"mesh search: 2 shapes", out), out  # (4,) and (2, 2)
    assert re.search(r"^\s+2x2\s+(chosen|planned|pruned)", out, flags=re.M), out
    assert main(["explain", str(tmp_path / "p.json")]) == 0 and "mesh search" in capsys.readouterr().out
    assert main(["demo", *small, "--ranks", "4", "--mesh-margin", "-1"]) == 0  # every shape bounded
    assert re.search(r"mesh search: 2 shapes", capsys.readouterr().out)
    (tmp_path / "m.py").write_text("import torch\nfrom autoshard.models import MLP\n"
                                   "def make():\n    return MLP(8, 16), (torch.randn(8, 8),)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "m:make"]) == 2
    assert "expected --mesh name=size,... (e.g. dp=8,tp=8) or --ranks N" in capsys.readouterr().err


def test_allow_pipeline_keeps_the_faster_and_says_so(world, tmp_path, capsys):
    """--allow-pipeline AXIS: the plan with and without stages, the faster written (here the
    model is too small for a bubble to pay); both steps printed. With --pipeline too: refused."""
    world(64)
    out = tmp_path / "p.json"
    args = ["demo", "--model", "gpt", "--layers", "4", "--dim", "64", "--heads", "4", "--vocab", "128", "--batch", "64",
            "--seq", "16", "--mesh", "pp=4,dp=4,tp=4", "--microbatches", "16", "--time-limit", "20"]
    assert main(args + ["--allow-pipeline", "pp", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    line = next(s for s in text.splitlines() if "pipelining over 'pp' allowed" in s)
    assert "without " in line and "pipelined " in line and "kept the plan" in line
    kind = json.loads(out.read_text()).get("kind", "plan")
    assert ("kept the plan pipelined" in line) == (kind == "pipeline")
    assert main(args + ["--allow-pipeline", "pp", "--pipeline", "pp"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_demo_pipelined_writes_a_pipeline_plan(world, tmp_path, capsys):
    """--pipeline AXIS: the stages planned on the other axes; the file is a pipelined plan that
    `show` prints stage by stage. --microbatches takes a count or 'auto' (the default), nothing else."""
    world(64)
    out = tmp_path / "pp.json"
    rc = main(["demo", "--model", "gpt", "--layers", "4", "--dim", "64", "--heads", "4", "--vocab", "128",
               "--batch", "64", "--seq", "16", "--mesh", "pp=4,dp=4,tp=4", "--pipeline", "pp", "--microbatches", "16",
               "--time-limit", "20", "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "pipeline over 'pp' (4 ranks, 4 stages), 1f1b, 16 microbatches" in text
    assert json.loads(out.read_text())["kind"] == "pipeline"
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "pipeline over 'pp'" in shown and "stage 0 (first" in shown and "on mesh {'dp': 4, 'tp': 4}" in shown
    assert main(["explain", str(out)]) == 0
    explained = capsys.readouterr().out
    assert "pipeline over 'pp'" in explained and "stage 0 (first, layers 0-0" in explained
    assert explained.count("parameters: ") == len({p["plan"] for p in json.loads(out.read_text())["stages"]})
    # diff: of a file with itself, with another schedule and a stage's placement moved, with a plan
    # that is not pipelined
    assert main(["diff", str(out), str(out)]) == 0
    assert capsys.readouterr().out.strip() == "plans are identical in placements and predicted costs"
    data = json.loads(out.read_text())
    data["microbatches"], data["step_us"] = 32, data["step_us"] * 2
    stage = data["stages"][-1]
    last = data["plans"][stage["plan"]]
    fqn = next(f for f in last["params"] if f.startswith("layers.") and f.endswith("weight"))
    place = last["params"][fqn]["placements"]
    last["params"][fqn]["placements"] = {a: "S(0)" if v == "R" else "R" for a, v in place.items()}
    shift = stage["layers"][0] - stage["planned_layers"][0]  # diff names the stage's own layers
    fqn = re.sub(r"^layers\.(\d+)", lambda m: f"layers.{int(m.group(1)) + shift}", fqn)
    other = tmp_path / "pp2.json"
    other.write_text(json.dumps(data))
    assert main(["diff", str(out), str(other)]) == 0
    changed = capsys.readouterr().out
    assert "microbatches: 16 -> 32" in changed and "(+100.0%)" in changed
    assert f"stage 3 (last, layers 3-3 -> 3-3):\n  ~ {fqn}:" in changed and "stage 0 (" not in changed
    flat = tmp_path / "flat.json"
    assert main(["demo", "--model", "gpt", "--layers", "4", "--dim", "64", "--heads", "4", "--vocab", "128",
                 "--batch", "64", "--seq", "16", "--mesh", "dp=16,tp=4", "--time-limit", "20", "-o", str(flat)]) == 0
    capsys.readouterr()
    assert main(["diff", str(flat), str(out)]) == 0
    assert capsys.readouterr().out.startswith("kind: plan -> pipelined plan")
    assert main(["demo", "--model", "gpt", "--layers", "4", "--mesh", "pp=4,dp=4,tp=4", "--pipeline", "pp",
                 "--compare"]) == 2
    assert microbatch_count("auto") == "auto" and microbatch_count("8") == 8
    for bad in ("0", "-2", "many"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected a count >= 1 or 'auto', found '{bad}'"):
            microbatch_count(bad)
