"""Clipping by the global norm over every stage, LR schedulers on every stage, accumulation, and a step of one
micro-batch taken by each owner in its backward, each equal to the same feature on the unsplit model in one
process."""
import dataclasses

import pytest
import torch
import torch.distributed.rpc as rpc

import rpcmp
from helpers import RecordingSGD, assert_close_f32, batches, load, run_ranks, steps_taken

pytestmark = pytest.mark.integration
STEPS = 4
SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
SCHED = (torch.optim.lr_scheduler.StepLR, {"step_size": 1, "gamma": 0.5})
ADAM = (torch.optim.Adam, {})  # the class's own default learning rate
# Schedulers that set the optimizer at construction (step 1 does not use the base lr) and that
# cycle momentum / betas as well as the learning rate.
WARMUP = (torch.optim.lr_scheduler.LinearLR, {"start_factor": 0.1, "total_iters": 3})
ONECYCLE = (torch.optim.lr_scheduler.OneCycleLR, {"max_lr": 0.2, "total_steps": STEPS})
SCHEDULED = {"warmup-sgd": (SGD, WARMUP), "onecycle-sgd": (SGD, ONECYCLE), "warmup-adam": (ADAM, WARMUP),
             "onecycle-adam": ((torch.optim.Adam, {"lr": 0.01}), ONECYCLE)}


# Which owners take the optimizer step in the backward (see [Note: a step steps where its gradients are made] in
# rpcmp/owner/stepping.py): name -> (Job fields, M, the processes that step in the backward; the others are asked
# after it)
ONE_EACH = ["worker1/cpu", "worker2/cpu", "master/cpu"]
IN_BACKWARD = {
    "m1": ({"placement": ONE_EACH}, 1, {"master", "worker1", "worker2"}),
    "m1-sched": ({"placement": ONE_EACH, "scheduler": WARMUP}, 1, {"master", "worker1", "worker2"}),
    "m1-two-stages-here": ({"placement": ["worker1/cpu", "worker1/cpu", "master/cpu"]}, 1, {"master"}),
    "m1-master-first": ({"placement": ["master/cpu", "worker1/cpu", "worker2/cpu"]}, 1, {"worker1", "worker2"}),
    "m1-clip": ({"placement": ONE_EACH, "clip_grad_norm": 0.05}, 1, set()),
    "m2": ({"placement": ONE_EACH}, 2, {"master", "worker1", "worker2"}),
    "m4-1f1b-two-stages-here": ({"placement": ["worker1/cpu", "worker1/cpu", "master/cpu"], "schedule": "1f1b"}, 4,
                                {"master"}),
    "m2-gpipe": ({"placement": ONE_EACH, "schedule": "gpipe"}, 2, set()),
    "m2-sched": ({"placement": ONE_EACH, "scheduler": WARMUP}, 2, {"master", "worker1", "worker2"}),
    "m2-clip": ({"placement": ONE_EACH, "clip_grad_norm": 0.05}, 2, set()),
}


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
    for name, (optimizer, scheduler) in SCHEDULED.items():
        variant = dataclasses.replace(job, stages=rpcmp.Split([2, 3, 2]), optimizer=optimizer, scheduler=scheduler)
        pipe = rpcmp.Pipeline(variant, world_size, microbatches=2)
        fields = [pipe.hparams()]
        for x, y in data:
            pipe.train_step(x, y)
            fields.append(pipe.hparams())
        out[name] = (pipe.state_dict(), fields)
        pipe.close()
    # accumulation: 2 batches of 8 per step == 1 batch of 16
    variant = dataclasses.replace(job, stages=rpcmp.Split([3, 4]), optimizer=SGD, accumulate=2)
    pipe = rpcmp.Pipeline(variant, world_size, microbatches=2)
    for i in range(0, STEPS, 2):
        (x0, y0), (x1, y1) = data[i], data[i + 1]
        pipe.train_step(torch.cat([x0, x1]), torch.cat([y0, y1]), chunks=4)
    out["accumulate"] = pipe.state_dict()
    for name, kw in IN_BACKWARD.items():
        variant = dataclasses.replace(job, stages=rpcmp.Split([2, 3, 2]), optimizer=(RecordingSGD, SGD[1]), **kw[0])
        pipe = rpcmp.Pipeline(variant, world_size, microbatches=kw[1])
        for x, y in data:
            pipe.train_step(x, y)
        out[name] = (pipe.state_dict(), {p: rpc.rpc_sync(p, steps_taken) for p in ("master", "worker1", "worker2")})
        pipe.close()
    return out


