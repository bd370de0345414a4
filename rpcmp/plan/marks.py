"""One export of a model for every cut among the children of one module: the markers pipelining splits at,
placed at every child, and each cut keeping its own.

[Note: one export for every cut among siblings]
``torch.distributed.pipelining`` cuts a model where its ``pipe_split`` markers are: it wraps the forward of
each split point so that it calls the marker first, exports the model with ``torch.export``, and splits the
graph at the marker nodes. The export is seconds (3 s of a 4-block GPT-2's 10 s live re-cut on two cores, for
each of the train and eval graphs) and depends on the points only through the markers, which are nodes with
no inputs and no outputs: the graph between them is the same wherever they are. A re-cut moves the points
among the children of one module (the blocks of a transformer: :func:`rpcmp.plan.balance.units_of`), so
where every point is such a child (after the first), the export marks every child after the first, is
kept (:func:`exported`: per model factory, seed, micro-batch, mode, and whether the batch is dynamic), and
each cut drops the markers of the children it does not cut at before pipelining splits
(:func:`keep_only`). A re-cut, the owner of a plan that cannot carry its graphs, or a second cut of the same
model in one process exports nothing again. Points of different modules are marked alone and the export kept
for that cut only. A marker a trace cannot place in a module (no ``nn_module_stack``) cannot be told from the
others: that export is made again with the points alone. An export that failed with a dynamic batch is kept
as its error, so the fallback to a fixed batch (:mod:`rpcmp.plan.export`) does not try it again. The kept
program's parameters, buffers and constants are meta tensors, as everything a trace leaves (fake ones, which
hold no memory either, counted as the master's parameters on the CPU: tests/integration/test_owner_parts.py).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["marks_for", "unmark", "exported", "marked_module", "keep_only", "Unplaced"]

_EXPORTS: OrderedDict = OrderedDict()  # (key, marks, dynamic) -> (model factory, export or its error, out spec)
_LOCK = threading.Lock()
KEEP = 8  # exports kept: a train and an eval graph for a few models


class Unplaced(Exception):
    """A marker of an export marked at every child that names no module: mark the points alone."""


def marks_for(model: nn.Module, points: tuple[str, ...]) -> tuple[str, ...]:
    """Where to mark ``model`` for a cut at ``points``: every child after the first of the one module whose
    children the points are, or the points themselves."""
    parents = {p.rpartition(".")[0] for p in points}
    if len(parents) != 1:
        return tuple(points)
    parent = parents.pop()
    children = [f"{parent}.{n}" if parent else n for n, _ in model.get_submodule(parent).named_children()][1:]
    return tuple(children) if set(points) <= set(children) else tuple(points)


def unmark(model: nn.Module, marks: tuple[str, ...]) -> None:
    """Undo pipelining's ``annotate_split_points``, which leaves the marked modules' forward wrapped."""
    for point in marks:
        for attr in ("forward", "_orig_forward"):
            model.get_submodule(point).__dict__.pop(attr, None)


def marked_module(node: torch.fx.Node) -> str | None:
    """The module whose forward called the marker ``node`` (the innermost of its ``nn_module_stack``), or None."""
    return (list(node.meta.get("nn_module_stack", {}).values()) or [(None,)])[-1][0]


def _markers(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and "_pipe_split" in str(n.target)]


def exported(key: tuple | None, marks: tuple[str, ...], dynamic: bool, export: Callable[[], Any],
             whole: bool) -> tuple[Any, Any]:
    """``export()``'s program and its output spec, kept under ``key`` (None: not kept); its error, raised again
    where it failed before. ``whole``: ``marks`` are every child of a module, each cut keeps its own (a marker
    that names no module then raises :class:`Unplaced`)."""
    full = None if key is None else (key[1:], marks, dynamic)
    with _LOCK:
        entry = _EXPORTS.get(full) if full else None
    if entry is not None and entry[0] is key[0]:  # the same factory: one replaced in place is exported again
        if isinstance(entry[1], BaseException):
            raise entry[1]
        return entry[1], entry[2]
    try:
        ep = export()
    except Exception as exc:
        _keep(full, (key[0] if key else None, exc, None))
        raise
    if whole and any(marked_module(n) is None for n in _markers(ep.graph_module)):
        _keep(full, (key[0] if key else None, Unplaced(), None))  # the next cut goes straight to its points alone
        raise Unplaced()
    _keep(full, (key[0] if key else None, ep, ep.call_spec.out_spec))
    return ep, ep.call_spec.out_spec


def _keep(full, entry) -> None:
    if full is None:
        return
    with _LOCK:
        _EXPORTS[full] = entry
        while len(_EXPORTS) > KEEP:
            _EXPORTS.popitem(last=False)


def keep_only(points: tuple[str, ...], reached: list, whole: bool) -> Callable[[torch.fx.GraphModule],
                                                                                torch.fx.GraphModule]:
    """pipelining's ``split_policy``: with ``whole``, drop the markers of the modules the cut does not cut at from
    the unlifted copy of the export that pipelining splits (in each of its graphs: a marker inside a higher-order
    op's graph too); append to ``reached`` the module of each marker it splits at, in the graph's order."""
    wanted = set(points)

    def policy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for sub in gm.modules():
            if not isinstance(sub, torch.fx.GraphModule):
                continue
            dropped = [sub.graph.erase_node(n) for n in _markers(sub) if whole and marked_module(n) not in wanted]
            if sub is gm:
                reached.extend(marked_module(n) for n in _markers(sub))
            if dropped:
                sub.recompile()
        return gm
    return policy
