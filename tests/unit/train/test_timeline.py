"""The Chrome timeline without processes: slices per stage, the bubble of each step, the file."""
import json

import pytest

from rpcmp.train.timeline import bubble, write_chrome_trace


def test_overlapping_slices_of_a_stage_count_once_and_idle_time_is_the_bubble():
    # stage 0 busy 0-2 (two overlapping slices), stage 1 busy 1-3: span 3 on 2 stages, busy 4 of 6
    assert bubble({0: [(0.0, 1.5), (1.0, 2.0)], 1: [(1.0, 3.0)]}) == pytest.approx(1 - 4 / 6)
    assert bubble({0: [(1.0, 1.0)], 1: [(1.0, 1.0)]}) == 0.0  # no span: no bubble, no division by zero


def test_the_trace_keeps_each_steps_own_micro_batches(tmp_path):
    events = {0: [("F", 4, 10.0, 11.0), ("B", 4, 12.0, 13.0), ("F", 6, 20.0, 21.0)],
              1: [("F", 4, 11.0, 12.0), ("F", 6, 21.0, 22.0)]}
    steps = [{"step": 3, "seqs": [4, 5], "events": events}, {"step": 4, "seqs": [6, 7], "events": events}]
    path = tmp_path / "trace.json"
    summary = write_chrome_trace(str(path), steps, ["a", "b"], microbatches=2)
    data = json.loads(path.read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["args"]["step"]) for e in slices] == [
        ("F0", 0, 3), ("B0", 0, 3), ("F0", 1, 3), ("F0", 0, 4), ("F0", 1, 4)]
    assert slices[0]["ts"] == 0.0 and slices[0]["dur"] == pytest.approx(1e6)
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "stage 0 a", 1: "stage 1 b"}
    assert summary["steps"] == [3, 4] and summary["ideal_bubble"] == pytest.approx(1 / 3)
    assert summary["bubble_per_step"][1] == pytest.approx(0.5) and data["otherData"] == summary
