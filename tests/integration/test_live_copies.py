"""A lost owner of a replicated pipeline (``--replicas 2 --spares 1``) rebuilt from the live copy: no step
is lost or trained twice, the losses and the model are those of the run nobody hit. The owner is killed from
outside at a random step, as a step starts, or inside its optimizer step."""
import json
import os
import random
import signal

import pytest
import torch

from helpers import assert_close_f32, run_command
from rpcmp.core.checkpoint import load_checkpoint
from test_live_recovery import STEPS, _command, _run_and_hit

pytestmark = pytest.mark.integration

REPLICATED = ("--local", "6", "--spares", "1", "--max-steps", "40")


@pytest.fixture(scope="module")
def replicated_clean(tmp_path_factory):
    folder = tmp_path_factory.mktemp("replicated") / "clean"
    done = run_command(*_command(folder, *REPLICATED, job="replicated_dies"), timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return folder


def _losses(folder) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, open(str(folder) + ".jsonl")) if r.get("kind") == "step"]


def _assert_as_uninterrupted(folder, clean) -> None:
    """No step trained twice or skipped, the same losses and the same model as the run nobody hit."""
    got, want = _losses(folder), _losses(clean)
    assert [s for s, _ in got] == list(range(1, 41))
    torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]))
    assert_close_f32(load_checkpoint(str(folder))["model"], load_checkpoint(str(clean))["model"])


@pytest.mark.timeout(300)
def test_with_replicas_a_lost_copy_is_rebuilt_from_the_live_copy_and_no_step_is_lost(tmp_path, replicated_clean):
    """Two copies of two stages (dropout in stage 0) and a spare: any owner killed at a random step."""
    at, victim = random.randint(3, 15), f"worker{random.randint(1, 4)}"
    print(f"killing {victim} at step {at}")
    code, out = _run_and_hit(tmp_path / "run", [(at, victim, signal.SIGKILL)], *REPLICATED, job="replicated_dies")
    assert code == 0, out
    assert out.count(f"recovered: {victim} was lost") == 1 and "rebuilt on worker5 from the live copy on" in out, out
    assert "no step lost" in out, out
    _assert_as_uninterrupted(tmp_path / "run", replicated_clean)


@pytest.mark.timeout(300)
def test_an_owner_lost_while_the_copies_build_is_replaced_by_the_spare_and_trains_as_uninterrupted(tmp_path,
                                                                                                   replicated_clean):
    """worker3 (replica 0's stage 1) killed in its build: the spare builds that stage from the job's seed, the copies of
    stage 1 average in a group of their own, and every step is the uninterrupted run's."""
    building = str(tmp_path / "building")
    code, out = _run_and_hit(tmp_path / "run", [(building, "worker3", signal.SIGKILL)], *REPLICATED,
                             job="replicated_slow_build", env={"RPCMP_TEST_BUILDING": building})
    assert code == 0, out
    assert "worker3 was lost while the stages were built; stage 1 (" in out and "built on worker5 (a spare)" in out, out
    _assert_as_uninterrupted(tmp_path / "run", replicated_clean)


@pytest.mark.timeout(300)
def test_a_spare_lost_while_it_takes_over_a_copy_s_stage_is_replaced_by_the_next(tmp_path, replicated_clean):
    """Two spares: the first (worker5) is killed once every owner is routed to it, while it takes the live copy's
    values (tests/jobs/slow_spare.py); the second takes over from the live copy, and no step is lost. (A spare lost
    while it builds the stage, before any route changed: tests/integration/test_live_recovery.py, the same retry.)"""
    building = str(tmp_path / "building")
    code, out = _run_and_hit(tmp_path / "run", [(random.randint(3, 15), "worker2", signal.SIGKILL),
                                                (building, "worker5", signal.SIGKILL)],
                             "--local", "7", "--spares", "2", "--max-steps", "40", job="slow_spare",
                             env={"SLOW_SPARE_OF": "replicated_dies", "SLOW_BUILD_ON": "worker5", "BUILDING": building,
                                  "SLOW_AT": "take_stage"})
    assert code == 0, out
    assert "rpcmp: worker5, the spare taking over from worker2, was lost during the recovery" in out, out
    assert out.count("recovered: ") == 1 and "recovered: worker2 was lost" in out, out
    assert "rebuilt on worker6 from the live copy on" in out, out
    _assert_as_uninterrupted(tmp_path / "run", replicated_clean)


