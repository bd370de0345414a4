"""Split a batch into micro-batches and merge them back.

A batch is a tensor or a nested list / tuple / dict of tensors (the Unet encoder
returns a list of feature maps). Every tensor is cut along dim 0; anything that is
not a tensor is copied unchanged into each micro-batch.

>>> import torch
>>> parts = scatter({"x": torch.arange(5), "k": 3}, 2)
>>> [p["x"].tolist() for p in parts], parts[1]["k"]
([[0, 1, 2], [3, 4]], 3)
>>> gather(parts)["x"].tolist()
[0, 1, 2, 3, 4]
"""
from __future__ import annotations

from typing import Any

import torch

from .errors import MicroBatchError, StageOutputError

__all__ = ["scatter", "gather", "batch_size", "check_tensors", "to_device", "has_tensors", "tensors", "map_tensors"]


def batch_size(batch: Any) -> int:
    """The size of dim 0 shared by every tensor of ``batch``."""
    sizes = {t.shape[0] for t in tensors(batch)}
    if not sizes:
        raise MicroBatchError(f"expected a batch holding at least one tensor, got {type(batch).__name__}")
    if len(sizes) > 1:
        raise MicroBatchError(f"expected every tensor of a batch to share dim 0, got sizes {sorted(sizes)}")
    return sizes.pop()


def has_tensors(batch: Any) -> bool:
    return next(tensors(batch), None) is not None


def scatter(batch: Any, chunks: int) -> list[Any]:
    """Cut ``batch`` into ``chunks`` micro-batches whose sizes differ by at most one."""
    if chunks < 1:
        raise MicroBatchError(f"expected microbatches >= 1, got {chunks}")
    n = batch_size(batch)
    if n < chunks:
        raise MicroBatchError(
            f"a batch of {n} samples cannot be split into {chunks} micro-batches: "
            f"set microbatches <= {n} or use a batch of at least {chunks} samples"
        )
    return [map_tensors(batch, lambda t, i=i: t.tensor_split(chunks)[i]) for i in range(chunks)]


def gather(parts: list[Any]) -> Any:
    """Inverse of :func:`scatter`: concatenate micro-batches along dim 0."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return first if len(parts) == 1 else torch.cat(parts)
    if isinstance(first, (list, tuple)):
        merged = [gather([p[i] for p in parts]) for i in range(len(first))]
        return type(first)(merged) if not hasattr(first, "_fields") else type(first)(*merged)
    if isinstance(first, dict):
        return {k: gather([p[k] for p in parts]) for k in first}
    return first


def check_tensors(value: Any, where: str) -> None:
    """Raise a clear error unless ``value`` is a tensor or nested list/tuple/dict of tensors."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_tensors(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            check_tensors(v, f"{where}[{k!r}]")
        return
    raise StageOutputError(
        f"{where} is a {type(value).__name__}; a stage must return a tensor or a nested "
        f"list/tuple/dict of tensors: return tensors only (turn numbers into tensors)"
    )


def tensors(batch: Any):
    """Every tensor of a nested batch, depth first."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from tensors(v)
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from tensors(v)


def map_tensors(batch: Any, fn):
    """``batch`` with ``fn`` applied to every tensor, structure kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        mapped = [map_tensors(v, fn) for v in batch]
        return type(batch)(*mapped) if hasattr(batch, "_fields") else type(batch)(mapped)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor of ``batch`` to ``device`` (differentiable)."""
    return map_tensors(batch, lambda t: t if t.device == device else t.to(device, non_blocking=non_blocking))
