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


def test_transfers_get_a_row_per_boundary_and_the_share_the_sender_computed_meanwhile(tmp_path):
    # micro-batch 0 leaves stage 0 at 1.0 and arrives at 2.0 while stage 0 computes micro-batch 1 (1.0-1.5):
    # half the transfer is hidden; micro-batch 1's (1.5-2.5) overlaps nothing of stage 0
    events = {0: [("F", 0, 0.0, 1.0), ("F", 1, 1.0, 1.5)],
              1: [("T", 0, 1.0, 2.0), ("F", 0, 2.0, 3.0), ("T", 1, 1.5, 2.5), ("F", 1, 3.0, 4.0)]}
    path = tmp_path / "trace.json"
    summary = write_chrome_trace(str(path), [{"step": 1, "seqs": [0, 1], "events": events}], ["a", "b"], microbatches=2)
    data = json.loads(path.read_text())
    transfers = [(e["name"], e["tid"], e["cat"]) for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] == "transfer"]
    assert transfers == [("T0", 3, "transfer"), ("T1", 3, "transfer")]
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "stage 0 a", 1: "stage 1 b", 3: "transfer 0 -> 1"}
    assert summary["overlap"] == pytest.approx(0.5 / 2.0)
    # transfers are no compute: stage 1 busy 2-4, stage 0 busy 0-1.5, span 0-4 on 2 stages
    assert summary["bubble"] == pytest.approx(1 - 3.5 / 8)


def test_a_trace_or_metrics_path_whose_folder_cannot_be_made_is_refused_before_training(tmp_path):
    """The trace's folder was made only when the trace was written, after the traced steps: a path under a file (or
    a folder that did not exist) failed the run there with a FileNotFoundError. Both files' folders are made at the
    start now, and a path that cannot have one is a JobError naming the option."""
    import types
    from rpcmp.errors import JobError
    from rpcmp.train.trainer import MetricsLog, Tracer
    (tmp_path / "file").write_text("")
    job = types.SimpleNamespace(trace_file=str(tmp_path / "new" / "trace.json"))
    Tracer(types.SimpleNamespace(mode="pipeline"), job, 2, 4)
    assert (tmp_path / "new").is_dir()
    with pytest.raises(JobError, match=r"--trace .*/file/trace.json: its folder cannot be made"):
        Tracer(types.SimpleNamespace(mode="pipeline"), types.SimpleNamespace(trace_file=str(tmp_path / "file" / "trace.json")), 2, 4)
    with pytest.raises(JobError, match=r"--metrics .*/file/m.jsonl: its folder cannot be made"):
        MetricsLog(str(tmp_path / "file" / "m.jsonl"))
