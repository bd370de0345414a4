"""An owner's build of a traced stage (``SplitAt``): its graphs, from the master (see [Note: an owner builds the
graphs the master traced] in rpcmp/plan/shipped.py) or traced here, and the unsplit model's values of every tensor
they read, and of no other."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .export import traces
from .graphs import forget_trace, place_graph, run_as_code
from .materialize import (attach_tensor, attribute, build_part, check_materialized, graph_constants, keep_persistence,
                          meta_model, read_constant, set_constant, set_tensor, tensor_names, tensor_table)
from .shipped import unship_stage
from .traced import SplitAt, attach_eval, graph_copy, stage_module, stage_route

__all__ = ["build_traced", "as_cut"]


def build_traced(job, spec, meta: bool = False, device: torch.device | str | None = None) -> nn.Module:
    """Stage ``spec``'s graphs as the master traced them (or, where it could not ship them, traced here on the meta
    device as the master did), then give this stage, and only it, the unsplit model's values: every tensor its
    graphs read (see [Note: every tensor a stage reads])."""
    job = as_cut(job, spec)
    shipped = unship_stage(spec.graphs) if spec.graphs else None
    if shipped is None:
        pipes = traces(job, spec.example, eval_too=not spec.one_graph)
        # copies: the traces stay as they are for the next build
        shipped = stage_route(pipes[0], spec.index), [graph_copy(pipe, spec.index) for pipe in pipes]
    route, modules = shipped
    for module in modules:
        run_as_code(module)  # see [Note: a stage's graphs run as generated code]
        if not meta:  # see [Note: a traced graph names the device it was traced on]
            place_graph(module, torch.device(device or "cpu"))
    stage = stage_module(None, spec.index, modules[0], route)
    evaluated = attach_eval(stage, None, spec.index, modules[1])
    if meta:
        meta_values = tensor_table(meta_model(job)) if spec.unused else {}
        for name in spec.unused:
            attach_tensor(stage, name, meta_values[name])
        return stage
    names = {m: {n for names in tensor_names(m).values() for n in names} for m in (stage, evaluated)}
    constants = {m: graph_constants(m) for m in (stage, evaluated)}
    model = build_part(job, (names[stage] | names[evaluated] | set(spec.unused)).__contains__)
    values = tensor_table(model)
    for module, mine in names.items():  # one set of tensors for both graphs
        for name in mine:
            if name in values:
                set_tensor(module, name, values[name])
            else:  # a constant made from Python values, come with the graphs (see [Note: traced as if on the CPU])
                _made_in_forward(module, name, device or "cpu")
        for name in constants[module]:
            value = read_constant(model, name)
            if value is not None:
                set_constant(module, name, value.to(device or "cpu"))
    for name in spec.unused:  # see [Note: parameters forward does not use]
        attach_tensor(stage, name, values[name])
    keep_persistence(model, (stage, evaluated))
    check_materialized({"train": stage, "eval": evaluated}, f"stage {spec.index} ({spec.name})")
    forget_trace((stage, evaluated))
    return stage


def _made_in_forward(module: nn.Module, name: str, device: torch.device | str) -> None:
    """Buffer ``name`` of ``module``, a tensor the model has no name for, on ``device`` and out of the stage's
    ``state_dict`` (a checkpoint holds the model's names only); left as it is on the meta device, which
    :func:`check_materialized` refuses by name."""
    value = attribute(module, name)
    if value.is_meta:
        return
    set_tensor(module, name, value.to(device))
    owner_name, _, leaf = name.rpartition(".")
    (module.get_submodule(owner_name) if owner_name else module)._non_persistent_buffers_set.add(leaf)


def as_cut(job, spec):
    """``job`` as ``spec`` was planned: after a re-cut, a traced stage is cut at other points than ``job.stages``."""
    if spec.kind != "traced" or not spec.cut or spec.cut == job.stages.points:
        return job
    return replace(job, stages=SplitAt(*spec.cut, lengths=job.stages.lengths))
