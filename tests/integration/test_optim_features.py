"""Clipping by the global norm over every stage, LR schedulers on every stage, and
accumulation, each equal to the same feature on the unsplit model in one process."""
import dataclasses

import pytest
import torch

import rpcmp
from helpers import batches, load, run_ranks

pytestmark = pytest.mark.integration
STEPS = 4
SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
SCHED = (torch.optim.lr_scheduler.StepLR, {"step_size": 1, "gamma": 0.5})


def _run(job, world_size):
    data = batches(STEPS, size=8, seed=7)
    out = {}
    for name, kw in {"clip": {"clip_grad_norm": 0.05}, "sched": {"scheduler": SCHED}}.items():
        for sched in ("overlap", "gpipe"):
            variant = dataclasses.replace(job, stages=rpcmp.Split([2, 3, 2]), optimizer=SGD, **kw)
            pipe = rpcmp.Pipeline(variant, world_size, microbatches=2, schedule=sched)
            losses, lrs, norms = [], [], []
            for x, y in data:
                losses.append(pipe.train_step(x, y).item())
                lrs.append(pipe.learning_rates())
                norms.append(pipe.last_grad_norm)
            out[(name, sched)] = (pipe.state_dict(), losses, lrs, norms)
            pipe.close()
    # accumulation: 2 batches of 8 per step == 1 batch of 16
    variant = dataclasses.replace(job, stages=rpcmp.Split([3, 4]), optimizer=SGD, accumulate=2)
    pipe = rpcmp.Pipeline(variant, world_size, microbatches=2)
    for i in range(0, STEPS, 2):
        (x0, y0), (x1, y1) = data[i], data[i + 1]
        pipe.train_step(torch.cat([x0, x1]), torch.cat([y0, y1]), chunks=4)
    out["accumulate"] = pipe.state_dict()
    return out


def _reference(clip=None, scheduler=None, accumulate=1):
    job = load("mlp")
    torch.manual_seed(job.seed)
    model = job.model()
    opt = SGD[0](model.parameters(), **SGD[1])
    sched = scheduler[0](opt, **scheduler[1]) if scheduler else None
    data = batches(STEPS, size=8, seed=7)
    norms = []
    for i in range(0, STEPS, accumulate):
        opt.zero_grad()
        for x, y in data[i:i + accumulate]:
            (job.loss(model(x), y) / accumulate).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        if sched:
            sched.step()
    return model.state_dict(), norms


@pytest.fixture(scope="module")
def runs():
    return run_ranks("mlp", 3, _run, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sched", ["overlap", "gpipe"])
def test_clipping_equals_clip_grad_norm_on_the_unsplit_model(runs, sched):
    state, _, _, norms = runs[("clip", sched)]
    ref_state, ref_norms = _reference(clip=0.05)
    assert all(n > 0.05 for n in ref_norms)  # clipping really happened
    torch.testing.assert_close(norms, ref_norms)
    torch.testing.assert_close(state, ref_state)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sched", ["overlap", "gpipe"])
def test_scheduler_changes_every_stage_learning_rate(runs, sched):
    state, _, lrs, _ = runs[("sched", sched)]
    assert [set(step) for step in lrs] == [{0.05}, {0.025}, {0.0125}, {0.00625}]
    assert all(len(step) == 3 for step in lrs)  # one optimizer per stage owner, all changed
    torch.testing.assert_close(state, _reference(scheduler=SCHED)[0])


@pytest.mark.timeout(300)
def test_accumulation_equals_one_batch_k_times_larger(runs):
    torch.testing.assert_close(runs["accumulate"], _reference(accumulate=2)[0])
