"""Split a batch into micro-batches and merge them back.

A batch is a tensor or a nested list / tuple / dict of tensors (the Unet encoder
returns a list of feature maps), walked with ``torch.utils._pytree`` (named tuples and
every structure registered there too). Every tensor is cut along dim 0; anything that is
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
import torch.utils._pytree as pytree

from ..errors import MicroBatchError, StageOutputError

__all__ = ["scatter", "gather", "batch_size", "check_tensors", "to_device", "has_tensors", "tensors", "map_tensors",
           "compact", "received", "unreached"]


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
    if chunks == 1:
        return [batch]
    return [map_tensors(batch, lambda t, i=i: t.tensor_split(chunks)[i]) for i in range(chunks)]


def gather(parts: list[Any]) -> Any:
    """Inverse of :func:`scatter`: concatenate micro-batches along dim 0."""
    if len(parts) == 1:
        return parts[0]
    leaves, spec = pytree.tree_flatten(parts[0])
    columns = zip(leaves, *(pytree.tree_leaves(p) for p in parts[1:]))
    return pytree.tree_unflatten([torch.cat(c) if isinstance(c[0], torch.Tensor) else c[0] for c in columns], spec)


def check_tensors(value: Any, where: str) -> None:
    """Raise a clear error unless ``value`` is a tensor or nested list/tuple/dict of tensors."""
    # None counts as a leaf (pytree would skip it): a stage that forgot to ``return`` is caught here.
    # Per micro-batch, so the key paths are only computed once something is not a tensor.
    if isinstance(value, torch.Tensor) or all(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value, is_leaf=_none)):
        return
    for path, leaf in pytree.tree_flatten_with_path(value, is_leaf=_none)[0]:
        if not isinstance(leaf, torch.Tensor):
            raise StageOutputError(
                f"{where}{pytree.keystr(path)} is a {type(leaf).__name__}; a stage must return a tensor or a nested "
                f"list/tuple/dict of tensors: return tensors only (turn numbers into tensors)"
            )


def _none(x: Any) -> bool:
    return x is None


def tensors(batch: Any):
    """Every tensor of a nested batch, depth first."""
    if isinstance(batch, torch.Tensor):  # the common case, per micro-batch and hop: no tree to walk
        return iter((batch,))
    return (t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor))


def map_tensors(batch: Any, fn):
    """``batch`` with ``fn`` applied to every tensor, structure kept."""
    return pytree.tree_map_only(torch.Tensor, fn, batch)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor of ``batch`` to ``device`` (differentiable)."""
    if all(t.device == device for t in tensors(batch)):  # the common case: nothing to rebuild
        return batch
    return map_tensors(batch, lambda t: t if t.device == device else t.to(device, non_blocking=non_blocking))


def compact(batch: Any) -> Any:
    """``batch`` with every tensor that is a view of a larger storage (a micro-batch cut from its batch)
    copied into storage of its own. TensorPipe sends a tensor's whole storage unless that is at least twice
    the tensor (torch then clones it before sending), so a view of more than half a storage, as the larger
    micro-batch of an odd batch in two, would cross the wire whole: up to twice its bytes. A view of half or
    less costs the same copy either way; a tensor that owns its storage is sent as it is.

    >>> x = torch.arange(10.)
    >>> [compact(part).untyped_storage().nbytes() for part in x.tensor_split(2)], compact(x) is x
    ([20, 20], True)
    """
    return map_tensors(batch, lambda t: t.clone() if t.untyped_storage().nbytes() > t.nbytes else t)


def received(x: Any, kind: str = "") -> list:
    """The distinct autograd nodes the tensors of ``x`` that need a gradient come from, of ``kind`` where given
    (``RecvRpcBackward``: one per message received)."""
    nodes = []
    for t in tensors(x):
        fn = t.grad_fn
        if t.requires_grad and fn is not None and kind in fn.name() and fn not in nodes:
            nodes.append(fn)
    return nodes


def unreached(y: Any, nodes: list) -> list:
    """The ones of ``nodes`` that the backward of ``y``'s tensors does not reach (a walk of the graph)."""
    left = list(nodes)
    seen, todo = set(), [t.grad_fn for t in tensors(y) if t.grad_fn is not None]
    while todo and left:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if fn in left:
            left.remove(fn)
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return left
