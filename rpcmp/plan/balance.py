"""Automatic balancing of an ``nn.Sequential`` into contiguous stages.

``balance_by_params`` weighs each layer by its parameter count; ``balance_by_time``
by its measured forward + backward time on a sample batch (as torchgpipe's
``balance_by_time``). Both cut the layers so that the heaviest stage is as light
as possible (:func:`partition_costs`, an exact dynamic program). :class:`Units` is what a
re-cut while training moves: the layers of a ``Split``, or the blocks a ``SplitAt`` cuts between.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import PartitionError

__all__ = ["partition_costs", "balance_by_params", "balance_by_time", "Units", "units_of"]


def partition_costs(costs: Sequence[float], parts: int) -> list[int]:
    """Cut ``costs`` into ``parts`` non-empty contiguous runs minimising the largest sum.

    >>> partition_costs([1, 1, 1, 1, 4], 2)
    [4, 1]
    """
    n = len(costs)
    if not 1 <= parts <= n:
        raise PartitionError(f"cannot cut {n} layers into {parts} stages: expected 1 <= stages <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest possible max-stage cost for the first i layers in k stages
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def balance_by_params(model: nn.Sequential, parts: int) -> list[int]:
    """Balance by parameter count (layers without parameters weigh 1)."""
    costs = [max(1, sum(p.numel() for p in layer.parameters())) for layer in model]
    return partition_costs(costs, parts)


def balance_by_time(model: nn.Sequential, parts: int, sample: torch.Tensor, repeats: int = 3) -> list[int]:
    """Balance by the median forward + backward time of each layer on ``sample``."""
    times = [[] for _ in model]
    for _ in range(repeats):
        x = sample.detach().requires_grad_(sample.is_floating_point())
        for i, layer in enumerate(model):
            start = time.perf_counter()
            y = layer(x)
            if y.requires_grad:
                y.backward(torch.ones_like(y), retain_graph=False)
            times[i].append(time.perf_counter() - start)
            x = y.detach().requires_grad_(y.is_floating_point())
    model.zero_grad(set_to_none=True)
    costs = [sorted(t)[len(t) // 2] for t in times]
    return partition_costs(costs, parts)


@dataclass(frozen=True)
class Units:
    """What a re-cut moves between stages, in order, each with a weight (how a stage's measured time is
    spread over its units): the layers of a ``Split`` (weight: parameters), or the children of the module
    whose children a ``SplitAt`` cuts before (``names``: a transformer's blocks, ``"h.0"``, ``"h.1"``, ...;
    weight: the parameters its matrix products use, the first and last block carrying what comes before
    and after them, embeddings, a lookup, weighing nothing)."""

    weights: tuple[float, ...]
    names: tuple[str, ...] = ()  # a SplitAt's: the point each unit starts at

    def balance(self, specs) -> tuple[int, ...]:
        """How many units each stage of ``specs`` holds now."""
        if not self.names:
            return tuple(s.stop - s.start for s in specs)
        at = [0, *(self.names.index(p) for p in specs[0].cut), len(self.names)]
        return tuple(b - a for a, b in zip(at, at[1:]))

    def cut(self, balance: Sequence[int]) -> Any:
        """``balance`` as ``recut`` takes it: layer counts for a ``Split``, the points for a ``SplitAt``."""
        if not self.names:
            return list(balance)
        ends = [sum(balance[:k + 1]) for k in range(len(balance) - 1)]
        return tuple(self.names[e] for e in ends)


def units_of(model: nn.Module, points: Sequence[str] | None) -> Units:
    """The :class:`Units` of ``model`` cut as a ``Split`` (``points`` None: ``model`` is the ``nn.Sequential``)
    or at the ``SplitAt`` ``points``, which must all be children of one module (blocks of one list)."""
    if points is None:
        return Units(tuple(max(1, sum(p.numel() for p in layer.parameters())) for layer in model))
    parents = sorted({p.rpartition(".")[0] for p in points})
    if not points or len(parents) != 1:
        why = f"these points are children of {parents}" if points else "pipe_split() markers cannot be moved"
        raise PartitionError(f"re-cutting a SplitAt moves its points among the children of one module (the blocks of "
                             f"a transformer: SplitAt('h.2', 'h.4')); {why}: name points of one module, or drop "
                             f"rebalance")
    parent = parents[0]
    names = tuple(f"{parent}.{n}" if parent else n for n, _ in model.get_submodule(parent).named_children())
    if any(p not in names[1:] for p in points):
        raise PartitionError(f"re-cutting a SplitAt moves its points among the children of {parent or 'the model'} "
                             f"after the first ({list(names[1:4])}...); got {list(points)}")
    order = [n for n, _ in model.named_modules()]
    at = order.index(parent)
    weights = [_matmuls(model.get_submodule(n)) for n in names]
    for i, name in enumerate(order):  # what runs before the blocks goes with the first, what runs after with the last
        if parent and name != parent and not name.startswith(f"{parent}."):
            weights[0 if i < at else -1] += _matmuls(model.get_submodule(name), recurse=False)
    return Units(tuple(max(1.0, w) for w in weights), names)


def _matmuls(module: nn.Module, recurse: bool = True) -> float:
    """The parameters ``module``'s products use (an embedding's table is a lookup; a tied head counts)."""
    return float(sum(p.numel() for m in (module.modules() if recurse else [module])
                     if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)))
