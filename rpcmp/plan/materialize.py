"""Building a part of a model without building the whole of it.

[Note: each owner materializes only its part]
The reason to split a model is that it does not fit in one process, so no process may
build it whole: not the master, which plans on the meta device (:func:`meta_model`: the
structure, names and shapes, no storage), and not an owner, which allocates only the
parameters and buffers of its stage (:func:`build_part`).

An owner's values must still be those of the unsplit ``Job.model()`` built under the
job's seed, and the model's construction draws every tensor's initial values from one
global random stream, in construction order: stage 2's weights depend on how many
numbers stages 0 and 1 drew. ``build_part`` therefore runs the construction twice:

1. on the meta device, recording the order in which parameters and buffers are
   registered and the names they end up with (cheap: no storage, no random numbers);
2. for real under the job's seed, with a registration hook that lets a tensor of the
   stage through and swaps every other one for a view of one shared scratch buffer as
   big as the largest of them. The construction code then initializes the scratch in
   place with the same calls on tensors of the same sizes, so it draws exactly the same
   random numbers, and the stage's tensors get exactly their unsplit values; afterwards
   the scratch tensors are replaced by meta tensors. A tensor of the stage made of scratch
   (a parametrization's ``original``, which is the very tensor it replaced: ``weight_norm``)
   gets memory of its own as it is registered, before the construction writes over it.

Peak memory is the stage's tensors plus the largest other one. Exact for every model
whose initialization writes a tensor in place after it is registered, or computes it
before (``nn.Parameter(torch.randn(n) * 0.02)``), i.e. torch.nn, torchvision, timm and
segmentation_models_pytorch. Not exact, and documented as such: an initialization of a
kept tensor that reads the values of a tensor of another stage (it reads scratch). When
step 1 fails on the meta device (construction code that reads a tensor's value, e.g.
``torch.linspace(...).item()``), step 1 runs for real with every tensor on scratch.
A construction that converts the model (``.to(torch.bfloat16)``) is followed (buffers it remakes are
known by their slot), but holds every tensor in the new dtype: build big models in their dtype.

[Note: every tensor a stage reads]
``state_dict()`` is not all of a module's state, and a traced stage reads more than its
parameters: non-persistent buffers (RoPE's ``inv_freq``, causal masks), constants the trace
lifted (a plain tensor attribute), parameters shared with another stage (a tied head), and
tensors its graph creates on a device the trace recorded. An owner gives each of them the
unsplit model's value, by name: parameters and buffers, persistent or not, from
:func:`build_part` (the construction makes non-persistent buffers as it makes the rest, and
:func:`keep_persistence` keeps them out of ``state_dict`` as the plain model does); constants
from the same construction, by their attribute path; the device in the graph from the owner
(see [Note: a traced graph names the device it was traced on] in :mod:`rpcmp.plan.graphs`). Then
:func:`check_materialized` walks the stage's tensors and graphs and refuses, by name, anything
on the meta device, a graph that would still create tensors there, and a parameter holding NaN
(memory nothing wrote), so a stage never runs on memory without a value. ``rpcmp plan --check``
compares every value with the unsplit model's (:mod:`rpcmp.cli.commands.check`).
"""
from __future__ import annotations

import gc
import sys
import threading
from typing import Callable

import torch
from torch import nn

from ..errors import PartitionError
from .copies import Copies, Copy, needed, recorded, same

__all__ = ["meta_model", "build_part", "build_whole", "tensor_names", "tensor_aliases", "tensor_table", "set_tensor", "attach_tensor",
           "graph_constants", "attribute", "read_constant", "set_constant", "keep_persistence", "check_materialized"]

_LOCAL = threading.local()  # the registration hooks act only in the thread that builds
COMPILED: set = set()  # the model factories that returned a torch.compile'd module here (see _construct)


def build_whole(job, compiled: bool = False) -> nn.Module:
    """The unsplit model, all of it, for real; a compiled one unwrapped unless ``compiled`` (see :func:`_construct`)."""
    return _construct(job, split=not compiled)


