"""A module that ``forward`` calls more than once (ALBERT's one shared layer, a universal transformer's
block, a weight-shared recurrence), outlined once per stage instead of once per call.

[Note: a module forward calls more than once]
``torch.distributed.pipelining`` rebuilds each stage's module tree from its graph and gives every call of
a module but the first a copy of its own, named ``layer@1``, ``layer@2``, ...: the same parameters under
new names (an ALBERT of 4 layers, whose ``albert_layers.0`` forward calls 4 times, held each of its
tensors under 4 names). The stage then holds names the unsplit model does not have, so a ``SplitAt`` of
such a model was refused ("the traced stages hold tensors Model has no name for ... LayerNorm@1.bias").
``torch.export.unflatten`` has the step pipelining leaves out: calls whose graphs are the same become
calls of one module (``_deduplicate_modules``). rpcmp outlines each stage as pipelining does, then takes
that step; a module called across a cut is outlined under its own name in each stage, a parameter shared
by two stages (trained as one, like a tied embedding). Calls that trace to different graphs keep their
copies and the plan refuses them, naming the module (:func:`rpcmp.plan.strange.refuse_strange`)."""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

__all__ = ["outlined_once", "repeated_call"]


def _outline_once(orig_graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """pipelining's ``_outline_submodules``, then ``torch.export.unflatten``'s merge of equal calls."""
    from torch.export.unflatten import _deduplicate_modules, _ModuleFrame
    _count_calls_from_here(orig_graph)
    module = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    calls: dict = defaultdict(list)
    _ModuleFrame(orig_graph, tuple(orig_graph.nodes), {}, calls, defaultdict(set), {}, None, [("", None, 0)], "", {},
                 module=module).run_outer()
    _deduplicate_modules(calls.values())
    for sub in module.modules():  # call targets changed in the graphs of the callers
        if isinstance(sub, torch.fx.GraphModule):
            sub.recompile()
    module.graph.lint()
    return module


def _count_calls_from_here(graph: torch.fx.Graph) -> None:
    """Number each module's calls from this stage's first one (export counts them over the whole model, and a
    stage after a cut between two calls named its first call's copy ``block@2``)."""
    local: dict[str, dict[str, str]] = defaultdict(dict)
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack or node.op in ("placeholder", "output"):  # an input's is where the stage before made it
            continue
        keys = {}
        for key in stack:
            base = key.rpartition("@")[0] if "@" in key else key
            calls = local[base]
            keys[key] = calls.setdefault(key, f"{base}@{len(calls)}" if calls else base)
        node.meta = {**node.meta, "nn_module_stack": {keys[k]: v for k, v in stack.items()}}


@contextlib.contextmanager
def outlined_once():
    """While pipelining splits a model: each stage's modules outlined once, not once per call."""
    import torch.distributed.pipelining._IR as ir
    plain, ir._outline_submodules = ir._outline_submodules, _outline_once
    try:
        yield
    finally:
        ir._outline_submodules = plain


def repeated_call(name: str) -> str | None:
    """The module whose second or later call left ``name`` (``"h.0@2.weight"`` -> ``"h.0"``), or None."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if "@" in part and part.rpartition("@")[2].isdigit():
            return ".".join(parts[:i] + [part.rpartition("@")[0]])
    return None
