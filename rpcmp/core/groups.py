"""Per-parameter optimizer settings: ``Job(param_groups=...)``.

[Note: parameter groups]
Language-model recipes keep weight decay off biases, norms and embeddings (nanoGPT's
``configure_optimizers``, Hugging Face's Trainer): the optimizer is built over *groups* of
parameters, each with settings of its own. In a pipeline no process holds the model and each
owner builds a local optimizer over its own parameters, so the job gives its groups as a function
of the model, ``param_groups(model) -> [{"params": [...], "weight_decay": 0.0}, ...]`` (what
``configure_optimizers`` builds: parameters, or their names). The master calls it once, on the
model on the meta device (:func:`plan_groups`), and checks what ``torch.optim`` lets pass in
silence: a parameter in no group would never train, a setting the optimizer does not have would be
ignored. It keeps names only: every name of every parameter (a tied one has several) -> its
group's index, and each group's settings. That plain data travels in the local optimizers'
constructor (:class:`Grouped`); each owner builds a ``torch.optim`` optimizer over the groups it
holds parameters of, each group tagged with its index (``GROUP_KEY``), so that what a scheduler
sets per group (:mod:`rpcmp.core.hparams`), and what a move, a snapshot or a checkpoint carries,
finds its group on any owner. DDP mode builds its one optimizer from the same names.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from ..errors import JobError

__all__ = ["GROUP_KEY", "Groups", "Grouped", "plan_groups", "numeric", "no_decay"]

GROUP_KEY = "rpcmp_group"  # a local optimizer's group: which of the job's groups it is


@dataclass(frozen=True)
class Groups:
    """The job's parameter groups by name: see [Note: parameter groups]."""

    of: dict[str, int]  # every name of every parameter in a group -> the group's index
    settings: tuple[dict[str, Any], ...]  # per group: what it sets beside the optimizer's own arguments
    sizes: tuple[tuple[int, int], ...] = ()  # per group: parameters, and values in them (for rpcmp plan)

    def split(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """``torch.optim`` parameter groups of ``named`` (name, parameter): the groups they fall in, tagged."""
        members: dict[int, list[torch.Tensor]] = {}
        seen: set[int] = set()
        for name, param in named:
            if id(param) in seen:
                continue
            seen.add(id(param))
            if name not in self.of:
                if not param.requires_grad:  # frozen and in no group (see plan_groups): torch.optim would skip it
                    continue
                raise JobError(f"parameter {name} is in none of Job.param_groups' groups (known: {len(self.of)} names)")
            members.setdefault(self.of[name], []).append(param)
        return [{"params": members[g], **self.settings[g], GROUP_KEY: g} for g in sorted(members)]

    def describe(self) -> str:
        """One line for ``rpcmp plan``: each group's tensors and settings."""
        parts = [f"{n} tensor{'s' * (n != 1)}, {size:,} values" + (f" ({', '.join(f'{k}={v}' for k, v in s.items())})" if s else "")
                 for (n, size), s in zip(self.sizes, self.settings)]
        return f"{len(self.settings)} parameter groups: " + "; ".join(parts)


class Grouped:
    """A local optimizer's constructor: ``cls`` over the groups of the parameters it is handed, found by
    their names on this process's stages. Picklable (a class, names and numbers): DistributedOptimizer
    sends it to every owner."""

    def __init__(self, cls: type, groups: Groups):
        self.cls, self.groups = cls, groups
        self.__name__ = cls.__name__

    def __call__(self, params: list[torch.Tensor], *args, **kwargs) -> torch.optim.Optimizer:
        from .served import current
        names = {id(p): host.spec.prefix + n for host in list(current().hosts.values())
                 for n, p in host.module.named_parameters(remove_duplicate=False)}
        return self.cls(self.groups.split((names[id(p)], p) for p in params), *args, **kwargs)


def no_decay(model: nn.Module) -> list[dict[str, Any]]:
    """``Job(param_groups=rpcmp.no_decay)``: the groups Hugging Face's Trainer gives AdamW. Weight decay on every
    parameter but biases and normalization weights, which go in a group with ``weight_decay=0.0``: those whose name
    says so (Trainer's patterns: ``bias``, ``layernorm``, ``rmsnorm``, a ``norm`` or ``_norm`` name part, as T5's
    ``relative_attention_bias``) or that belong to a module whose class names a norm (``LayerNorm``,
    ``LlamaRMSNorm``; also a ``BatchNorm2d`` called ``bn1``, as timm's rule has it). In a GPT-2, a Llama or
    nanoGPT's own model these are the tensors of fewer than two dimensions, nanoGPT's ``configure_optimizers``
    rule. By name, so it runs on the meta device; the optimizer's own ``weight_decay`` applies to the first group;
    frozen parameters stay out of both."""
    normed = {f"{m}.{n}" if m else n for m, module in model.named_modules() if "norm" in type(module).__name__.lower()
              for n, _ in module.named_parameters(recurse=False)}
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    off = [n for n in names if n in normed or _NO_DECAY.search(n.lower())]
    decayed = set(names) - set(off)
    return [{"params": [n for n in names if n in decayed]}, {"params": off, "weight_decay": 0.0}]


_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")  # Trainer.get_decay_parameter_names


def plan_groups(job, model: nn.Module, optimizer: tuple | None = None) -> Groups | None:
    """``job.param_groups(model)`` as names, checked against ``optimizer`` (default: the job's); None without
    groups. See [Note: parameter groups]."""
    if job.param_groups is None:
        return None
    try:
        given = job.param_groups(model)
    except Exception as exc:
        raise JobError(f"Job.param_groups(model) failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(given, dict) or not isinstance(given, (list, tuple)) or not given:
        raise JobError(f"Job.param_groups(model) must return a non-empty list of groups like torch.optim's, "
                       f'[{{"params": [...], "weight_decay": 0.0}}, ...], got {type(given).__name__}: {given!r:.200}')
    named = list(model.named_parameters(remove_duplicate=False))
    by_name = dict(named)
    first = {id(p): n for n, p in reversed(named)}  # each parameter's first name
    group_of: dict[int, int] = {}
    settings = []
    for i, group in enumerate(given):
        if not isinstance(group, dict) or "params" not in group:
            raise JobError(f"Job.param_groups: group {i} must be a dict with 'params' (parameters or their names) "
                           f"and the settings it changes, got {group!r:.200}")
        params = group["params"]
        try:
            params = [params] if isinstance(params, (torch.Tensor, str)) else list(params)
        except TypeError:
            raise JobError(f"Job.param_groups: group {i}'s 'params' must be parameters or their names, got a "
                           f"{type(params).__name__} (for a module's, give module.parameters())") from None
        for p in params:
            p = _parameter(p, i, by_name, first)
            if group_of.setdefault(id(p), i) != i:
                raise JobError(f"Job.param_groups: parameter {first[id(p)]} is in group {group_of[id(p)]} and in group "
                               f"{i}; torch.optim refuses a parameter in two groups: keep it in one")
        settings.append({k: v for k, v in group.items() if k != "params"})
    missing = [n for n, p in named if first[id(p)] == n and id(p) not in group_of and p.requires_grad]
    if missing:
        raise JobError(f"Job.param_groups: {len(missing)} parameters are in no group ({', '.join(missing[:5])}"
                       f"{', ...' if len(missing) > 5 else ''}): the optimizer would never update them. Put them in a "
                       f"group (a last {{'params': rest}} keeps the optimizer's own settings), or set "
                       f"requires_grad=False on the parameters the model keeps frozen")
    _check_settings(optimizer or job.optimizer, settings)
    sizes = [[0, 0] for _ in settings]
    for n, p in named:
        if first[id(p)] == n and id(p) in group_of:
            sizes[group_of[id(p)]][0] += 1
            sizes[group_of[id(p)]][1] += p.numel()
    return Groups({n: group_of[id(p)] for n, p in named if id(p) in group_of}, tuple(settings),
                  tuple(map(tuple, sizes)))


def _parameter(p: Any, group: int, by_name: dict[str, torch.Tensor], first: dict[int, str]) -> torch.Tensor:
    if isinstance(p, str):
        if p not in by_name:
            close = difflib.get_close_matches(p, list(by_name), n=3)
            raise JobError(f"Job.param_groups: group {group} names {p!r}, which is no parameter of the model"
                           f"{' (did you mean ' + ', '.join(close) + '?)' if close else ''}; give names as "
                           f"model.named_parameters() says them, or the parameters themselves")
        return by_name[p]
    if not isinstance(p, torch.Tensor) or id(p) not in first:
        raise JobError(f"Job.param_groups: group {group} holds a {type(p).__name__} that is not a parameter of the "
                       f"model it was handed: build the groups from that model's parameters (or their names), not "
                       f"from another instance of it")
    return p


def _check_settings(optimizer: tuple, settings: list[dict[str, Any]]) -> None:
    """Every group setting is one of the optimizer's, a number where the optimizer's is one (torch.optim takes
    ``"lr": "1e-3"`` from a config file and fails at the first step)."""
    cls, kwargs = optimizer
    probe = cls([torch.zeros(1, requires_grad=True)], **kwargs)
    for i, s in enumerate(settings):
        unknown = sorted(k for k in s if k not in probe.defaults or k == GROUP_KEY)
        if unknown:
            raise JobError(f"Job.param_groups: group {i} sets {', '.join(map(repr, unknown))}, which "
                           f"{cls.__name__} does not have (its settings: {', '.join(sorted(probe.defaults))})")
        for key, value in s.items():
            default = probe.defaults[key]
            if numeric(default) and not (numeric(value) and _arity(value) == _arity(default)):
                raise JobError(f"Job.param_groups: group {i} sets {key}={value!r}, but {cls.__name__}'s {key} is "
                               f"{default!r}: give a value of that kind")


def numeric(value: Any) -> bool:
    """A number (not a bool), or a tuple of numbers: a setting a scheduler may change (``lr``, ``betas``)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, tuple):
        return all(numeric(v) for v in value)
    return isinstance(value, (int, float))


def _arity(value: Any) -> int | None:
    """None for a number, the length of a tuple (``betas``)."""
    return len(value) if isinstance(value, tuple) else None
