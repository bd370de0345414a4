import dataclasses

import pytest
import torch

import rpcmp
from rpcmp.errors import JobError
from rpcmp.job import load_job


def write(tmp_path, text, name="job.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_load_job_and_override(tmp_path):
    path = write(tmp_path, "import rpcmp, torch\njob = rpcmp.Job(stages=[torch.nn.Linear(1, 1)], batch_size=4)\n")
    job = load_job(path, overrides={"microbatches": 2})
    assert job.microbatches == 2 and job.source == path
    with pytest.raises(JobError, match=r"unknown Job settings \['micro'\]"):
        load_job(path, overrides={"micro": 2})


def test_missing_file(tmp_path):
    with pytest.raises(JobError, match="does not exist"):
        load_job(str(tmp_path / "nope.py"))


def test_job_that_does_not_import(tmp_path):
    path = write(tmp_path, "import rpcmp\nraise RuntimeError('boom at import')\n", "broken.py")
    with pytest.raises(JobError, match="failed to import: RuntimeError: boom at import"):
        load_job(path)


def test_job_file_without_job(tmp_path):
    path = write(tmp_path, "import rpcmp, torch\ntrain = rpcmp.Job(stages=[torch.nn.Linear(1, 1)])\n", "nojob.py")
    with pytest.raises(JobError, match=r"has no Job named 'job'.*named \['train'\]"):
        load_job(path)


@pytest.mark.parametrize("field,value,match", [
    ("batch_size", 0, "batch_size must be a positive integer"),
    ("microbatches", 9, r"microbatches \(9\) is larger than Job.batch_size \(8\)"),
    ("transport", "ib", "transport must be one of"),
    ("optimizer", ("sgd", {}), "torch.optim.<Class>"),
    ("optimizer", (torch.optim.LBFGS, {}), r"LBFGS.step needs a closure .* use an optimizer that steps on the gradients"),
    ("max_steps", 0, "max_steps must be None or a positive integer"),
    ("batchnorm", "deferred", r"batchnorm must be 'batch' \(whole-batch statistics, exact\) or 'micro'"),
    ("precision", "fp8", "precision must be 'fp32', 'bf16' or 'fp16'"),
    ("rpc_timeout", 0, r"rpc_timeout must be None \(the default\) or a positive number of seconds, got 0"),
])
def test_job_validation(field, value, match):
    with pytest.raises(JobError, match=match):
        rpcmp.Job(stages=[torch.nn.Linear(1, 1)], **{field: value})


def test_calls_may_take_30_minutes_without_spares_and_60_s_with_them_unless_set():
    """See [Note: a paused job goes on]: a silent worker is found by the watchdog, not by the calls' deadline,
    except on another host with spares."""
    job = rpcmp.Job(stages=[torch.nn.Linear(1, 1)])
    assert job.call_timeout == 1800.0
    assert dataclasses.replace(job, spares=1).call_timeout == 60.0
    assert dataclasses.replace(job, spares=1, rpc_timeout=300).call_timeout == 300.0
