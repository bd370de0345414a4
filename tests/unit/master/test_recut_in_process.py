"""Re-cutting a pipeline in one process (its stages on the master): a SplitAt's points move and the
pipeline trains on as the unsplit model; a cut that does not fit is refused, saying what fits."""
import dataclasses

import pytest
import torch
from torch import nn

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



class _Blocks(nn.Module):
    """Four blocks, the second's and the fourth's first weight one parameter, a head forward never uses and a
    non-persistent buffer every block reads."""

    def __init__(self):
        super().__init__()
        self.inp, self.out, self.unused = nn.Linear(16, 32), nn.Linear(32, 8), nn.Linear(32, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4))
        self.blocks[3][0].weight = self.blocks[1][0].weight
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x) * self.scale + x
        return self.out(x)


def test_a_re_cut_that_joins_and_parts_a_tied_pair_keeps_it_one_parameter(job):
    # SplitAt("blocks.2") -> "blocks.1": the second stage holds both names of the tied weight, under one
    # (a module's parameters are named once); -> "blocks.2" again: each stage takes it by its own name,
    # found under the other. The unused head and the buffer travel too.
    tied = dataclasses.replace(job, model=_Blocks, stages=rpcmp.SplitAt("blocks.2"), optimizer=(torch.optim.Adam, {"lr": 0.01}))
    serve(tied)
    data = batches(5)
    torch.manual_seed(job.seed)
    ref_losses, ref_state = train_reference(tied.model(), tied.optimizer, tied.loss, data)
    pipe = rpcmp.Pipeline(tied, world_size=1)
    losses = []
    for step, (x, y) in enumerate(data):
        if step in (2, 3):
            pipe.recut(["blocks.1"] if step == 2 else ["blocks.2"])
        losses.append(pipe.train_step(x, y).item())
    state = pipe.state_dict()
    assert sorted(state) == sorted(ref_state)
    assert_close_f32(losses, ref_losses)
    assert_close_f32(state, ref_state)
    assert torch.equal(state["blocks.1.0.weight"], state["blocks.3.0.weight"])
    pipe.close()


class _Codes(nn.Module):  # a hard decision: no floating output to carry a gradient back
    def forward(self, x):
        return x.argmax(-1)


@pytest.mark.timeout(60)
def test_a_split_re_cut_after_a_stage_that_outputs_codes_sends_detached_and_trains_as_the_unsplit_model(job):
    """Which stage sends its output detached is the cut's: re-cut so that a stage outputs only ``argmax`` codes,
    the stage before (in this process) sent its output with a gradient none could bring back, and the next step
    waited for one forever. A ``Split`` re-cut runs the model on the meta device again, as its first plan did."""
    codes = lambda: nn.Sequential(nn.Linear(16, 32), _Codes(), nn.Embedding(32, 32), nn.Linear(32, 8))  # noqa: E731
    job = dataclasses.replace(job, model=codes, stages=rpcmp.Split([2, 1, 1]), placement=["master/cpu"] * 3,
                              optimizer=(torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1}))
    serve(job)
    data = batches(4)
    torch.manual_seed(job.seed)
    ref_losses, ref_state = train_reference(job.model(), job.optimizer, job.loss, data)
    pipe = rpcmp.Pipeline(job, world_size=1, microbatches=4, sample=data[0][0])
    losses = []
    for step, (x, y) in enumerate(data):
        if step == 2:
            pipe.recut([1, 1, 2])
            assert [s.detached for s in pipe.specs] == [True, False, False]
        losses.append(pipe.train_step(x, y).item())
    assert_close_f32(losses, ref_losses)
    assert_close_f32(pipe.state_dict(), ref_state)
    pipe.close()