def _construct(job, split: bool = True) -> nn.Module:
    """``job.model()`` under ``job.seed``; to be ``split``, a ``torch.compile``'d module is the module it wraps
    (a stage runs a part of it; its names are the module's own, no ``_orig_mod.``)."""
    if job.model is None:
        raise PartitionError("stages given by name, Split or SplitAt need Job(model=<factory>) to build the model from")
    torch.manual_seed(job.seed)
    model = job.model()
    if split and isinstance(model, getattr(sys.modules.get("torch._dynamo"), "OptimizedModule", ())):  # no import: ~1 s
        COMPILED.add(job.model)  # the plan says so, once (rpcmp.plan.partition.plan_stages)
        model = model._orig_mod
    if not isinstance(model, nn.Module):
        raise PartitionError(f"Job(model=...) must return an nn.Module, got {type(model).__name__}")
    return model


def meta_model(job) -> nn.Module:
    """``job.model()`` with every parameter and buffer on the meta device."""
    return _record(job)[0]


def tensor_names(model: nn.Module) -> dict[int, list[str]]:
    """id of every parameter and buffer -> every name it has in ``model`` (tied ones have several)."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return names


def tensor_aliases(model: nn.Module, prefix: str = "") -> dict[str, list[str]]:
    """Each parameter or buffer name of ``model`` (with ``prefix``) -> the other names of the same tensor (tied)."""
    groups = [[prefix + n for n in names] for names in tensor_names(model).values()]
    return {n: [m for m in group if m != n] for group in groups for n in group}


def set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` in place of the parameter or buffer called ``name`` (qualified) in ``module``."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def tensor_table(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` under each of its names (tied ones under all)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def attach_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Register ``value`` as the parameter or buffer ``name`` of ``module``, making the empty
    submodules its path needs (a tensor no traced graph reads, see [Note: parameters forward does not use])."""
    *path, leaf = name.split(".")
    owner = module
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if isinstance(value, nn.Parameter):
        owner.register_parameter(leaf, value)
    else:
        owner.register_buffer(leaf, value)


def graph_constants(module: nn.Module) -> list[str]:
    """Qualified names of the tensors ``module``'s graphs read that are neither parameters nor
    buffers: constants the trace lifted (a plain tensor attribute, a tensor ``forward`` made)."""
    from .graphs import graphs
    held = set(tensor_table(module))
    found = []
    for prefix, _, graph in graphs(module):
        for node in graph.nodes:
            name = f"{prefix}.{node.target}" if prefix else str(node.target)
            if node.op == "get_attr" and name not in held and isinstance(attribute(module, name), torch.Tensor):
                found.append(name)
    return found


def attribute(obj, name: str):
    """``obj``'s attribute at the dotted path ``name``, None where the path ends."""
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj


def read_constant(model: nn.Module, name: str) -> torch.Tensor | None:
    """The value of constant ``name`` in the built model, if it is a real tensor there."""
    value = attribute(model, name)
    return value if isinstance(value, torch.Tensor) and not value.is_meta else None


def set_constant(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner_name) if owner_name else module, leaf, value)


def keep_persistence(model: nn.Module, modules) -> None:
    """Buffers that are not in ``model``'s ``state_dict`` (RoPE's ``inv_freq``, a causal mask) stay
    out of the stages' too: their values come from the construction, not from checkpoints."""
    transient = {f"{p}.{b}" if p else b for p, m in model.named_modules() for b in m._non_persistent_buffers_set}
    for module in modules:
        for name, _ in module.named_buffers(remove_duplicate=False):
            if name in transient:
                owner_name, _, leaf = name.rpartition(".")
                (module.get_submodule(owner_name) if owner_name else module)._non_persistent_buffers_set.add(leaf)


def check_materialized(modules: dict[str, nn.Module], where: str) -> None:
    """Refuse, by name, a built stage that would read a tensor with no value: a parameter, buffer or
    constant left on the meta device, a graph that creates tensors on the meta device, or a
    parameter holding NaN (memory that was never written). See [Note: every tensor a stage reads]."""
    from .graphs import graph_devices
    on_meta, nan, nodes = [], [], []
    for kind, module in modules.items():
        seen = set()
        for name, t in [*tensor_table(module).items(), *((n, attribute(module, n)) for n in graph_constants(module))]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            if t.is_meta:
                on_meta.append(name)
            elif isinstance(t, nn.Parameter) and t.is_floating_point() and torch.isnan(t).any():
                nan.append(name)
        nodes += [f"{n} ({kind} graph)" for n, d in graph_devices(module).items() if d.startswith("meta")]
    wrong = [f"{what}: {_some(names)}" for what, names in (("graph nodes that create tensors on the meta device", nodes),
                                                            ("on the meta device", on_meta), ("holding NaN", nan)) if names]
    if wrong:
        raise PartitionError(f"{where} has tensors without their unsplit values: {'; '.join(wrong)}. Run "
                             f"`rpcmp plan JOB --check` to compare the stages with the unsplit model")


