"""Errors raised on a worker reach the master with the stage, the owner and the cause."""
import pytest
import torch

import rpcmp
from helpers import run_ranks

pytestmark = pytest.mark.integration


def _step(job, world_size):
    pipe = rpcmp.Pipeline(job, world_size)
    try:
        pipe.train_step(torch.randn(4, 4), None)
    except rpcmp.StageError as exc:
        return f"StageError: {exc}"
    return "no error"


@pytest.mark.timeout(120)
def test_stage_output_that_is_not_tensors():
    msg = run_ranks("bad_output", 4, _step)
    assert "StageError" in msg and "stage 1 (Scalar) on worker2/cpu" in msg
    assert "['score'] is a float" in msg and "return tensors only" in msg


@pytest.mark.timeout(120)
def test_model_factory_that_raises_reaches_the_master_with_its_traceback():
    with pytest.raises(RuntimeError) as info:
        run_ranks("factory_raises", 3, _step)
    text = str(info.value)
    assert "building stage 1 (broken_decoder) on worker2/cpu failed" in text
    assert "decoder factory exploded" in text and "Traceback" in text


def _fail_mid_step(job, world_size):
    out = {}
    x = torch.randn(8, 4)
    bad = x.clone()
    bad[2:4] = 1e5  # micro-batch 1 of 4
    for sched in ("overlap", "1f1b", "gpipe"):
        pipe = rpcmp.Pipeline(job, world_size, schedule=sched)
        try:
            pipe.train_step(bad, None)
            out[sched] = ("no error", None)
        except rpcmp.StageError as exc:
            out[sched] = (str(exc), pipe.train_step(x, None).item())  # the next step runs
        pipe.close()
    return out


@pytest.mark.timeout(150)
def test_a_micro_batch_failing_mid_step_is_reported_and_the_next_step_runs():
    # Stage 2 must not wait for micro-batch 1, which died at stage 1, before running 2 and 3: that
    # wait would end only at the RPC timeout (60 s per schedule, beyond this run's 100 s).
    for sched, (msg, next_loss) in run_ranks("picky", 4, _fail_mid_step, timeout=100).items():
        assert "stage 1 (Picky) on worker2/cpu failed on micro-batch" in msg, (sched, msg)
        assert "this micro-batch is out of range" in msg, (sched, msg)
        assert next_loss is not None and next_loss == next_loss, sched


def _fail_in_backward(job, world_size):
    out = {}
    for sched in ("overlap", "1f1b", "gpipe"):
        pipe = rpcmp.Pipeline(job, world_size, schedule=sched)
        try:
            pipe.train_step(torch.randn(8, 4), None)
            out[sched] = "no error"
        except rpcmp.StageError as exc:
            out[sched] = str(exc)
        out[sched + " then predict"] = tuple(pipe.predict(torch.randn(8, 4)).shape)
        pipe.close()
    return out


@pytest.mark.timeout(150)
def test_a_stage_failing_in_backward_is_named():
    out = run_ranks("fragile", 4, _fail_in_backward, timeout=100)
    for sched in ("overlap", "1f1b", "gpipe"):
        assert out[sched].startswith("the backward pass failed on worker2 (stage 1 (Fragile)): "), out[sched]
        assert "backward exploded" in out[sched]
        assert out[sched + " then predict"] == (8, 4)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("owner", ["master", "worker1"])
def test_a_failing_stage_is_reported_once_with_its_own_traceback(owner):
    import os

    from helpers import job_path, run_command
    env = {**os.environ, "EXPLODE_ON": "master" if owner == "master" else "worker", "COLUMNS": "200"}
    proc = run_command("run", job_path("explodes"), "--local", "3", timeout=150, env=env)
    err = proc.stderr
    assert proc.returncode == 1, proc.stdout + err
    line = (f"error: StageError: stage 2 (layers[3:4]) on {owner}/cpu failed on micro-batch 0: RuntimeError: "
            f"mat1 and mat2 shapes cannot be multiplied (8192x1 and 512x10)")
    assert err.count(line) == 1 and err.count("error:") == 1, err
    assert err.count("Traceback") == 1 and 'explodes.py", line 15, in forward' in err, err
    assert "rpcmp/owner/stage.py" not in err and "WorkerInfo" not in err and "torch/distributed" not in err, err
    assert "(during training step 1)" in err
    assert len(err.splitlines()) <= 12, err
    debug = run_command("run", job_path("explodes"), "--local", "3", "--debug", timeout=150, env=env).stderr
    assert debug.count(line) == 1 and "rpcmp/owner/stage.py" in debug and 'explodes.py", line 15' in debug, debug
