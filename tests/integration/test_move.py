"""Moving a stage to another process while training (``Pipeline.move_stage``): a run with a
move in the middle equals an uninterrupted run, parameters and optimizer state bit for bit on
CPU and the same losses, for a names split, a ``Split`` balance and a ``SplitAt`` traced
split, with SGD momentum and Adam; the old owner lets the stage go."""
import dataclasses
import functools

import pytest
import torch
import torch.distributed.rpc as rpc

import rpcmp
from rpcmp.errors import JobError, PlacementError
from helpers import run_ranks
from rpcmp.core.served import current
from rpcmp.owner import state as stage_state

pytestmark = pytest.mark.integration
OPTIMIZERS = {"sgd-momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
              "adam": (torch.optim.Adam, {"lr": 1e-2})}
STEPS, MOVE_AT = 6, 3


def _same_rng(world_size: int) -> None:
    torch.manual_seed(11)  # every process starts each run with the same generator state
    for r in range(1, world_size):
        rpc.rpc_sync(f"worker{r}", stage_state.set_rng_state, args=(stage_state.rng_state(),))


def _stages_here() -> int:
    return len(current().hosts)


def _data(job):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, 8, 16, generator=g)
    if job.loss is torch.nn.functional.cross_entropy:
        return list(zip(x, torch.randint(0, 8, (STEPS, 8), generator=g)))
    return list(zip(x, torch.randn(STEPS, 8, 8, generator=g)))


def _runs(job, world_size: int, stage_to_move: int):
    spare = f"worker{world_size - 1}"  # holds no stage: the placement fills worker1.. first
    out = {}
    for name, optimizer in OPTIMIZERS.items():
        for move in (False, True):
            _same_rng(world_size)
            pipe = rpcmp.Pipeline(dataclasses.replace(job, optimizer=optimizer), world_size)
            old = pipe.owners[stage_to_move]
            assert spare not in pipe.owners
            losses, took = [], None
            for step, (x, y) in enumerate(_data(job)):
                if move and step == MOVE_AT:
                    took = pipe.move_stage(stage_to_move, f"{spare}/cpu")
                losses.append(pipe.train_step(x, y).item())
            left = rpc.rpc_sync(old, _stages_here) if move else None
            if move:  # a careless call is refused, naming what is wrong, and changes nothing
                for bad_index, bad_target in ((stage_to_move, "worker99"), (len(pipe.specs), spare)):
                    try:
                        pipe.move_stage(bad_index, bad_target)
                    except (PlacementError, JobError) as exc:
                        out.setdefault("refused", []).append(str(exc))
            out[(name, move)] = (losses, pipe.state_dict(), pipe.optimizer_state(), list(pipe.owners), took, left,
                                 pipe.learning_rates())
            pipe.close()
    return out


def _equal(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    else:
        assert a == b


@pytest.mark.timeout(300)
@pytest.mark.parametrize("job,world,k", [("named", 5, 1), ("dropout", 4, 0), ("traced_classifier", 4, 1)],
                         ids=["names-split", "Split-balance", "SplitAt-traced"])
def test_a_run_with_a_move_equals_an_uninterrupted_run(job, world, k):
    runs = run_ranks(job, world, functools.partial(_runs, stage_to_move=k), timeout=240)
    for name in OPTIMIZERS:
        still, moved = runs[(name, False)], runs[(name, True)]
        assert moved[3][k] == f"worker{world - 1}" and still[3][k] != moved[3][k]
        assert moved[5] == 0  # the old owner let the stage go (it held nothing else)
        assert moved[4] > 0
        assert moved[0] == still[0]  # losses
        _equal(moved[1], still[1])  # parameters and buffers
        _equal(moved[2], still[2])  # optimizer state, by name
        assert moved[6][-1] == still[6][-1]
    assert len(runs["refused"]) == 2 * len(OPTIMIZERS)
    assert "'worker99' is not a process of this run" in runs["refused"][0]
    assert "not 3" in runs["refused"][1] or "not 2" in runs["refused"][1]
