"""Bad input at run time: a clear error, and nothing hangs (real processes)."""
import dataclasses
import warnings

import pytest
import torch

import rpcmp
from helpers import run_ranks

pytestmark = pytest.mark.integration


SCHEDULES = [("overlap", 2), ("gpipe", 2), ("overlap", 1), ("overlap", 4)]


def _nonfinite(job, world_size):
    out = {}
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    for policy in ("stop", "skip"):
        for sched, m in SCHEDULES:  # overlap: the owners would step in the backward (rpcmp/owner/stepping.py)
            job.nonfinite = policy
            pipe = rpcmp.Pipeline(job, world_size, schedule=sched, microbatches=m)
            before = pipe.state_dict()
            try:
                with pytest.warns(RuntimeWarning) if policy == "skip" else _nothing():
                    # samples 2 and 3 only: at M = 4 the backwards before and after the skipped one run, and no
                    # owner steps
                    loss = pipe.train_step(x, torch.cat([y[:2], y[2:4] * float("nan"), y[4:]]))
                result = f"loss {loss.item()}"
            except rpcmp.NonFiniteLossError as exc:
                result = f"NonFiniteLossError: {exc}"
            unchanged = all(torch.equal(before[k], v) for k, v in pipe.state_dict().items())
            finite_step = pipe.train_step(x, y).item()
            out[(policy, sched, m)] = (result, unchanged, finite_step)
            pipe.close()
    # more micro-batches in one step than the pipeline was built for: no deadlock
    out["more chunks"] = rpcmp.Pipeline(job, world_size, microbatches=2).train_step(x, y, chunks=8).item()
    try:
        rpcmp.Pipeline(job, world_size, microbatches=4).train_step(torch.randn(3, 16), torch.randn(3, 8))
    except rpcmp.MicroBatchError as exc:
        out["small batch"] = str(exc)
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.timeout(180)
def test_nonfinite_loss_stops_or_skips_and_small_batch_is_refused():
    out = run_ranks("mlp", 3, _nonfinite)
    for sched, m in SCHEDULES:
        result, unchanged, next_loss = out[("stop", sched, m)]
        assert result.startswith("NonFiniteLossError: the loss is nan before any update") and "nonfinite='skip'" in result
        assert "rpcmp plan JOB --check" in result and "Lower the learning rate" not in result
        assert unchanged and next_loss == next_loss  # parameters untouched and still trainable
        result, unchanged, next_loss = out[("skip", sched, m)]
        assert result == "loss nan" and unchanged and next_loss == next_loss
    assert "a batch of 3 samples cannot be split into 4 micro-batches" in out["small batch"]
    assert out["more chunks"] > 0


def batch_sum_loss(out, y):  # a sum over samples, not a mean: micro-batch losses do not add up to it
    return ((out - y) ** 2).sum()


def _loss_check(job, world_size):
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    out = {}
    for name, loss in (("sum", batch_sum_loss), ("mean", torch.nn.functional.mse_loss)):
        for sched in ("overlap", "1f1b", "gpipe"):
            pipe = rpcmp.Pipeline(dataclasses.replace(job, loss=loss), world_size, microbatches=2, schedule=sched)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                for _ in range(3):
                    pipe.train_step(x, y)
            out[(name, sched)] = [str(w.message) for w in seen if "mean over samples" in str(w.message)]
            pipe.close()
    return out


@pytest.mark.timeout(240)
def test_a_loss_that_is_not_a_mean_over_samples_is_flagged_once_where_micro_batches_change_it():
    out = run_ranks("mlp", 3, _loss_check)
    for sched in ("overlap", "1f1b"):
        assert len(out[("sum", sched)]) == 1, out  # once per pipeline, not every step
        assert "schedule='gpipe'" in out[("sum", sched)][0] and f"schedule={sched!r}" in out[("sum", sched)][0]
    assert out[("sum", "gpipe")] == []  # gpipe computes the loss on the whole batch: nothing to flag
    assert all(out[("mean", sched)] == [] for sched in ("overlap", "1f1b", "gpipe")), out
