"""--trace writes a valid Chrome trace: a slice per stage per micro-batch, forward and
backward, one per activation transfer between the stages, and a bubble and an overlap figure
that agree with those slices."""
import json
import os
import re

import pytest

from helpers import job_path, run_command

pytestmark = pytest.mark.integration


def _busy(intervals):
    """Union length of (start, end) intervals, computed independently of rpcmp.train.timeline."""
    points = sorted(intervals)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in points:
        if cur_b is None or a > cur_b:
            total += 0 if cur_b is None else cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (cur_b - cur_a if cur_b is not None else 0)


@pytest.mark.timeout(180)
def test_trace_has_every_slice_and_a_consistent_bubble(tmp_path):
    path = tmp_path / "trace.json"
    proc = run_command("run", job_path("mlp"), "--local", "3", "--max-steps", "6", "--microbatches", "4", "--trace",
                       str(path), timeout=150, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(path.read_text())
    summary = data["otherData"]
    assert summary["steps"] == [2, 3, 4] and summary["stages"] == 2 and summary["microbatches"] == 4
    assert summary["ideal_bubble"] == pytest.approx(1 / 5)
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    for step, reported in zip(summary["steps"], summary["bubble_per_step"]):
        moved = [e for e in slices if e["args"]["step"] == step and e["cat"] == "transfer"]
        mine = [e for e in slices if e["args"]["step"] == step and e["cat"] != "transfer"]
        for stage in (0, 1):
            names = sorted(e["name"] for e in mine if e["tid"] == stage)
            assert names == sorted([f"F{m}" for m in range(4)] + [f"B{m}" for m in range(4)])
        # every micro-batch crosses from stage 0 to stage 1 (row 2 + 1) after stage 0's forward began, and
        # arrives before stage 1's forward of it begins
        assert sorted(e["name"] for e in moved if e["tid"] == 3) == [f"T{m}" for m in range(4)]
        for t in moved:
            f0, f1 = (next(e for e in mine if e["tid"] == s and e["name"] == f"F{t['args']['micro_batch']}") for s in (0, 1))
            assert f0["ts"] <= t["ts"] and t["ts"] + t["dur"] <= f1["ts"] + 1, (f0, t, f1)
        start = min(e["ts"] for e in mine)
        span = max(e["ts"] + e["dur"] for e in mine) - start
        busy = sum(_busy([(e["ts"], e["ts"] + e["dur"]) for e in mine if e["tid"] == s]) for s in (0, 1))
        assert reported == pytest.approx(1 - busy / (2 * span), abs=1e-6)
        assert 0 <= reported < 1
    m = re.search(r"bubble ([\d.]+) measured, ([\d.]+) ideal .*transfers overlapped by compute (\d+)%", proc.stdout)
    assert m and float(m.group(1)) == pytest.approx(summary["bubble"], abs=1e-3)
    assert 0 <= summary["overlap"] <= 1 and abs(int(m.group(3)) - summary["overlap"] * 100) <= 0.51


def _run_traced(tmp_path, schedule):
    path = tmp_path / f"{schedule}.json"
    proc = run_command("run", job_path("mlp"), "--local", "3", "--max-steps", "5", "--microbatches", "4", "--schedule",
                       schedule, "--trace", str(path), timeout=150, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def _early_starts(slices, stages=2, microbatches=4):
    """Forwards on stage 0 that started before micro-batch i - S's backward had left it."""
    early = []
    for step in {e["args"]["step"] for e in slices}:
        first = {(e["name"][0], e["args"]["micro_batch"]): e for e in slices
                 if e["args"]["step"] == step and e["tid"] == 0}
        for i in range(stages, microbatches):
            if first[("F", i)]["ts"] < first[("B", i - stages)]["ts"] + first[("B", i - stages)]["dur"]:
                early.append((step, i))
    return early


@pytest.mark.timeout(300)
def test_1f1b_schedule_keeps_at_most_s_micro_batches_in_flight(tmp_path):
    # overlap issues every forward at once: stage 0 runs F2 and F3 long before B0 and B1 come back
    assert _early_starts(_run_traced(tmp_path, "overlap"))
    assert _early_starts(_run_traced(tmp_path, "1f1b")) == []