@pytest.mark.timeout(300)
def test_an_owner_lost_while_a_resumed_run_reads_its_checkpoint_is_rebuilt_from_the_live_copy(tmp_path,
                                                                                             replicated_clean):
    """20 steps, then --resume to 40, where worker1 (replica 0's stage 0, with dropout) waits as it reads its part of
    the checkpoint (tests/jobs/slow_spare.py) and is killed there: the spare takes the stage, and its process's
    generators, from the other copy, which read the checkpoint; the model is the uninterrupted run's (it ended:
    "before the first step: worker1 ... stopped answering")."""
    first = run_command(*_command(tmp_path / "run", *REPLICATED[:-1], "20", job="replicated_dies"), timeout=240)
    assert first.returncode == 0, first.stdout + first.stderr
    waiting = str(tmp_path / "waiting")
    code, out = _run_and_hit(tmp_path / "run", [(waiting, "worker1", signal.SIGKILL)], *REPLICATED, "--resume",
                             job="slow_spare", env={"SLOW_SPARE_OF": "replicated_dies", "SLOW_BUILD_ON": "worker1",
                                                    "BUILDING": waiting, "SLOW_AT": "load_files"})
    assert code == 0, out
    assert out.count("recovered: worker1 was lost") == 1 and "rebuilt on worker5 from the live copy on worker2" in out, out
    assert "no step lost (the checkpoint read as the run resumed)" in out, out
    got = load_checkpoint(str(tmp_path / "run"))
    assert got["step"] == 40
    assert_close_f32(got["model"], load_checkpoint(str(replicated_clean))["model"])


@pytest.mark.timeout(300)
def test_a_copy_that_fails_before_the_copies_meet_leaves_no_other_copy_counting_the_step_as_taken(tmp_path):
    """Two copies of three stages (SGD with momentum, M=4) and a spare; copy 1's first owner is SIGKILLed as step
    11 starts, while copy 0 computes or waits to meet it. Copy 0's meeting breaks, and it used to return as if it
    had taken the step: the step 'stood' with nobody having taken it, one step skipped, the model off by it,
    and nothing said."""
    grid = ["--local", "8", "--replicas", "2", "--spares", "1"]
    clean = run_command(*_command(tmp_path / "clean", *grid, job="uneven"), timeout=240)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    code, out = _run_and_hit(tmp_path / "run", [(10, "worker2", signal.SIGKILL)], *grid, job="uneven")
    assert code == 0, out
    assert out.count("recovered: worker2 was lost") == 1 and "no step lost" in out, out
    got, want = _losses(tmp_path / "run"), _losses(tmp_path / "clean")
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]))
    assert_close_f32(load_checkpoint(str(tmp_path / "run"))["model"], load_checkpoint(str(tmp_path / "clean"))["model"])


@pytest.mark.timeout(300)
def test_an_owner_lost_in_its_optimizer_step_while_the_other_copy_steps_loses_no_step(tmp_path, replicated_clean):
    """The owner dies inside its optimizer step: the copies have met and averaged, the other copy takes the
    step (and its own copy's other owner may have taken it too): the step stands, taken from the other copy."""
    at, victim = random.randint(2, 15), f"worker{random.randint(1, 4)}"
    print(f"{victim} dies in its optimizer step {at}")
    done = run_command(*_command(tmp_path / "run", *REPLICATED, job="replicated_dies"), timeout=240,
                       env={**os.environ, "DIE_IN_STEP": f"{victim}:{at}", "COLUMNS": "200"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert out.count(f"recovered: {victim} was lost") == 1, out
    assert f"no step lost (step {at} stood: replica" in out and "other stages retaken from the same copy" in out, out
    _assert_as_uninterrupted(tmp_path / "run", replicated_clean)
