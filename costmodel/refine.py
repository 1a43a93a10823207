"""Closed-loop calibration: collective fits corrected by what collectives take inside real steps.

Microbenchmarks time each collective alone, on an idle machine. Inside a training step the
same message contends with compute, other collectives and the host (``autoshard measure``
times every functional collective of the running programs). For every (kind, group) seen in
a step, with in-step samples ``(bytes_i, us_i)`` and the profile's current prediction
``p(bytes)``:

    r = median_i  us_i / p(bytes_i)

(pooled per kind, group size and link class: the resolution at which the profile predicts)
and the fit becomes ``r`` times the current one (alpha, beta and the monotone knots scale
together, so the curve keeps the shape the microbenchmarks measured over every size; a step
measures only the few sizes the plan uses, too few to fit a curve). Where the profile had no
fit for that group, the fit starts from the predictor it used (a rescaled fit of another
group size, or the link's alpha-beta line). Applied again to a refined profile, ``r`` is
measured against the refined prediction: repeated refinement converges instead of compounding.

The in-step samples are kept apart from the microbenchmark ones (``Profile.step_samples``),
and each refinement records its provenance and factors (``Profile.refinements``).
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import replace

from costmodel.errors import CostModelError
from costmodel.fit import CollectiveFit
from costmodel.profile import Profile


def refine(profile: Profile, samples, provenance: dict | None = None) -> tuple[Profile, list[dict]]:
    """``profile`` with its fits scaled to the in-step ``samples`` (``(kind, group, group_size,
    intra_node, bytes, us)`` each; ``group`` names the mesh axes joined by ``+``). Returns the
    refined profile and one row per refitted (kind, group size, link class): ``kind``,
    ``groups``, ``group_size``, ``intra_node``, ``samples``, ``factor``.

    Samples are pooled per (kind, group size, link class), the resolution at which the profile
    predicts (:meth:`Profile.collective_predictor`), and every fit at that key scales by the
    same factor, so the prediction the planner reads is the one corrected."""
    by_key: dict[tuple, list[tuple]] = {}
    for s in samples:
        kind, group, n, intra, nbytes, us = s
        if not (nbytes > 0 and us > 0):
            raise CostModelError(f"refine: in-step sample {tuple(s)} needs bytes > 0 and us > 0")
        by_key.setdefault((str(kind), int(n), bool(intra)), []).append((str(group), float(nbytes), float(us)))
    if not by_key:
        raise CostModelError("refine: no in-step collective samples (did the plan run any collective?)")
    fits = list(profile.collectives)
    rows = []
    for (kind, n, intra), pts in sorted(by_key.items()):
        if n <= 1:
            continue
        predict = profile.collective_predictor(kind, n, intra)
        ratios = [us / predict(b) for _, b, us in pts if predict(b) > 0]
        if not ratios:
            continue
        r = statistics.median(ratios)
        at_key = [i for i, f in enumerate(fits) if (f.kind, f.group_size, f.intra_node) == (kind, n, intra)]
        for i in at_key:
            f = fits[i]
            fits[i] = replace(f, alpha_us=f.alpha_us * r, beta_us_per_byte=f.beta_us_per_byte * r,
                              knots_us=[t * r for t in f.knots_us])
        groups = sorted({g for g, _, _ in pts})
        if not at_key:
            alpha, per_byte = profile.fallback_line(kind, n, intra)
            fits.append(CollectiveFit(kind, groups[0], n, intra, alpha * r, per_byte * r))
        rows.append({"kind": kind, "groups": groups, "group_size": n, "intra_node": intra, "samples": len(pts),
                     "factor": round(r, 4)})
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              **(provenance or {}), "fits": rows}
    refined = replace(profile, collectives=tuple(sorted(fits, key=lambda f: (f.kind, f.group))),
                      step_samples=tuple(profile.step_samples) + tuple(tuple(s) for s in samples),
                      refinements=tuple(profile.refinements) + (record,))
    return refined, rows
