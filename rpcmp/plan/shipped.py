"""A traced stage's graphs as bytes, node for node, so that an owner builds the stage the master traced
instead of tracing the whole model again.

[Note: an owner builds the graphs the master traced]
Tracing is most of a traced stage's build: the whole model runs under ``torch.export`` on fake tensors
(a 4-layer Llama: 3-5 s of CPU, and more with every layer) on every owner, for every stage and every
re-cut, while the master has already traced it for the plan. So the plan carries each stage's graphs
(``StageSpec.graphs``) and the owner builds from them. Pickle does not take pipelining's stages (their
``InterpreterModule`` graphs, ``OpOverload`` targets), and fx's own pickling of a ``GraphModule`` keeps its
generated code and traces that code again on load, which would run a plain Python function the graph calls
(``_as_eager`` of rpcmp.plan.export) on the tracer's values instead of recording the call: here every graph is
written as its nodes (op, name, target, arguments) and made again with those nodes, targets by their
qualified names, parameters and constants as the meta tensors they are (no values travel). What tracing
left on the nodes (fake values, shapes) stays behind: a build needs none of it (what the routes need of
it is computed by the master, :func:`rpcmp.plan.traced.stage_route`). A graph that cannot be written (it holds
an object pickle refuses) or read (a class the owner cannot import, an op from a library it has not loaded)
is traced by the owner as before: the same graph, more slowly."""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch

__all__ = ["ship", "unship", "ship_stage", "unship_stage"]


class _Ref:
    """A node named in another node's arguments (a tuple would be taken apart by ``map_aggregate``)."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return _Ref, (self.name,)


def _op(namespace: str, name: str, overload: str):
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _packet(namespace: str, name: str):
    return getattr(getattr(torch.ops, namespace), name)


def _higher_order(name: str):
    return getattr(torch.ops.higher_order, name)


def _graph(nodes: list, codegen) -> torch.fx.Graph:
    graph, made = torch.fx.Graph(), {}
    graph._codegen = codegen

    def node(a):
        return made[a.name] if isinstance(a, _Ref) else a
    for op, name, target, args, kwargs, type_expr in nodes:
        made[name] = graph.create_node(op, target, torch.fx.node.map_aggregate(args, node),
                                       torch.fx.node.map_aggregate(kwargs, node), name=name, type_expr=type_expr)
    return graph


def _graph_module(state: dict, graph: torch.fx.Graph, class_name: str) -> torch.fx.GraphModule:
    from torch.fx.graph_module import _CodeOnlyModule
    module = torch.fx.GraphModule(_CodeOnlyModule(dict(state)), graph, class_name)
    module.__dict__.update(state)  # every attribute as it was, not only those the graph names
    return module


_COMPILED = {"_graph", "_code", "_lineno_map", "_prologue_start", "forward"}  # remade from the graph (a route: by the build)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _op, (obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            namespace, name = obj._qualified_op_name.split("::")
            return _packet, (namespace, name)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, torch.fx.Graph):
            def ref(n):
                return _Ref(n.name)
            return _graph, ([(n.op, n.name, n.target, torch.fx.node.map_arg(n.args, ref),
                              torch.fx.node.map_arg(n.kwargs, ref), n.type) for n in obj.nodes], obj._codegen)
        if isinstance(obj, torch.fx.GraphModule):
            return _graph_module, ({k: v for k, v in obj.__dict__.items() if k not in _COMPILED}, obj.graph,
                                   type(obj).__name__)
        return NotImplemented


def ship(value: Any) -> bytes:
    """``value`` (graph modules among other things) as bytes for :func:`unship`; b"" where it cannot be written
    (see [Note: an owner builds the graphs the master traced])."""
    out = io.BytesIO()
    try:
        _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception:  # noqa: BLE001 - anything pickle refuses: the owner traces instead
        return b""
    return out.getvalue()


def unship(data: bytes) -> Any:
    """What :func:`ship` wrote, made again: new graphs, new modules, each time."""
    return pickle.loads(data)


def ship_stage(pipes: list, index: int) -> bytes:
    """Stage ``index`` of the traced ``pipes`` (train and eval mode; the same pipe twice where both trace alike)
    for an owner to build from (:func:`unship_stage`): its route and graphs; b"" where they cannot be written."""
    from .traced import stage_graph, stage_route
    train, evaluated = pipes
    return ship((stage_route(train, index), stage_graph(train, index),
                 None if evaluated is train else stage_graph(evaluated, index)))


def unship_stage(data: bytes) -> tuple[tuple, list] | None:
    """(route, [train graph module, eval graph module]) of :func:`ship_stage`, new modules each call; None where
    they cannot be read here (the owner traces instead)."""
    try:
        route, train, evaluated = unship(data)
        return route, [train, evaluated if evaluated is not None else unship(data)[1]]
    except Exception:  # noqa: BLE001 - a class this process cannot import, an op it does not have: trace
        return None
