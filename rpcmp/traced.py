"""Split points on the traced model: ``stages=rpcmp.SplitAt("layer2", "layer4")``.

[Note: split points on the traced model]
Most models are not a chain of their children: ``forward`` holds functional ops,
``flatten``, residual adds and skip connections. ``SplitAt`` cuts the model's *traced
graph* instead, with the front end of ``torch.distributed.pipelining``: ``pipeline()``
traces ``forward`` with ``torch.export`` on one micro-batch and cuts the graph before
each named submodule (or at ``pipe_split()`` markers in ``forward`` when no name is
given). Each stage is the graph between two cuts, so every operation of ``forward`` is
in exactly one stage; a value a later stage needs (a Unet's skip features, a residual
stream) is handed along; parameters and buffers keep the unsplit model's names, so
``state_dict()`` and every checkpoint load into the plain model with ``strict=True``.
rpcmp's own runtime runs the stages (not pipelining's schedules): each owner builds the
model under the job's seed, traces it the same way and keeps its own stage. The traced
stages run for any micro-batch size (measured: traced at 4 samples, run at 6, equal to
the unsplit model). Tracing needs a batch: the job's data, or ``Pipeline(sample=...)``.
What ``torch.export`` cannot trace (data-dependent control flow) is refused with its
message and the way out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .errors import PartitionError

__all__ = ["SplitAt", "trace_split", "stage_module", "example_of", "from_example"]


@dataclass(frozen=True)
class SplitAt:
    """Cut the traced model before each named submodule (qualified names: ``"encoder.layer3"``);
    with no names, at the ``torch.distributed.pipelining.pipe_split()`` calls in ``forward``."""

    points: tuple[str, ...] = ()

    def __init__(self, *points: str):
        bad = [p for p in points if not isinstance(p, str) or not p]
        if bad:
            raise PartitionError(f"SplitAt takes submodule names, e.g. SplitAt('layer2', 'layer4'), got {bad!r}")
        object.__setattr__(self, "points", tuple(points))

    @property
    def count(self) -> int:
        """Stages the named cuts give (with ``pipe_split()`` markers instead: known once traced)."""
        return len(self.points) + 1


def example_of(batch: Any) -> tuple:
    """A picklable description (shapes and dtypes) of one micro-batch, to trace with on an owner."""
    leaves, spec = pytree.tree_flatten(batch)
    return [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in leaves], spec


def from_example(example: tuple) -> Any:
    leaves, spec = example
    return pytree.tree_unflatten([torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in leaves], spec)


def trace_split(model: nn.Module, split: SplitAt, sample: Any):
    """``torch.distributed.pipelining``'s ``Pipe`` of ``model`` cut at ``split``, traced on ``sample``."""
    from torch.distributed.pipelining import SplitPoint, pipeline
    names = {n for n, _ in model.named_modules() if n}
    missing = [p for p in split.points if p not in names]
    if missing:
        tops = [n for n, _ in model.named_children()]
        raise PartitionError(f"SplitAt: {type(model).__name__} has no submodule {missing}; its children, in order: {tops} "
                             f"(deeper ones by qualified name, e.g. '{tops[0]}.<child>')" if tops else "")
    spec = {p: SplitPoint.BEGINNING for p in split.points} or None
    try:
        return pipeline(model, mb_args=(sample,), split_spec=spec)
    except Exception as exc:  # noqa: BLE001 - any tracing failure means the same to the user
        raise PartitionError(
            f"SplitAt{split.points}: tracing {type(model).__name__}.forward with torch.export failed: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. Data-dependent control flow "
            f"(an `if` on a tensor's values) cannot be traced: use torch.cond, move it into one stage's module and "
            f"declare the stages as modules, or cut an nn.Sequential with rpcmp.Split") from None


class _Spread:
    """Calls a traced stage with the previous stage's outputs as positional arguments."""

    def __init__(self, forward):
        self.forward = forward

    def __call__(self, x):
        return self.forward(*x) if isinstance(x, tuple) else self.forward(x)


def stage_module(pipe, index: int) -> nn.Module:
    """Stage ``index`` of the traced ``pipe``, callable with one argument as every rpcmp stage is."""
    module = pipe.get_stage_module(index)
    if index > 0:  # a stage after the first takes what the one before returned, spread over its inputs
        module.forward = _Spread(module.forward)
    return module
