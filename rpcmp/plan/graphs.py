"""The fx graphs inside a traced stage: the devices they name, rewritten for the owner, and what
tracing left on their nodes."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["place_graph", "graph_devices", "graphs", "forget_trace", "run_as_code", "unshadow", "each_once", "meta_of"]


def place_graph(stage: nn.Module, device: torch.device, of: str = "meta") -> None:
    """Make a stage traced on the meta device (``pipe.get_stage_module(i)``) create its tensors on ``device``.

    [Note: a traced graph names the device it was traced on]
    ``torch.export`` records the device of every tensor ``forward`` creates: ``torch.arange(t,
    device=idx.device)`` (positions), a causal mask, ``.to(x.device)``, and the device checks export
    inserts (``_assert_tensor_metadata``). Traced on the meta device, the graph says ``meta`` there,
    and on an owner such a tensor is made on the meta device: an op between it and a real tensor
    either fails ("Tensor device mismatch") or, for some kernels, reads memory that holds nothing
    (a nanoGPT-style decoder's positional embedding gave NaN). Every ``meta`` in the graph's
    arguments is rewritten to the owner's device before the stage runs, and
    :func:`rpcmp.plan.materialize.check_materialized` refuses a stage whose graph still names ``meta``.
    Must run before :func:`rpcmp.plan.traced.stage_module` / ``attach_eval``, which capture ``forward``.
    ``of``: the device type replaced (the trace itself makes ``meta`` of the ``cpu`` it traced on: see
    [Note: traced as if on the CPU] in rpcmp/plan/export.py)."""
    hits = []

    def swap(a):
        if isinstance(a, torch.device) and a.type == of:
            hits.append(a)
            return device
        return a
    for _, module, graph in graphs(stage):
        hits.clear()
        for node in graph.nodes:
            before = len(hits)
            args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), swap)
            if len(hits) > before:
                node.args, node.kwargs = args, kwargs
        if hits:
            _regenerate(module)


def run_as_code(module: nn.Module) -> None:
    """[Note: a stage's graphs run as generated code]
    pipelining's stage holds its model's module structure as ``InterpreterModule`` s, each of which runs its graph
    node by node through ``torch.fx.Interpreter`` (Python for every op, every step) unless told otherwise; told,
    it runs the code fx generated from the same graph, the same ops in the same order (what torch itself does
    under ``torch.compile``). Forward and backward of the three stages of tests/jobs/hf_llama.py on one batch,
    in one process: 21.4 ms through the interpreter, 9.6-9.9 ms as code; the traced Unet 155-168 ms and
    139-141 ms. What is lost: an error inside a stage no longer names the graph node it happened at."""
    from torch.export.unflatten import InterpreterModule
    for m in module.modules():
        if isinstance(m, InterpreterModule):
            m._run_with_interpreter = False


def unshadow(module: nn.Module) -> None:
    """[Note: a node named self]
    The call of a submodule named ``self`` (BERT's ``attention.self``, or a model's own child so named) is a graph
    node named ``self``, a variable of that name in the code fx generates, where it takes the place of the module
    the code runs on: ``self = self.self(x); output = self.output(self)`` failed on a tensor (BERT's stages on
    their first micro-batch, once they ran as code; a top-level child so named failed the plan's first run). Each
    such node of ``module``'s graphs is renamed, and the code made again."""
    for _, m, graph in graphs(module):
        named = [n for n in graph.nodes if n.name == "self" and n.op != "placeholder"]
        for node in named:
            node._rename("self_")
        if named:
            _regenerate(m)


def _regenerate(module: nn.Module) -> None:
    """The code of ``module``'s graph made again after the graph changed (a graph module's, or pipelining's)."""
    module.recompile() if isinstance(module, torch.fx.GraphModule) else module.finalize()


def graph_devices(module: nn.Module) -> dict[str, str]:
    """Nodes of ``module``'s graphs (and its submodules') whose arguments name a device: name -> device."""
    found = {}
    for prefix, _, graph in graphs(module):
        for node in graph.nodes:
            torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a, n=node, p=prefix: found.__setitem__(
                f"{p + '.' if p else ''}{n.name}", str(a)) if isinstance(a, torch.device) else None)
    return found


def graphs(module: nn.Module):
    """(qualified name, submodule, fx graph) of ``module`` and each submodule that runs a graph."""
    for prefix, m in module.named_modules():
        graph = getattr(m, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            yield prefix, m, graph


def forget_trace(modules) -> None:
    """Drop what tracing left on the graphs' nodes (fake tensors, symbolic sizes, their shape environment):
    a built stage runs without it, and an owner that builds many stages keeps none of it alive."""
    for top in modules:
        for _, _, graph in graphs(top):
            for node in graph.nodes:
                node.meta.clear()


def described(spec, exc: BaseException) -> str:
    """``Type: message`` of a stage's failure; after its first line, for one that may come from how the stage was
    traced, why: a ``forward`` that picks its path by device type (``x.device.type == "cpu"``) recorded the path
    for the CPU (see [Note: traced as if on the CPU] in rpcmp/plan/export.py), which can call a kernel another
    device lacks."""
    first, _, rest = str(exc).partition("\n")
    if getattr(spec, "kind", None) == "traced" and isinstance(exc, NotImplementedError):
        first += (". The stage's graph was traced as on the CPU (fake tensors, no memory): a forward that chooses "
                  "its path by the tensors' device type took the CPU's path, and an op on it may have no kernel on "
                  "this device. Make that choice another way, or cut the model by modules (rpcmp.Split)")
    return f"{type(exc).__name__}: {first}" + (f"\n{rest}" if rest else "")


def each_once(make):
    """``make`` of each tensor, once (tied tensors stay one); of a parameter, a parameter."""
    made: dict[int, torch.Tensor] = {}

    def convert(t):
        if id(t) not in made:
            new = make(t)
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]
    return convert


def meta_of(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s shape, strides and dtype."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
