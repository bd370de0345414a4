"""Re-cutting a Split pipeline while it trains: ``pipe.recut(balance)`` by hand, and ``--rebalance``,
which re-cuts by itself; the model is the one an undisturbed run trains. A SplitAt's re-cut:
tests/unit/master/test_recut_in_process.py, and each language model in
tests/integration/test_language_models.py."""
import dataclasses
import os
import re
import signal

import pytest
import torch

import rpcmp
from helpers import assert_close_f32, half_open, job_path, run_command, run_ranks
from rpcmp.core.checkpoint import load_checkpoint
from test_live_recovery import _command, _run_and_hit

pytestmark = pytest.mark.integration


def _recuts(job, world_size):
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(16, 256, generator=g), torch.randn(16, 256, generator=g)) for _ in range(8)]
    out = {}
    for cuts in ({}, {3: [3, 3, 2], 5: [3, 2, 3], 6: [3, 1, 4]}):  # the last keeps stage 0 as it is
        pipe = rpcmp.Pipeline(dataclasses.replace(job, microbatches=2), world_size)
        losses, names = [], []
        for step, (x, y) in enumerate(data):
            if step in cuts:
                pipe.recut(cuts[step])
                names.append([s.name for s in pipe.specs])
            losses.append(pipe.train_step(x, y).item())
        out[bool(cuts)] = (losses, pipe.state_dict(), pipe.optimizer_state(), names)
        pipe.close()
    return out


@pytest.mark.timeout(300)
def test_a_run_re_cut_three_times_equals_an_undisturbed_run():
    runs = run_ranks("uneven", 4, _recuts, timeout=240)
    (l0, s0, o0, _), (l1, s1, o1, names) = runs[False], runs[True]
    assert names[0] == ["layers[0:3]", "layers[3:6]", "layers[6:8]"] and names[2][0] == "layers[0:3]"
    assert l1 == l0
    for k in s0:
        assert torch.equal(s1[k], s0[k]), k
    for k in o0:
        assert all(torch.equal(o1[k][f], o0[k][f]) for f in o0[k]), k


