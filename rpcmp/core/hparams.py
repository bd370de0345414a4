"""The optimizer fields a learning-rate scheduler sets (``lr``, ``momentum``, ``betas``, ...),
read from one optimizer and written into another, plain or functional.

[Note: schedulers in pipeline mode]
A scheduler wraps a ``torch.optim.Optimizer``; the stages' optimizers live on other
processes (and are often TorchScript-friendly *functional* optimizers that keep their
settings in ``defaults``, with Adam's ``betas`` split into ``beta1`` / ``beta2``). So the
master runs the job's scheduler around a *probe*: an optimizer of the job's own class and
arguments over one dummy parameter. Schedulers change the probe's ``param_groups`` at
construction (``LinearLR``'s ``start_factor``, ``OneCycleLR``'s initial learning rate and
momentum) and at every step; every field of the optimizer's ``defaults`` that changed is
sent to every stage's optimizer before the step that uses it. A probe of the job's class
starts from that class's own defaults, not from a guessed learning rate. With parameter
groups the probe has one dummy parameter per group, and fields travel per group (see
[Note: parameter groups] in rpcmp/core/groups.py).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import JobError
from .groups import GROUP_KEY, Groups, numeric as _numeric

__all__ = ["scheduled_fields", "apply_fields", "read_fields", "make_probe", "make_scheduler", "scheduler_state",
           "load_scheduler_state", "StageFields"]


def scheduled_fields(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """The numeric settings of each of ``optimizer``'s groups that a scheduler may change, by group (see
    [Note: parameter groups]: a group's index in the job, else its place)."""
    return {group.get(GROUP_KEY, i): {k: group[k] for k in optimizer.defaults if k in group and _numeric(group[k])}
            for i, group in enumerate(optimizer.param_groups)}


def apply_fields(optim: Any, fields: dict) -> None:
    """Set ``fields`` (per group index, or one dict of settings for every group) on a ``torch.optim``
    optimizer or on a functional one (one group: its ``defaults``, which it reads at every step)."""
    flat = _flat(fields)
    if hasattr(optim, "param_groups"):
        for i, group in enumerate(optim.param_groups):
            group.update(flat if flat is not None else fields.get(group.get(GROUP_KEY, i), {}))
        return
    for key, value in (flat if flat is not None else fields.get(0, {})).items():
        if key == "betas" and "beta1" in optim.defaults:
            optim.defaults["beta1"], optim.defaults["beta2"] = value
        elif key in optim.defaults:
            optim.defaults[key] = value


def read_fields(optim: Any) -> dict[int, dict[str, Any]]:
    """The settings ``optim`` (plain or functional) will use at its next step, by group."""
    if hasattr(optim, "param_groups"):
        return scheduled_fields(optim)
    fields = {k: v for k, v in optim.defaults.items() if _numeric(v)}
    if "beta1" in fields:
        fields["betas"] = (fields.pop("beta1"), fields.pop("beta2"))
    return {0: fields}


def make_probe(optimizer: tuple, scheduler: tuple | None, groups: Groups | None = None):
    """``(probe optimizer, scheduler)`` for the job's ``(cls, kwargs)`` pair, or ``(None, None)``; the
    probe has one dummy parameter per group, with the group's settings."""
    if scheduler is None:
        return None, None
    cls, kwargs = optimizer
    settings = groups.settings if groups is not None else ({},)
    probe = cls([{"params": [torch.zeros(1, requires_grad=True)], **s} for s in settings], **kwargs)
    return probe, make_scheduler(scheduler, probe)


def make_scheduler(scheduler: tuple, optimizer: torch.optim.Optimizer):
    """The job's ``(class or function, kwargs)`` scheduler over ``optimizer``, checked to be one stepped per step."""
    scls, skwargs = scheduler
    made = scls(optimizer, **skwargs)
    if not isinstance(made, torch.optim.lr_scheduler.LRScheduler) or isinstance(
            made, torch.optim.lr_scheduler.ReduceLROnPlateau):  # its step needs the metric: not once per step alone
        raise JobError(f"Job.scheduler {getattr(scls, '__name__', scls)!r} returned a {type(made).__name__}, not a "
                       f"torch.optim.lr_scheduler.LRScheduler stepped once per optimizer step (ReduceLROnPlateau is not "
                       f"supported)")
    return made


