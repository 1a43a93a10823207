"""Fuzzed inputs: the file loaders (plan, profile, IOPDDL problem) under hypothesis, the
service's API under schemathesis. Malformed, truncated, mistyped or huge input must end
in the package's own clear error (``AutoshardError``, ``CostModelError``,
``ProblemError``) or a 4xx JSON error: never another exception, never a 5xx, never a hang.

Example counts are bounded (``FUZZ_EXAMPLES``, default 150 per loader property) so the
suite stays quick; raise it to fuzz longer.
"""

import copy
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoshard
from autoshard.errors import AutoshardError
from autoshard.planfile import Plan
from costmodel import Profile, load_profile
from costmodel.errors import CostModelError
from solver import evaluate, iopddl
from solver.problem import ProblemError

DATA = Path(__file__).parent / "data"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))

PROBLEM = json.loads((DATA / "iopddl_example.json").read_text())
PROFILE = load_profile("cpu-gloo").to_json()  # calibrated: fits, samples and a mesh to mutate


def _tiny_plan() -> dict:
    from autoshard.models import llama

    with torch.device("meta"):
        model = llama("tiny", n_layers=1, dim=32)
    x = torch.empty(4, 8, dtype=torch.long, device="meta")
    return autoshard.plan(model, (x,), autoshard.fake_mesh((2, 2), ("dp", "tp")), memory_budget=None,
                          time_limit=10).to_json()


# -- strategies ---------------------------------------------------------------
_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-10**30, max_value=10**30),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                  st.sampled_from([10**18, 2**63, -1, 0, 1e308, -1e308]))
json_values = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):  # the first few items stand for the rest
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated(draw, doc):
    """``doc`` with one to three edits: a value replaced by any JSON value, a key or item
    removed, a value wrapped in a list, a key added."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(doc))))
        if not path:
            if draw(st.booleans()):
                return draw(json_values)
            continue
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        edit = draw(st.sampled_from(["replace", "replace", "delete", "wrap", "add"]))
        if edit == "replace":
            parent[path[-1]] = draw(json_values)
        elif edit == "delete":
            del parent[path[-1]]
        elif edit == "wrap":
            parent[path[-1]] = [parent[path[-1]]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=6))] = draw(json_values)
    return doc


@st.composite
def truncated(draw, doc):
    text = json.dumps(doc)
    return text[:draw(st.integers(0, len(text) - 1))]


def _only(errors, fn, *args):
    """``fn(*args)`` either succeeds or raises one of ``errors``; anything else fails the test."""
    try:
        return fn(*args)
    except errors:
        return None


# -- the IOPDDL problem loader --------------------------------------------------
@FUZZ
@given(mutated(PROBLEM))
def test_problem_loader_mutations(doc):
    problem = _only(ProblemError, iopddl.from_dict, doc)
    if problem is not None:  # what loads is usable: any choice can be evaluated
        ev = evaluate(problem, np.zeros(problem.num_nodes, dtype=np.int64))
        assert not np.isnan(ev.cost), doc


# -- the profile loader -----------------------------------------------------------
@FUZZ
@given(mutated(PROFILE))
def test_profile_loader_mutations(doc):
    prof = _only(CostModelError, Profile.from_json, doc)
    if prof is not None:  # what loads is usable: it predicts every collective
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            assert prof.collective_predictor(kind, 4, True)(1e6) >= 0


# -- the plan loader ------------------------------------------------------------------
_PLAN: dict = {}


def _plan_doc() -> dict:
    if not _PLAN:
        _PLAN.update(_tiny_plan())
    return _PLAN


def test_plan_loader_mutations():
    doc = _plan_doc()

    @FUZZ
    @given(mutated(doc))
    def run(mut):
        plan = _only(AutoshardError, Plan.from_json, mut)
        if plan is not None:  # what loads can be shown (`autoshard show`), or says what is wrong
            _only(AutoshardError, plan.describe)

    run()


@pytest.mark.parametrize("kind", ["problem", "profile", "plan"])
def test_truncated_files_are_refused_clearly(kind, tmp_path):
    doc, load, error = {"problem": lambda: (PROBLEM, iopddl.load, ProblemError),
                        "profile": lambda: (PROFILE, load_profile, CostModelError),
                        "plan": lambda: (_plan_doc(), Plan.load, AutoshardError)}[kind]()

    @FUZZ
    @given(truncated(doc))
    def run(text):
        path = tmp_path / f"{kind}.json"
        path.write_text(text)
        with pytest.raises(error):
            load(path)

    run()


# -- the service's API ---------------------------------------------------------------
SEEN: Counter = Counter()


def _api_schema():
    """The service's OpenAPI schema, calls going to an in-process app that queues jobs and
    runs none (``run_jobs=False``): this is about the API, not about solving. (Built at
    import: schemathesis parametrizes from it when pytest collects.)"""
    import tempfile

    import schemathesis

    from autoshard.serve import ServiceConfig, create_app

    db = os.path.join(tempfile.mkdtemp(prefix="autoshard-fuzz-"), "fuzz.sqlite")
    app = create_app(ServiceConfig(db=db, max_queue=10**6), run_jobs=False)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@_api_schema().parametrize()
@settings(max_examples=max(10, EXAMPLES // 5), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_service_api_never_5xx(case):
    """Every operation of the OpenAPI schema, valid and invalid inputs and methods: no 5xx,
    and every 4xx is a JSON ``{"error": message}``."""
    response = case.call()
    SEEN[f"{response.status_code // 100}xx"] += 1
    if sum(SEEN.values()) % 100 == 0:
        print(f"schemathesis: {sum(SEEN.values())} requests so far, {dict(sorted(SEEN.items()))}")
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body.get("error"), str) and body["error"], (case.method, case.path, body)
