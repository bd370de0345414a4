"""Pipeline timeline (``--trace FILE``): Chrome-trace / Perfetto JSON with one row per stage
and a slice per micro-batch forward (F) and backward (B), and the measured bubble.

The bubble of a step is the share of stage-time spent idle between the step's first and
last slice: ``1 - sum over stages of busy time / (S x step span)``, where a stage's busy
time is the union of its slices (backward may overlap forward with the overlap schedule).
The ideal GPipe bubble is ``(S - 1) / (M + S - 1)``.

>>> round(ideal_bubble(stages=3, microbatches=4), 3)
0.333
>>> bubble({0: [(0.0, 1.0)], 1: [(1.0, 2.0)]})
0.5
"""
from __future__ import annotations

import json

__all__ = ["ideal_bubble", "bubble", "write_chrome_trace"]


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


def write_chrome_trace(path: str, steps: list[dict], labels: list[str], microbatches: int) -> dict:
    """Write ``steps`` ({"step", "seqs", "events": {stage: [(kind, seq, start, end)]}}) as a Chrome trace.

    Returns the summary (measured bubble per step and its mean, the ideal) also stored in the file.
    """
    t0 = min(e[2] for st in steps for evs in st["events"].values() for e in evs)
    trace, measured = [], []
    for st in steps:
        per_stage = {}
        for stage, evs in st["events"].items():
            mine = [e for e in evs if e[1] in st["seqs"]]
            per_stage[stage] = [(e[2], e[3]) for e in mine]
            for kind, seq, start, end in mine:
                trace.append({"name": f"{kind}{seq - st['seqs'][0]}", "cat": "forward" if kind == "F" else "backward",
                              "ph": "X", "pid": 0, "tid": stage, "ts": (start - t0) * 1e6,
                              "dur": max(end - start, 0.0) * 1e6, "args": {"step": st["step"], "micro_batch": seq - st["seqs"][0]}})
        measured.append(bubble(per_stage))
    for stage, label in enumerate(labels):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": stage, "args": {"name": f"stage {stage} {label}"}})
    summary = {"bubble_per_step": measured, "bubble": sum(measured) / len(measured),
               "ideal_bubble": ideal_bubble(len(labels), microbatches), "microbatches": microbatches,
               "stages": len(labels), "steps": [st["step"] for st in steps]}
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms", "otherData": summary}, f)
    return summary
