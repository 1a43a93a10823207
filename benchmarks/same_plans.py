"""Whether runs from the same inputs made the same plans: plan files compared apart from timings.

    python benchmarks/plan_quality.py --save /tmp/run1   # and /tmp/run2, /tmp/run3
    python benchmarks/same_plans.py /tmp/run1 /tmp/run2 /tmp/run3

Every plan file (``*.json``) of the first folder is compared with the file of the same name in
each other folder, with the wall-clock figures a plan records left out
(:func:`autoshard.planfile.without_timings`). Per file: equal in every run, or the first fields
that differ (a JSON path and the values in the first run and the run that differs) and the
predicted steps of each run. Last line: the plans equal in every run, of all compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoshard.planfile import without_timings  # noqa: E402


def differences(a, b, path: str = "", limit: int = 3) -> list[str]:
    """Up to ``limit`` JSON paths where ``a`` and ``b`` differ, each with both values (shortened)."""
    out: list[str] = []
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: {'missing' if k not in a else 'present'} in the first run, "
                           f"{'missing' if k not in b else 'present'} in this one")
            elif a[k] != b[k]:
                out += differences(a[k], b[k], f"{path}/{k}", limit - len(out))
            if len(out) >= limit:
                break
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                out += differences(x, y, f"{path}[{i}]", limit - len(out))
            if len(out) >= limit:
                break
    elif a != b:
        out.append(f"{path}: {json.dumps(a)[:80]} vs {json.dumps(b)[:80]}")
    return out[:limit]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", help="one folder of plan files per run (the first is the reference)")
    args = ap.parse_args()
    first, others = Path(args.folders[0]), [Path(f) for f in args.folders[1:]]
    files = sorted(first.glob("*.json"))
    if not files or not others:
        sys.exit(f"expected plan files in {first} and at least one more folder to compare, found "
                 f"{len(files)} files and {len(others)} other folders")
    equal = 0
    for f in files:
        ref = json.loads(f.read_text())
        steps = [ref["summary"].get("step_us")]
        found = []
        for folder in others:
            g = folder / f.name
            if not g.exists():
                found.append(f"{folder}: no {f.name}")
                steps.append(None)
                continue
            other = json.loads(g.read_text())
            steps.append(other["summary"].get("step_us"))
            found += [f"{folder}: {d}" for d in differences(without_timings(ref), without_timings(other))]
        shown = ", ".join("-" if s is None else f"{s / 1e3:.1f}" for s in steps)
        if found:
            print(f"{f.name}: DIFFERENT (predicted step ms per run: {shown})")
            for line in found:
                print(f"    {line}")
        else:
            equal += 1
            print(f"{f.name}: equal in {len(args.folders)} runs (predicted step {steps[0] / 1e3:.1f} ms)")
    print(f"plans equal in every run: {equal} of {len(files)}")


if __name__ == "__main__":
    main()
