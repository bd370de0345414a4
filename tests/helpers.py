"""Toy models and the one helper every integration test uses to start real processes."""
from __future__ import annotations

import os

import torch
import torch.utils._pytree as pytree
from torch import nn

from rpcmp.job import load_job

from rpcmp.launch.local import launch_local

JOBS = os.path.join(os.path.dirname(__file__), "jobs")


def job_path(name: str) -> str:
    return os.path.join(JOBS, name + ".py")


def load(name: str):
    return load_job(job_path(name))


def run_ranks(job: str, nprocs: int, main, overrides: dict | None = None, timeout: float = 180):
    """Start ``nprocs`` fresh processes (master included) for ``job``; return ``main``'s result.

    Every process is killed if the run outlives ``timeout``: a hang is a failure.
    """
    return launch_local(job_path(job), nprocs, main, overrides=overrides, timeout=timeout, master_in_process=False)


def fit_steps(job, world_size) -> int:
    """A ``run_ranks`` main: the job trained as ``rpcmp run`` trains it; the steps it took."""
    from rpcmp.train.trainer import fit
    return fit(job, world_size)["steps"]


def assert_close_f32(actual, expected, **kwargs) -> None:
    """``torch.testing.assert_close`` for float32 results, with float32 tolerances.

    A float32 loss read with ``.item()`` becomes a Python float, which ``assert_close``
    compares at float64 tolerances (rtol 1e-7): one float32 ulp apart fails, and whether two
    sums round alike depends on the CPU's kernels. Every Python float here (a loss, a norm, a
    metric computed in float32) is compared as a float32 tensor instead. Pass ``rtol=0,
    atol=0`` where equality must be exact (the same operations in the same order).
    """
    def f32(x):
        return torch.tensor(x, dtype=torch.float32) if isinstance(x, float) else x
    torch.testing.assert_close(pytree.tree_map(f32, actual), pytree.tree_map(f32, expected), **kwargs)


def batches(steps: int, size: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 16, generator=g), torch.randn(size, 8, generator=g)) for _ in range(steps)]


def train_reference(model: nn.Module, optimizer: tuple, loss_fn, data) -> tuple[list[float], dict]:
    """The same training in one process with plain PyTorch: the yardstick of transparency."""
    cls, kwargs = optimizer
    opt = cls(model.parameters(), **kwargs)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def metric_steps(path) -> int:
    """How many step records a run's metrics file (``--metrics``) holds so far."""
    import json
    try:
        return sum(1 for line in open(path) if json.loads(line).get("kind") == "step")
    except (OSError, ValueError):  # not written yet, or a line being written
        return 0


class Control:
    """What `rpcmp drain` / `rpcmp rebalance` requests look like to the engine (rpcmp.launch.drain.DrainRequests):
    ``Control((number, "drain", rank, nonce), ...)`` as ``current().control``; the answers are kept."""

    def __init__(self, *requests):
        self.requests, self.answers = list(requests), []

    def pending(self):
        out, self.requests = self.requests, []
        return out

    def answer(self, number, nonce, ok, message):
        self.answers.append((number, ok, message))