def _some(names: list[str], shown: int = 5) -> str:
    names = sorted(set(names))
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


class _Hooks:
    """The global registration hooks, active in this thread only while the ``with`` block runs."""

    def __init__(self, on_tensor: Callable):
        self.on_tensor = on_tensor

    def __enter__(self):
        _LOCAL.active = self.on_tensor
        self.handles = [nn.modules.module.register_module_parameter_registration_hook(_hook),
                        nn.modules.module.register_module_buffer_registration_hook(_hook)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        _LOCAL.active = None


def _hook(module, name, tensor):
    on_tensor = getattr(_LOCAL, "active", None)
    if on_tensor is None or tensor is None or isinstance(tensor, nn.parameter.UninitializedTensorMixin):
        return None
    return on_tensor(module, name, tensor)


def _record(job) -> tuple[nn.Module, list[tuple[list[str], tuple, torch.dtype]], list[Copy]]:
    """Step 1: the model on the meta device; for each registration in order, the final names of
    the registered tensor (none if it was replaced later), its shape and dtype; and the tensors the
    construction deep-copied (see [Note: copies of a module] in :mod:`rpcmp.plan.copies`). The
    construction seeds (``job.seed``) and may draw; the process's generators come out as they went
    in, so that planning or tracing while training leaves the masks a stage here draws alone."""
    with torch.random.fork_rng(devices=[]):
        return _record_seeded(job)


def _record_seeded(job) -> tuple[nn.Module, list[tuple[list[str], tuple, torch.dtype]], list[Copy]]:
    order: list[tuple] = []  # (module, name, tensor, its shape and dtype when registered)
    copies: list[tuple] = []  # (the tensor copied, its copy)

    def note(module, name, t):
        order.append((module, name, t, tuple(t.shape), t.dtype))

    def seen(t, memo, deepcopy):
        copies.append((t, deepcopy(t, memo)))
        return copies[-1][1]

    scratch = _Scratch()
    try:
        with _Hooks(note), Copies(seen), torch.device("meta"):
            model = _construct(job)
    except PartitionError:
        raise
    except Exception:  # noqa: BLE001 - construction that needs real values: see the Note
        order.clear()
        copies.clear()

        def on_scratch(module, name, t):
            order.append((module, name, scratch.take(t), tuple(t.shape), t.dtype))
            return order[-1][2]
        with _Hooks(on_scratch), Copies(seen):
            model = _construct(job)
        scratch.release()
    lazy = [n for n, t in tensor_table(model).items() if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    if lazy:
        raise PartitionError(f"Job.model() returned a model whose tensors have no shape yet: {_some(lazy)} (lazy modules, "
                             f"nn.LazyLinear and the like, take their shapes at their first forward, so no process can "
                             f"build its part alone). Give them their sizes (nn.Linear(in_features, out_features)), or "
                             f"run one batch through the model in the factory before returning it")
    # every tensor to meta, also those made on the CPU despite the meta default (``torch.Tensor(n)``)
    model = _to_meta(model, scratch, everything=True)
    made = recorded(copies, [t for _, _, t, *_ in order], tensor_names(model), scratch.meta_of)
    return model, _final_names(model, [(m, n, scratch.meta_of.get(id(t), t), *rest) for m, n, t, *rest in order]), made


def _final_names(model: nn.Module, order: list[tuple]) -> list[tuple[list[str], tuple, torch.dtype]]:
    """For each registration, the names its tensor has in ``model`` and its shape and dtype when registered. Found
    by identity, or else in its slot when a conversion replaced it there (``.to(dtype)`` makes new buffers); a slot
    holding another registered tensor holds that one."""
    names, modules = tensor_names(model), {id(m) for m in model.modules()}
    registered = {id(t) for _, _, t, *_ in order}
    out = []
    for module, name, t, shape, dtype in order:
        now = {**module._parameters, **module._buffers}.get(name) if id(module) in modules else None
        by_slot = now is not None and id(now) not in registered and tuple(now.shape) == shape
        out.append((names.get(id(t)) or (names.get(id(now), []) if by_slot else []), shape, dtype))
    return out


def build_part(job, keep: Callable[[str], bool]) -> nn.Module:
    """``job.model()`` built under ``job.seed`` where every parameter and buffer whose name
    ``keep`` accepts holds its unsplit value and every other one is on the meta device."""
    _, order, copies = _record(job)
    real, sources = needed(copies, keep)  # see [Note: copies of a module] in rpcmp/plan/copies.py
    others = [(shape, dtype) for i, (names, shape, dtype) in enumerate(order)
              if not any(keep(n) for n in names) and i not in sources]
    others += [(c.shape, c.dtype) for c, r in zip(copies, real) if not r]
    scratch = _Scratch({d: max((_numel(s) for s, dd in others if dd == d), default=0) for _, d in others})
    seen, made = iter(enumerate(order)), iter(zip(copies, real))

    def place(module, name, t):
        i, (names, shape, dtype) = next(seen, (None, ([], None, None)))
        same(job, "registered", (shape, dtype), t)
        if any(keep(n) for n in names):
            scratch.slots.discard((id(module), name))  # a kept tensor replaced a scratch one there (a tied weight)
            return scratch.own(t)
        scratch.slots.add((id(module), name))
        return t if i in sources else scratch.take(t)  # a kept copy is made from it: its values, until _to_meta

    def copy(t, memo, deepcopy):
        c, r = next(made, (None, False))
        same(job, "copied", (c.shape, c.dtype) if c else (None, None), t)
        if not r:
            memo[id(t)] = scratch.take(t, fresh=True)
            return memo[id(t)]
        out = deepcopy(t, memo)
        if not any(keep(n) for n in c.names):  # a kept copy is made from it, or a temporary: its values, until _to_meta
            scratch.given[id(out)] = out
        return out

    with _Hooks(place), Copies(copy):
        model = _construct(job)
    scratch.release()
    model = _to_meta(model, scratch)
    gc.collect()  # scratch views the construction left in reference cycles: their buffer goes now, not later
    return model


class _Scratch:
    """Views of one buffer per dtype, handed out in place of tensors nobody keeps."""

    def __init__(self, sizes: dict[torch.dtype, int] | None = None):
        self.buffers = {d: torch.empty(n, dtype=d) for d, n in (sizes or {}).items() if n}
        self.given: dict[int, torch.Tensor] = {}  # id of a scratch tensor -> it
        self.meta_of: dict[int, torch.Tensor] = {}
        self.slots: set[tuple[int, str]] = set()  # (id of a module, name) where scratch went in
        self.storages = {b.untyped_storage().data_ptr() for b in self.buffers.values()}

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, a tensor the stage keeps, in memory of its own if it is made of scratch: a parametrization
        (``weight_norm``) registers its ``original`` as the very tensor it replaces, which was not the stage's
        (its name is gone from the model) and went to scratch, which the construction then writes over."""
        if t.device.type == "meta" or t.untyped_storage().data_ptr() not in self.storages:
            return t
        copy = t.detach().clone()
        return nn.Parameter(copy, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else copy

    def take(self, t: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        """A scratch view in place of ``t`` (``t`` itself if it is one already, registered again under another name:
        tied), or, ``fresh``, a view of its own (a copy of ``t``)."""
        if id(t) in self.given and not fresh:
            return t
        n = _numel(t.shape)
        buf = self.buffers.get(t.dtype)
        if buf is None or buf.numel() < n:
            buf = self.buffers[t.dtype] = torch.empty(max(n, 1), dtype=t.dtype)
            self.storages.add(buf.untyped_storage().data_ptr())
        view = buf[:n].view(t.shape)
        out = nn.Parameter(view, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else view
        self.given[id(out)] = out
        return out

    def release(self) -> None:
        self.buffers.clear()


def _to_meta(model: nn.Module, scratch: _Scratch, everything: bool = False) -> nn.Module:
    """Replace every scratch tensor (every tensor, if ``everything``) by a meta tensor of its shape."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                # a scratch tensor, or what a conversion (``.to(dtype)``) made of one in its slot
                if t is None or not (everything or id(t) in scratch.given or (id(module), name) in scratch.slots):
                    continue
                if id(t) not in done:
                    meta = torch.empty_like(t, device="meta")
                    done[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
                    scratch.meta_of[id(t)] = done[id(t)]
                table[name] = done[id(t)]
    scratch.given.clear()
    scratch.slots.clear()
    return model


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
