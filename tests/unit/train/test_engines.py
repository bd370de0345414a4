"""Both engines in one process: the pipeline engine over a Pipeline whose stages live on the master
(the shared one-process RPC world), the DDP engine in a one-process gloo group. Each trains as the
unsplit model, accumulation included; the pipeline engine answers drain requests it cannot carry out
by name; the DDP engine refuses what the CPU cannot do."""
import dataclasses

import pytest
import torch
import torch.distributed as dist

import rpcmp
from helpers import Control, assert_close_f32, batches, train_reference
from rpcmp.core.served import current, serve
from rpcmp.errors import JobError
from rpcmp.train.ddp import DDPEngine
from rpcmp.train.engine import PipelineEngine


@pytest.fixture
def job(world):
    serve(world)
    return world


def _reference(job, data):
    torch.manual_seed(job.seed)
    return train_reference(job.model(), job.optimizer, job.loss, data)


def test_the_pipeline_engine_accumulates_batches_as_one_step_over_their_concatenation(job):
    data = batches(4, size=4)
    whole = [(torch.cat([data[i][0], data[i + 1][0]]), torch.cat([data[i][1], data[i + 1][1]])) for i in (0, 2)]
    ref_losses, ref_state = _reference(job, whole)
    engine = PipelineEngine(rpcmp.Pipeline(dataclasses.replace(job, accumulate=2, batch_size=4), world_size=1),
                            dataclasses.replace(job, accumulate=2, batch_size=4))
    got = [engine.train_step([data[i], data[i + 1]]) for i in (0, 2)]
    assert [n for _, n in got] == [8, 8]
    assert_close_f32([loss for loss, _ in got], ref_losses)
    assert_close_f32(engine.pipe.state_dict(), ref_state)
    assert engine.steps_per_epoch(100) == 100 // 4 // 2
    engine.pipe.close()


def test_drain_requests_it_cannot_carry_out_are_refused_by_name_and_training_goes_on(job):
    engine = PipelineEngine(rpcmp.Pipeline(job, world_size=1), job)
    control = current().control = Control((1, "drain", 0, "a"), (2, "drain", 7, "b"))
    x, y = batches(1)[0]
    engine.train_step([(x, y)])
    note = engine.after_step(1, (0, 1))
    assert control.answers == [(1, False, "master not drained: the master cannot be drained"),
                               (2, False, "worker7 not drained: worker7 is not a process of this job (or has left it)")]
    assert "drain of master refused" in note and "drain of worker7 refused" in note
    assert engine.after_step(2, (0, 2)) is None  # answered once
    engine.train_step([(x, y)])
    engine.pipe.close()


def test_a_rebalance_request_for_stages_that_cannot_move_is_refused(job):
    named = dataclasses.replace(job, stages=[["0", "1", "2"], ["3", "4", "5", "6"]])
    serve(named)  # an owner builds its stage from the job its process serves
    engine = PipelineEngine(rpcmp.Pipeline(named, world_size=1), named)
    control = current().control = Control((1, "rebalance", 0, "a"))
    engine.after_step(1, (0, 1))
    (number, done, said), = control.answers
    assert (number, done) == (1, False) and said.startswith("not re-cut: Job.rebalance re-cuts a Split") and "list" in said
    engine.pipe.close()


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_ddp_engine_of_one_rank_trains_as_the_model_and_keeps_the_checkpoint_format(world, one_rank):
    job = dataclasses.replace(world, mode="ddp")
    data = batches(3)
    ref_losses, ref_state = _reference(job, data)
    torch.manual_seed(job.seed)
    engine = DDPEngine(job)
    got = [engine.train_step([(x, y)]) for x, y in data]
    assert_close_f32([loss for loss, _ in got], ref_losses)
    assert [n for _, n in got] == [job.batch_size] * 3
    state = engine.write_state("unused", 3, 1, "run")
    assert_close_f32(state["model"], ref_state)
    assert set(state["optimizer"]["state"]) <= {n for n, _ in job.model().named_parameters()}
    assert list(engine.state_meta()) == list(ref_state)


@pytest.mark.parametrize("change,says", [
    ({"precision": "fp16"}, "precision='fp16' needs a GPU"),
    ({"sync_batchnorm": True}, "sync_batchnorm=True needs GPUs"),
    ({"batch_size": 7}, None),
])
def test_the_ddp_engine_refuses_what_the_cpu_cannot_do(world, one_rank, change, says):
    job = dataclasses.replace(world, mode="ddp", **change)
    if says is None:  # one rank divides any batch
        assert DDPEngine(job).local_batch == 7
        return
    with pytest.raises(JobError, match=says):
        DDPEngine(job)
