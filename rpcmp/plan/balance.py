"""Automatic balancing of an ``nn.Sequential`` into contiguous stages.

``balance_by_params`` weighs each layer by its parameter count; ``balance_by_time``
by its measured forward + backward time on a sample batch (as torchgpipe's
``balance_by_time``). Both cut the layers so that the heaviest stage is as light
as possible (:func:`partition_costs`, an exact dynamic program).
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn

from ..errors import PartitionError

__all__ = ["partition_costs", "balance_by_params", "balance_by_time"]


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
