"""Which values a traced stage sends on that the next stage takes no gradient of, found before the first step.

A stage that reads one of the tensors it receives only through a comparison, ``detach`` or ``no_grad`` (a gate
made from another value's sign: ``h * (g > 0)``) gives it no gradient; sent with one, its ``RecvRpcBackward`` sends
zeros back, where the unsplit model gives the parameters that made it none: weight decay then moves them. So the
plan runs the traced stages on fake tensors (no memory, no arithmetic), each stage's received tensors made leaves,
and asks autograd which of them its outputs reach; the stage before sends the others detached from the first step
(``StageSpec.detached_values``, or ``detached`` when none is reached). See [Note: an input the backward never
reaches] in rpcmp/owner/reach.py.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ..core.microbatch import map_tensors, tensors
from .traced import routed_stages, stage_flow

__all__ = ["unreached_values"]


def unreached_values(pipe, example: Any) -> dict[int, tuple[tuple[int, ...], int]]:
    """For each stage k whose chain output holds tensors with a gradient that stage k + 1 takes none of:
    ``(their positions among the output's tensors, how many of them have a gradient)``. Nothing for a graph
    fake tensors cannot run (one that reads values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    found: dict[int, tuple[tuple[int, ...], int]] = {}
    stages: list = []

    def call(stage, x):
        k = len(stages)
        stages.append(stage)
        if k == 0:
            return stage(x)
        mail = stage.__dict__["forward"].mail_in
        chain, posted = x if mail else (x, None)
        positions = [i for i, t in enumerate(tensors(chain)) if t.requires_grad]
        chain = map_tensors(chain, lambda t: t.detach().requires_grad_() if t.requires_grad else t)
        leaves = [t for t in tensors(chain) if t.requires_grad]
        out = stage((chain, posted) if mail else chain)
        if positions:
            outs = [t for t in tensors(out) if t.requires_grad]
            grads = torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs],
                                        allow_unused=True) if outs else [None] * len(leaves)
            missed = tuple(p for p, g in zip(positions, grads) if g is None)
            if missed:
                found[k - 1] = (missed, len(positions))
        return out

    try:
        with routed_stages(pipe) as flow, FakeTensorMode(allow_non_fake_inputs=True) as mode:
            for _ in stage_flow(flow, pytree.tree_map(mode.from_tensor, example), call):
                pass
    except Exception:  # noqa: BLE001 - a graph that reads values, or any other: nothing known, as before this check
        return {}
    return found
