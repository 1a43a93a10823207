"""Same inputs, same plan: a plan made twice, in two processes, is the same plan apart from its
timings (issue "reproducible solves")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.planfile import without_timings

ROOT = Path(__file__).resolve().parents[1]
FACTORY = """import torch
from autoshard.models import llama
def make():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = llama("tiny", n_layers=4, dim=512, n_heads=8, n_kv_heads=4, ffn_dim=1376, vocab_size=8192,
                      max_seq_len=1024)
    return model, torch.empty(64, 1024, dtype=torch.long, device="meta")
"""


def test_a_plan_made_twice_in_two_processes_is_the_same(tmp_path):
    """A small LLaMA on a fake (8, 8) mesh under a budget that binds (no plan fits without
    recomputation: the exact search with memory rows runs, in child processes, and the
    overlap objective's rounds follow), planned by the CLI in two fresh processes with different
    hash seeds: the plan files are equal but for their timings."""
    pytest.importorskip("pytoulbar2")
    (tmp_path / "repmodels.py").write_text(FACTORY)
    plans = []
    for seed in ("1", "2"):
        out = tmp_path / f"plan{seed}.json"
        env = dict(os.environ, PYTHONHASHSEED=seed,
                   PYTHONPATH=os.pathsep.join(p for p in (str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH")) if p))
        run = subprocess.run([sys.executable, "-m", "autoshard", "plan", "repmodels:make", "--mesh", "dp=8,tp=8",
                              "--profile", "h100-sxm", "--compute-dtype", "bfloat16", "--memory-budget", "200MiB",
                              "-o", str(out)], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "exact (toulbar2" in run.stderr, run.stderr[-3000:]  # the searches the wall clock once steered
        plans.append(json.loads(out.read_text()))
    first, second = (without_timings(p) for p in plans)
    assert first == second

