"""Which values a traced stage sends on that a later stage takes no gradient of, found before the first step.

A stage that reads one of the tensors it receives only through a comparison, ``detach`` or ``no_grad`` (a gate
made from another value's sign: ``h * (g > 0)``) gives it no gradient; sent with one, its ``RecvRpcBackward`` sends
zeros back, where the unsplit model gives the parameters that made it none: weight decay then moves them. So the
plan runs the traced stages on fake tensors (no memory, no arithmetic), each stage's received tensors made leaves
(what the stage before sent and what stages further back posted to it), and asks autograd which of them its
outputs reach; the sender sends the others detached from the first step (``StageSpec.detached_values``, or
``detached`` when none of its chain output is reached; ``StageSpec.detached_posts``). See [Note: an input the
backward never reaches] in rpcmp/owner/reach.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..core.microbatch import map_tensors, tensors
from .traced import routed_stages, stage_flow

__all__ = ["Unreached", "unreached_values"]


@dataclass
class Unreached:
    # stage k -> (the positions among its chain output's tensors that stage k + 1 takes no gradient of, how many of
    # them have a gradient)
    values: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    # stage k -> the values it posts that their reader takes no gradient of: (reader, name)
    posts: dict[int, tuple[tuple[int, str], ...]] = field(default_factory=dict)


def _leaves(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """``value`` with each tensor that has a gradient made a leaf, and those leaves in ``tensors()`` order."""
    value = map_tensors(value, lambda t: t.detach().requires_grad_() if t.requires_grad else t)
    return value, [t for t in tensors(value) if t.requires_grad]


def unreached_values(pipe, example: Any) -> Unreached:
    """What each stage sends that the stage reading it takes no gradient of. Nothing for a graph fake tensors
    cannot run (one that reads values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    found, senders, stages = Unreached(), {}, []

    def call(stage, x):
        k = len(stages)
        stages.append(stage)
        if k == 0:
            return _posting(k, stage(x))
        mail = stage.__dict__["forward"].mail_in
        chain, posted = x if mail else (x, {})
        positions = [i for i, t in enumerate(tensors(chain)) if t.requires_grad]
        chain, leaves = _leaves(chain)
        named = {}
        for name, value in posted.items():
            posted[name], named[name] = _leaves(value)
        out = stage((chain, posted) if mail else chain)
        inputs = leaves + [t for ts in named.values() for t in ts]
        outs = [t for t in tensors(out) if t.requires_grad]
        grads = iter(torch.autograd.grad(outs, inputs, [torch.ones_like(t) for t in outs], allow_unused=True)
                     if outs and inputs else [None] * len(inputs))
        missed = tuple(p for p, g in zip(positions, grads) if g is None)
        if missed:
            found.values[k - 1] = (missed, len(positions))
        for name, ts in named.items():
            if ts and all(g is None for g in [next(grads) for _ in ts]):
                sender = senders[(k, name)]
                found.posts[sender] = (*found.posts.get(sender, ()), (k, name))
        return _posting(k, out)

    def _posting(k, out):
        if stages[k].__dict__["forward"].posts:
            for j, values in out[1].items():
                senders.update({(j, name): k for name in values})
        return out

    try:
        with routed_stages(pipe) as flow, FakeTensorMode(allow_non_fake_inputs=True) as mode:
            for _ in stage_flow(flow, pytree.tree_map(mode.from_tensor, example), call):
                pass
    except Exception:  # noqa: BLE001 - a graph that reads values, or any other: nothing known, as before this check
        return Unreached()
    return found
