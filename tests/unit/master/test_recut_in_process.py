"""Re-cutting a pipeline in one process (its stages on the master): a SplitAt's points move and the
pipeline trains on as the unsplit model; a cut that does not fit is refused, saying what fits."""
import dataclasses

import pytest
import torch

import rpcmp
from helpers import assert_close_f32, batches, train_reference
from rpcmp.core.served import serve
from rpcmp.errors import JobError


@pytest.fixture
def job(world):
    serve(world)
    return world


@pytest.mark.parametrize("optimizer", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 0.01})])
def test_a_traced_split_re_cut_twice_trains_as_the_unsplit_model(job, optimizer):
    traced = dataclasses.replace(job, stages=rpcmp.SplitAt("3"), optimizer=optimizer)
    serve(traced)  # an owner builds its stage from the job its process serves
    data = batches(5)
    torch.manual_seed(job.seed)
    ref_losses, ref_state = train_reference(job.model(), optimizer, job.loss, data)
    pipe = rpcmp.Pipeline(traced, world_size=1)
    losses, names = [], []
    for step, (x, y) in enumerate(data):
        if step in (2, 3):
            assert pipe.recut(rpcmp.SplitAt("5") if step == 2 else ["1"]) > 0
            names.append([s.name for s in pipe.specs])
        losses.append(pipe.train_step(x, y).item())
    assert names == [["input..5", "5..output"], ["input..1", "1..output"]]
    assert_close_f32(losses, ref_losses)
    assert_close_f32(pipe.state_dict(), ref_state)
    assert set(pipe.optimizer_state()) == {n for n, _ in job.model().named_parameters()}
    assert pipe.recut(["1"]) == 0.0  # where it is cut already
    pipe.close()


def test_a_cut_that_does_not_fit_is_refused_saying_what_fits(job):
    traced = dataclasses.replace(job, stages=rpcmp.SplitAt("3"))
    serve(traced)
    pipe = rpcmp.Pipeline(traced, world_size=1)
    with pytest.raises(JobError, match=r"expected 1 split points .*\['3'\] now\), got \[3, 4\]"):
        pipe.recut([3, 4])
    with pytest.raises(JobError, match="expected 1 split points"):
        pipe.recut(rpcmp.SplitAt("2", "5"))
    pipe.close()
    serve(job)
    pipe = rpcmp.Pipeline(job, world_size=1)  # Split([3, 4])
    with pytest.raises(JobError, match=r"expected 2 positive layer counts adding up to 7, got \[3, 3\]"):
        pipe.recut([3, 3])
    pipe.close()


def test_a_re_cut_whose_build_fails_leaves_the_pipeline_as_it_was(job, monkeypatch):
    import rpcmp.owner.stage as owner_stage
    data = batches(3)
    torch.manual_seed(job.seed)
    ref_losses, ref_state = train_reference(job.model(), job.optimizer, job.loss, data)
    pipe = rpcmp.Pipeline(job, world_size=1)  # Split([3, 4])
    losses = [pipe.train_step(*data[0]).item()]

    def fails(*args, **kwargs):
        raise MemoryError("no room for the new part")
    monkeypatch.setattr(owner_stage, "build_empty", fails)
    with pytest.raises(rpcmp.errors.StageError, match="no room for the new part"):
        pipe.recut([4, 3])
    monkeypatch.undo()
    assert [s.name for s in pipe.specs] == ["layers[0:3]", "layers[3:7]"]
    losses += [pipe.train_step(x, y).item() for x, y in data[1:]]
    assert_close_f32(losses, ref_losses)
    assert_close_f32(pipe.state_dict(), ref_state)
    pipe.close()

