"""Pipeline timeline (``--trace FILE``): Chrome-trace / Perfetto JSON with one row per stage
and a slice per micro-batch forward (F) and backward (B), a row per stage boundary with a slice
per activation transfer into the stage (T: from the moment the stage before started sending it
to the moment this stage received it), and the measured bubble and overlap.

The bubble of a step is the share of stage-time spent idle between the step's first and
last slice: ``1 - sum over stages of busy time / (S x step span)``, where a stage's busy
time is the union of its slices (backward may overlap forward with the overlap schedule).
The ideal GPipe bubble is ``(S - 1) / (M + S - 1)``. The overlap is the share of transfer
time during which the sending stage computed (another micro-batch's F or B): transfers that
a pipeline hides behind compute. The clocks are each process's wall clock: across machines
they are as close as the machines' clocks are.

>>> round(ideal_bubble(stages=3, microbatches=4), 3)
0.333
>>> bubble({0: [(0.0, 1.0)], 1: [(1.0, 2.0)]})
0.5
>>> overlap([(1.0, 3.0)], [(0.0, 2.0)])
0.5
"""
from __future__ import annotations

import json

__all__ = ["ideal_bubble", "bubble", "overlap", "write_chrome_trace"]

_CATEGORY = {"F": "forward", "B": "backward", "T": "transfer"}


def ideal_bubble(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def bubble(slices: dict[int, list[tuple[float, float]]]) -> float:
    """Idle share of ``len(slices)`` stages over the span of all their (start, end) slices."""
    spans = [t for ivs in slices.values() for iv in ivs for t in iv]
    span = max(spans) - min(spans)
    busy = sum(_union(ivs) for ivs in slices.values())
    return 1.0 - busy / (len(slices) * span) if span > 0 else 0.0


def overlap(transfers: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float | None:
    """The share of the ``transfers``' time covered by the sender's ``busy`` slices; None without transfers."""
    total = sum(b - a for a, b in transfers)
    if total <= 0:
        return None
    covered = sum(_union([(max(a, s), min(b, e)) for s, e in busy if min(b, e) > max(a, s)]) for a, b in transfers)
    return covered / total


def _step_overlap(busy: dict[int, list], into: dict[int, list]) -> float | None:
    """Over every boundary of a step: the share of transfer time into stage k that stage k - 1 computed."""
    pairs = [(t, busy.get(k - 1, [])) for k, ts in into.items() if k > 0 for t in ts]
    total = sum(b - a for (a, b), _ in pairs)
    return sum(overlap([t], sender) * (t[1] - t[0]) for t, sender in pairs) / total if total > 0 else None


def write_chrome_trace(path: str, steps: list[dict], labels: list[str], microbatches: int) -> dict:
    """Write ``steps`` ({"step", "seqs", "events": {stage: [(kind, seq, start, end)]}}) as a Chrome trace.

    Returns the summary (measured bubble per step and its mean, the ideal) also stored in the file.
    """
    t0 = min(e[2] for st in steps for evs in st["events"].values() for e in evs)
    trace, measured, hidden = [], [], []
    for st in steps:
        per_stage, into = {}, {}
        for stage, evs in st["events"].items():
            mine = [e for e in evs if e[1] in st["seqs"]]
            per_stage[stage] = [(e[2], e[3]) for e in mine if e[0] != "T"]
            into[stage] = [(e[2], e[3]) for e in mine if e[0] == "T"]
            for kind, seq, start, end in mine:
                trace.append({"name": f"{kind}{seq - st['seqs'][0]}", "cat": _CATEGORY[kind], "ph": "X", "pid": 0,
                              "tid": stage + (len(labels) if kind == "T" else 0), "ts": (start - t0) * 1e6,
                              "dur": max(end - start, 0.0) * 1e6, "args": {"step": st["step"], "micro_batch": seq - st["seqs"][0]}})
        measured.append(bubble(per_stage))
        hidden.append(_step_overlap(per_stage, into))
    for stage, label in enumerate(labels):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": stage, "args": {"name": f"stage {stage} {label}"}})
        if any(e[0] == "T" for st in steps for e in st["events"].get(stage, ())):
            trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": len(labels) + stage,
                          "args": {"name": f"transfer {stage - 1} -> {stage}"}})
    shown = [h for h in hidden if h is not None]
    summary = {"bubble_per_step": measured, "bubble": sum(measured) / len(measured),
               "ideal_bubble": ideal_bubble(len(labels), microbatches), "microbatches": microbatches,
               "stages": len(labels), "steps": [st["step"] for st in steps],
               "overlap_per_step": hidden, "overlap": sum(shown) / len(shown) if shown else None}
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms", "otherData": summary}, f)
    return summary
