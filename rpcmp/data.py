"""The data side of training: datasets from the job, the batch order of every epoch
(fixed by seed and epoch, so a resumed run reads what the interrupted one would have),
and a sample batch for balancing by time."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from .errors import JobError

__all__ = ["datasets", "epoch_batches", "step_groups", "data_loader", "sample_batch", "needs_sample", "first_batch"]


def epoch_batches(n: int, size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: a permutation fixed by (seed, epoch), incomplete batch dropped.

    Fixed so that a resumed run reads exactly the batches the interrupted one would have.
    """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
    return [order[i * size:(i + 1) * size] for i in range(n // size)]


def step_groups(dataset, batches: list, first_step: int, accumulate: int, collate=None):
    """Group an epoch's batches ``accumulate`` at a time (one group per optimizer step),
    from step ``first_step`` on; an incomplete last group is dropped. Returns the lazy
    groups and the number of steps in the whole epoch."""
    steps = len(batches) // accumulate
    usable = batches[first_step * accumulate: steps * accumulate]
    it = iter(data_loader(dataset, batch_sampler=usable, collate_fn=collate))
    return ([next(it) for _ in range(accumulate)] for _ in range(len(usable) // accumulate)), steps


def data_loader(dataset, **kwargs) -> DataLoader:
    """A DataLoader that leaves the global RNG alone: a plain one draws a seed from it for
    every iterator, so a resumed run (one more iterator) would draw other dropout masks."""
    return DataLoader(dataset, generator=torch.Generator(), **kwargs)


def sample_batch(job) -> Any:
    """The first training batch's input (see needs_sample); None when the job has no data."""
    return first_batch(job) if needs_sample(job) else None


def first_batch(job) -> Any:
    """The input of the job's first training batch, or None when the job has no data."""
    if job.data is None:
        return None
    return next(iter(data_loader(datasets(job)[0], batch_size=job.batch_size, collate_fn=job.collate)))[0]


def needs_sample(job) -> bool:
    """Whether planning the stages takes a batch: Split(by="time") profiles layers on it, stages given by name
    are checked against the model's forward on it (rpcmp/plan/chain.py), a SplitAt traces it, and every plan of a
    whole model runs its forward on it on the meta device to find the buffers it writes (rpcmp/plan/writes.py);
    stages given as modules take none."""
    from .plan.partition import declaration_kind
    try:
        return declaration_kind(job.stages) != "modules"
    except Exception:  # noqa: BLE001 - a bad declaration is reported by plan_stages
        return False


def datasets(job):
    """``(train, heldout)`` from ``Job.data``, checked."""
    if job.data is None or job.loss is None:
        raise JobError("training needs Job(data=<callable returning (train, heldout)>, loss=<callable>)")
    got = job.data()
    if not (isinstance(got, tuple) and len(got) == 2):
        raise JobError(f"Job.data() must return (train_dataset, heldout_dataset_or_None), got {type(got).__name__}")
    for role, dataset in zip(("training", "held-out"), got):
        if dataset is not None and (isinstance(dataset, torch.utils.data.IterableDataset) or not (
                hasattr(type(dataset), "__len__") and hasattr(type(dataset), "__getitem__"))):
            raise JobError(
                f"Job.data() returned a {type(dataset).__name__} as its {role} dataset, whose samples are not taken by "
                f"index (an IterableDataset, a generator, a stream): rpcmp needs a map-style dataset (len(ds) and "
                f"ds[i]) to shuffle it per epoch, share it among replicas and go back to a step's samples after a lost "
                f"owner or a resume. Give the samples by index: a list, a TensorDataset, or a Dataset over a "
                f"memory-mapped token file (np.memmap) as nanoGPT reads it")
    return got
