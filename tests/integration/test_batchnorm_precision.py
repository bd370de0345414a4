"""BatchNorm under micro-batching (whole-batch by default, per micro-batch on request),
recomputation (activation checkpointing) and mixed precision (bf16 autocast, fp16 with
loss scaling) in pipeline mode."""
import dataclasses

import pytest
import torch

import rpcmp
import torch.distributed.rpc as rpc
from helpers import assert_close_f32, batches, load, run_ranks, train_reference
from rpcmp.owner import state as stage_state

pytestmark = pytest.mark.integration
STEPS = 3


def _run(job, world_size):
    data = batches(STEPS, size=8, seed=3)
    out = {}
    for recompute in (False, True):  # one step: gradients and running statistics, before BatchNorm over 2-sample
        for sched in ("overlap", "gpipe"):  # micro-batches amplifies float rounding over later steps
            pipe = rpcmp.Pipeline(dataclasses.replace(job, batchnorm="micro", recompute=recompute), world_size,
                                  microbatches=4, schedule=sched)
            loss = pipe.train_step(*data[0]).item()
            out[("one step", sched, recompute)] = (loss, pipe.state_dict())
            pipe.close()
    for bn_mode, ms, recompute in (("batch", (1, 2, 4), False), ("micro", (1, 4), False)):
        for m in ms:
            for sched in ("overlap", "gpipe"):
                variant = dataclasses.replace(job, batchnorm=bn_mode, recompute=recompute)
                pipe = rpcmp.Pipeline(variant, world_size, microbatches=m, schedule=sched)
                losses = [pipe.train_step(x, y).item() for x, y in data]
                pipe.eval()
                key = (bn_mode, m, sched) + (("recompute",) if recompute else ())
                out[key] = (losses, pipe.state_dict(), pipe.predict(data[0][0]), pipe.batch_chunks)
                pipe.close()
    for precision in ("bf16", "fp16"):
        pipe = rpcmp.Pipeline(dataclasses.replace(job, precision=precision), world_size, microbatches=2)
        if precision == "fp16":
            pipe.loss_scale = 2.0 ** 24  # overflows at once: the first steps must be skipped
        states, losses, scales = [pipe.state_dict()], [], []
        for x, y in batches(10, size=8, seed=4):
            losses.append(pipe.train_step(x, y).item())
            states.append(pipe.state_dict())
            scales.append(pipe.loss_scale)
        out[precision] = (losses, states, scales, pipe.overflow_steps)
        pipe.close()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks("bn", 3, _run, timeout=240)


def _reference(data):
    job = load("bn")
    torch.manual_seed(job.seed)
    model = job.model()
    losses, state = train_reference(model, job.optimizer, job.loss, data)
    model.eval()
    return losses, state, model(data[0][0]).detach()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("sched", ["overlap", "gpipe"])
def test_whole_batch_batchnorm_does_not_depend_on_m_and_equals_the_unsplit_model(runs, m, sched):
    ref_losses, ref_state, ref_out = _reference(batches(STEPS, size=8, seed=3))
    losses, state, out, chunks = runs[("batch", m, sched)]
    assert chunks == 1
    assert_close_f32(losses, ref_losses)
    assert_close_f32(state, ref_state)  # parameters and running statistics
    assert_close_f32(out, ref_out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sched", ["overlap", "gpipe"])
def test_micro_batchnorm_pipelines_with_per_micro_batch_statistics(runs, sched):
    data = batches(STEPS, size=8, seed=3)
    ref_losses, ref_state, _ = _reference(data)
    losses1, state1, _, chunks1 = runs[("micro", 1, sched)]
    losses4, state4, _, chunks4 = runs[("micro", 4, sched)]
    assert (chunks1, chunks4) == (1, 4)
    assert_close_f32(losses1, ref_losses)  # M = 1 is plain BatchNorm
    assert_close_f32(state1, ref_state)
    assert abs(losses4[1] - ref_losses[1]) > 1e-4  # per-micro-batch normalisation really changes training
    assert int(state4["1.num_batches_tracked"]) == 4 * STEPS  # running statistics updated per micro-batch


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sched", ["overlap", "gpipe"])
def test_recompute_gives_the_same_training_and_batchnorm_statistics(runs, sched):
    loss, state = runs[("one step", sched, True)]
    ref_loss, ref_state = runs[("one step", sched, False)]
    assert_close_f32(loss, ref_loss, rtol=0, atol=0)  # the loss comes from the first forward: the same operations
    # Gradients may add up in another order (float rounding); a second running-statistics update
    # would move the running mean and variance by the momentum (10%).
    assert_close_f32(state, ref_state)
    assert int(state["1.num_batches_tracked"]) == int(ref_state["1.num_batches_tracked"]) == 4


def _dropout_runs(job, world_size):
    data = batches(4, size=8, seed=5)
    out = {}
    for recompute in (False, True):
        torch.manual_seed(11)  # the same generator state on every process, for both runs
        for w in ("worker1", "worker2"):
            rpc.rpc_sync(w, stage_state.set_rng_state, args=(stage_state.rng_state(),))
        pipe = rpcmp.Pipeline(dataclasses.replace(job, recompute=recompute), world_size, microbatches=4)
        out[recompute] = ([pipe.train_step(x, y).item() for x, y in data], pipe.state_dict())
        pipe.close()
    return out


@pytest.mark.timeout(300)
def test_recompute_draws_the_same_dropout_masks():
    runs = run_ranks("dropout", 3, _dropout_runs, timeout=240)
    assert runs[True][0] == runs[False][0]
    assert_close_f32(runs[True][1], runs[False][1], rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_bf16_autocast_equals_autocast_on_the_unsplit_model(runs):
    losses, states, _, _ = runs["bf16"]
    job = load("bn")
    ref = {}
    for dtype in (torch.bfloat16, None):
        torch.manual_seed(job.seed)
        model = job.model()
        opt = job.optimizer[0](model.parameters(), **job.optimizer[1])
        ref[dtype] = []
        for x, y in batches(10, size=8, seed=4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                out = model(x)
            loss = job.loss(out.float(), y)
            loss.backward()
            opt.step()
            ref[dtype].append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses, ref[None])) > 1e-4  # bf16 really ran
    assert_close_f32(losses, ref[torch.bfloat16], rtol=2e-3, atol=2e-3)


@pytest.mark.timeout(300)
def test_fp16_overflow_skips_the_step_on_every_stage_and_lowers_the_scale(runs):
    losses, states, scales, overflows = runs["fp16"]
    assert overflows >= 1
    params = [k for k in states[0] if k.endswith(("weight", "bias"))]  # (BatchNorm's running statistics did move)
    assert {k[0] for k in params} == {"0", "1", "3", "4", "6"}  # both stages' parameters
    assert_close_f32({k: states[1][k] for k in params}, {k: states[0][k] for k in params})
    assert scales[0] == 2.0 ** 23 and scales == sorted(scales, reverse=True)
    stepped = [i for i in range(1, len(states)) if not torch.equal(states[i]["0.weight"], states[i - 1]["0.weight"])]
    assert stepped and len(stepped) == len(states) - 1 - overflows  # every finite step updated the parameters
    assert all(not torch.equal(states[i]["6.weight"], states[i - 1]["6.weight"]) for i in stepped)