def _reference(clip=None, scheduler=None, accumulate=1, optimizer=SGD):
    job = load("mlp")
    torch.manual_seed(job.seed)
    model = job.model()
    opt = optimizer[0](model.parameters(), **optimizer[1])
    sched = scheduler[0](opt, **scheduler[1]) if scheduler else None
    data = batches(STEPS, size=8, seed=7)
    norms, fields = [], [_fields(opt)]
    for i in range(0, STEPS, accumulate):
        opt.zero_grad()
        for x, y in data[i:i + accumulate]:
            (job.loss(model(x), y) / accumulate).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        if sched:
            sched.step()
        fields.append(_fields(opt))
    return model.state_dict(), norms, fields


def _fields(opt):
    group = opt.param_groups[0]
    return {k: group[k] for k in ("lr", "momentum", "betas") if k in group}


@pytest.fixture(scope="module")
def runs():
    return run_ranks("mlp", 3, _run, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sched", ["overlap", "gpipe"])
def test_clipping_equals_clip_grad_norm_on_the_unsplit_model(runs, sched):
    state, _, _, norms = runs[("clip", sched)]
    ref_state, ref_norms, _ = _reference(clip=0.05)
    assert all(n > 0.05 for n in ref_norms)  # clipping really happened
    assert_close_f32(norms, ref_norms)
    assert_close_f32(state, ref_state)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sched", ["overlap", "gpipe"])
def test_scheduler_changes_every_stage_learning_rate(runs, sched):
    state, _, lrs, _ = runs[("sched", sched)]
    assert [set(step) for step in lrs] == [{0.05}, {0.025}, {0.0125}, {0.00625}]
    assert all(len(step) == 3 for step in lrs)  # one optimizer per stage owner, all changed
    assert_close_f32(state, _reference(scheduler=SCHED)[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(SCHEDULED))
def test_every_field_a_scheduler_sets_reaches_every_stage_before_the_step_that_uses_it(runs, name):
    optimizer, scheduler = SCHEDULED[name]
    state, fields = runs[name]
    ref_state, _, ref_fields = _reference(scheduler=scheduler, optimizer=optimizer)
    for got, want in zip(fields, ref_fields):  # before step 1, and after every step
        assert len(got) == 3  # one optimizer per stage owner
        for owner in got:
            for key, value in want.items():
                assert owner[0][key] == pytest.approx(value), (name, key, fields, ref_fields)
    if name.startswith("onecycle"):  # momentum / betas really cycled
        key = "momentum" if "momentum" in ref_fields[0] else "betas"
        assert ref_fields[0][key] != ref_fields[2][key]
    assert_close_f32(state, ref_state)


@pytest.mark.timeout(300)
def test_accumulation_equals_one_batch_k_times_larger(runs):
    assert_close_f32(runs["accumulate"], _reference(accumulate=2)[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(IN_BACKWARD))
def test_a_step_is_taken_by_each_owner_that_can_in_its_backward_once(runs, name):
    fields, _, inside = IN_BACKWARD[name]
    state, taken = runs[name]
    holders = {place.split("/")[0] for place in fields["placement"]}
    for process, graph_tasks in taken.items():  # one update a step, by the owner or by the master's call
        assert len(graph_tasks) == (STEPS if process in holders else 0), (name, taken)
        assert all((t >= 0) == (process in inside) for t in graph_tasks), (name, taken)
    assert_close_f32(state, _reference(clip=fields.get("clip_grad_norm"), scheduler=fields.get("scheduler"))[0])