@pytest.mark.timeout(300)
def test_rebalance_re_cuts_an_uneven_split_by_itself_and_trains_the_same_model(tmp_path):
    common = ["run", job_path("uneven"), "--local", "4", "--max-steps", "40"]
    plain = run_command(*common, "--checkpoint-dir", str(tmp_path / "plain"))
    assert plain.returncode == 0, plain.stdout + plain.stderr
    moved = run_command(*common, "--rebalance", "--checkpoint-dir", str(tmp_path / "moved"),
                        env={**os.environ, "COLUMNS": "200"})
    assert moved.returncode == 0, moved.stdout + moved.stderr
    cuts = re.findall(r"re-cut after step \d+: balance \[([\d, ]+)\] -> \[([\d, ]+)\]", moved.stdout)
    assert cuts and cuts[0][0] == "1, 5, 2", moved.stdout
    after = [tuple(map(int, b.split(", "))) for _, b in cuts]
    assert max(after[-1]) <= 4 and len(set(after)) == len(after) and (1, 5, 2) not in after  # never back
    assert_close_f32(load_checkpoint(str(tmp_path / "moved"))["model"], load_checkpoint(str(tmp_path / "plain"))["model"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("copies", [[], ["--local", "8", "--replicas", "2"]], ids=["one-pipeline", "replicas"])
def test_an_owner_lost_as_the_run_measures_or_re_cuts_itself_is_replaced_and_the_model_is_an_undisturbed_run_s(tmp_path,
                                                                                                             copies):
    """worker2 is SIGKILLed once step 10 is recorded: as the re-balancer measures the stages, re-cuts them (its
    new part half built: the re-cut is undone on the others, and on the copies re-cut before; the snapshots kept
    with the stages it left as they were) or in the next step. The spare takes over (from the last snapshot, or
    from the live copy) and the run ends with the model of the same run left alone. Every other worker is left
    half-connected to at step 3 first (helpers.half_open; rpcmp/core/pipes.py): a re-cut's calls of a process to
    itself (gathering a stage it keeps) went through its own listener, stopped by then."""
    plain = run_command(*_command(tmp_path / "plain", "--spares", "1", *copies, job="uneven"), timeout=240)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    others = [f"worker{r}" for r in range(1, 8 if copies else 5) if r != 2]
    code, out = _run_and_hit(tmp_path / "hit", [*((3, w, half_open) for w in others), (10, "worker2", signal.SIGKILL)],
                             "--spares", "1", "--rebalance", *copies, job="uneven")
    assert code == 0, out
    assert out.count("recovered: worker2 was lost") == 1 and "re-cut after step" in out, out
    assert_close_f32(load_checkpoint(str(tmp_path / "hit"))["model"], load_checkpoint(str(tmp_path / "plain"))["model"])


@pytest.mark.timeout(300)
def test_an_owner_lost_while_the_new_cut_s_snapshot_travels_is_replaced_from_the_old_cut_s(tmp_path, monkeypatch):
    """The re-cut's snapshot takes 4 s to reach the buddies (tests/jobs/recut_slow_snapshot.py) and worker2 is
    SIGKILLed as it travels: the re-cut is undone (its old parts and their snapshots are still there) and the
    spare takes over from the old cut's snapshot. It used to end the run: the re-cut had let the old parts go,
    and no buddy held the new cut's copy yet ("no snapshot holds the lost stages"); see [Note: a re-cut and its
    snapshot] in rpcmp/master/recut.py."""
    plain = run_command(*_command(tmp_path / "plain", "--spares", "1", job="uneven"), timeout=240)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    flag = str(tmp_path / "snapshot-travels")
    monkeypatch.setenv("SNAPSHOT_FLAG", flag)
    code, out = _run_and_hit(tmp_path / "hit", [(flag, "worker2", signal.SIGKILL)], "--spares", "1", "--rebalance",
                             job="recut_slow_snapshot")
    assert code == 0, out
    failed = re.search(r"kept balance \[1, 5, 2\] after step (\d+): the re-cut to \[.*\] failed: worker2 was lost "
                       r"meanwhile", out)
    assert failed, out  # after step 10 as a rule: the old cut's last snapshot (every 10 steps) is then step 0's
    assert out.count("recovered: worker2 was lost") == 1, out
    assert f"from the snapshot of step {(int(failed.group(1)) - 1) // 10 * 10}" in out, out
    assert_close_f32(load_checkpoint(str(tmp_path / "hit"))["model"], load_checkpoint(str(tmp_path / "plain"))["model"])


def _dropout_recuts(job, world_size):
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(5)]
    runs = []
    for cut in (False, True):
        torch.manual_seed(11)  # the master's generator: its stage's masks
        pipe = rpcmp.Pipeline(job, world_size)
        losses = []
        for step, (x, y) in enumerate(data):
            if cut and step == 2:
                pipe.recut([2, 5])  # the ReLU moves; each dropout stays on its process
            losses.append(pipe.train_step(x, y).item())
        runs.append((losses, pipe.state_dict()))
        pipe.close()
    return runs


@pytest.mark.timeout(300)
def test_a_re_cut_leaves_each_process_s_dropout_masks_as_they_would_be():
    # Planning and building the new cut seed to draw the model's values; the master (stage 1 here) and the
    # owner must get their generators back as they were, or every later mask changes.
    (l0, s0), (l1, s1) = run_ranks("dropout", 2, _dropout_recuts, overrides={"placement": ["worker1/cpu", "master/cpu"]},
                                   timeout=240)
    assert l1 == l0
    assert all(torch.equal(s1[k], v) for k, v in s0.items())


@pytest.mark.timeout(300)
def test_an_owner_lost_while_another_gathers_its_new_part_from_it_costs_that_owner_alone(tmp_path):
    """worker1 takes layers of worker2's stage in a re-cut (tests/jobs/slow_spare.py holds it 3 s as it starts);
    worker2 is SIGKILLed meanwhile. worker1's call fails, and nothing of it may take worker1 down after: owners
    hold no RRef of another process (see [Note: no handle of a third process] in rpcmp/owner/state.py), whose
    release torch retries and then ends the process (seen once, in a clean-clone run of
    test_an_owner_lost_as_the_run_measures_or_re_cuts_itself_...: terminate called ... max retries, 9 s after the
    kill; the run here lasts that long). The re-cut is undone, the spare takes over
    worker2's stage and the run ends with the model of the same run left alone."""
    plain = run_command(*_command(tmp_path / "plain", "--spares", "1", job="uneven", steps=150), timeout=240)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    building = str(tmp_path / "gathering")
    code, out = _run_and_hit(tmp_path / "hit", [(building, "worker2", signal.SIGKILL)], "--spares", "1", "--rebalance",
                             job="slow_spare", steps=150, env={"SLOW_SPARE_OF": "uneven", "SLOW_BUILD_ON": "worker1",
                                                    "SLOW_AT": "gather_stage", "SLOW_S": "3", "BUILDING": building})
    assert code == 0, out
    assert out.count("recovered: worker2 was lost") == 1 and "max retries" not in out, out
    assert_close_f32(load_checkpoint(str(tmp_path / "hit"))["model"], load_checkpoint(str(tmp_path / "plain"))["model"])
