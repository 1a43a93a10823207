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

Compute is refined the same way (:func:`refine_compute`): a step's compute as measured (the
rank's time not spent issuing or waiting for collectives) over the compute the profile
predicts for the programs that ran gives one factor ``c``, and every compute time the profile
predicts becomes ``c`` times what it was (the roofline's throughputs divided by ``c``, its
launch floor multiplied): a matmul rate timed alone says nothing of the elementwise ops, the
dispatch and the cache misses of a whole step.
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


def refine_compute(profile: Profile, predicted_us: float, measured_us: float) -> tuple[Profile, float]:
    """``profile`` with every compute time it predicts scaled by ``c = measured_us /
    predicted_us`` (module doc): the compute efficiency divided by ``c`` (the peak raised where
    that would pass 1), the memory bandwidth divided by ``c``, the launch floor and the host's
    issue time multiplied by it. Returns the refined profile and ``c`` (the caller records it: :func:`refine`'s
    provenance)."""
    if not (predicted_us > 0 and measured_us > 0):
        raise CostModelError(f"refine_compute: needs predicted and measured compute > 0, found "
                             f"{predicted_us} and {measured_us}")
    c = measured_us / predicted_us
    efficiency, peak, by_dtype = profile.compute_efficiency / c, profile.peak_tflops, dict(profile.dtype_tflops)
    if efficiency > 1.0:  # faster than the peak allows: the peak was low, not the efficiency
        by_dtype = {d: r * efficiency for d, r in by_dtype.items()}
        peak, efficiency = peak * efficiency, 1.0
    return replace(profile, compute_efficiency=efficiency, peak_tflops=peak, dtype_tflops=by_dtype,
                   mem_bandwidth_gbps=profile.mem_bandwidth_gbps / c, kernel_launch_us=profile.kernel_launch_us * c,
                   host_op_us=profile.host_op_us * c,
                   host_view_us=None if profile.host_view_us is None else profile.host_view_us * c), c