def _flat(fields: dict) -> dict[str, Any] | None:
    """``fields`` when it is one dict of settings for every group (a checkpoint's before groups, set_hparams)."""
    return fields if any(isinstance(k, str) for k in fields) else None


def scheduler_state(scheduler, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint keeps of a scheduler: its own state and the fields it last set."""
    return {"scheduler": scheduler.state_dict(), "fields": scheduled_fields(optimizer)}


def load_scheduler_state(scheduler, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore :func:`scheduler_state`: a scheduler's ``load_state_dict`` restores its counters, not
    the momentum or betas it last set, so the fields are put back on ``optimizer`` too. A checkpoint
    written before the fields were kept holds the scheduler's state alone: only ``lr`` is restored."""
    if "fields" not in state:
        scheduler.load_state_dict(state)
        apply_fields(optimizer, dict(enumerate({"lr": lr} for lr in scheduler.get_last_lr())))
        return
    scheduler.load_state_dict(state["scheduler"])
    apply_fields(optimizer, state["fields"])


_UNSET = object()


class StageFields:
    """The optimizer fields of every stage's optimizer, kept equal to what the job's scheduler
    sets (see [Note: schedulers in pipeline mode]); ``send(changed)`` writes fields to every
    stage (over RPC, in pipeline mode) and is called only with fields that changed."""

    def __init__(self, optimizer: tuple, scheduler: tuple | None, send: Callable[[dict[int, dict[str, Any]]], None],
                 groups: Groups | None = None):
        self.probe, self.scheduler = make_probe(optimizer, scheduler, groups)
        settings = groups.settings if groups is not None else ({},)
        self.sent: dict[int, dict[str, Any]] = {i: {**optimizer[1], **s} for i, s in enumerate(settings)}
        self._send = send
        self._push()  # what the scheduler sets at construction reaches every stage before step 1

    def set(self, fields: dict, every: bool = False) -> None:
        """Send ``fields`` (per group index, or one dict for every group) where they change a group's settings
        (``every``: all of them, whatever was sent before)."""
        flat = _flat(fields)
        per_group = {i: flat for i in self.sent} if flat is not None else fields
        changed = {}
        for i, got in per_group.items():
            if i not in self.sent:
                raise JobError(f"no parameter group {i!r}: the job's optimizer has groups {sorted(self.sent)}")
            differ = dict(got) if every else {k: v for k, v in got.items() if self.sent[i].get(k, _UNSET) != v}
            if differ:
                changed[i] = differ
        if changed:
            self._send(changed)
            for i, differ in changed.items():
                self.sent[i].update(differ)

    def step(self) -> None:
        """Step the scheduler; what it changed reaches every stage before the next step."""
        if self.scheduler is None:
            return
        self.probe.step()
        self.scheduler.step()
        self._push()

    def state(self) -> dict[str, Any]:
        return scheduler_state(self.scheduler, self.probe)

    def load_state(self, state: dict[str, Any]) -> None:
        """The scheduler's state of an earlier step (a resume, a rollback): every stage gets all of its fields, not
        only those that differ from what was sent last; the stages may hold others by now (read back from a
        checkpoint's files, or sent by a push that a lost process cut short)."""
        load_scheduler_state(self.scheduler, self.probe, state)
        self._push(every=True)

    @property
    def lr(self) -> float | None:
        """The first group's learning rate (torch's ``param_groups[0]["lr"]``)."""
        return self.sent[0].get("lr")

    def _push(self, every: bool = False) -> None:
        if self.probe is not None:
            self.set(scheduled_fields(self.probe), every)
