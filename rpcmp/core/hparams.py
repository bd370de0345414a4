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
starts from that class's own defaults, not from a guessed learning rate.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["scheduled_fields", "apply_fields", "read_fields", "make_probe", "scheduler_state", "load_scheduler_state",
           "StageFields"]


def scheduled_fields(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The numeric settings of ``optimizer``'s first parameter group that a scheduler may change."""
    group = optimizer.param_groups[0]
    return {k: group[k] for k in optimizer.defaults
            if k in group and _numeric(group[k])}


def apply_fields(optim: Any, fields: dict[str, Any]) -> None:
    """Set ``fields`` on a ``torch.optim`` optimizer (every group) or on a functional one
    (its ``defaults``, which it reads at every step)."""
    if hasattr(optim, "param_groups"):
        for group in optim.param_groups:
            group.update(fields)
        return
    for key, value in fields.items():
        if key == "betas" and "beta1" in optim.defaults:
            optim.defaults["beta1"], optim.defaults["beta2"] = value
        elif key in optim.defaults:
            optim.defaults[key] = value


def read_fields(optim: Any) -> dict[str, Any]:
    """The settings ``optim`` (plain or functional) will use at its next step."""
    if hasattr(optim, "param_groups"):
        return scheduled_fields(optim)
    fields = {k: v for k, v in optim.defaults.items() if _numeric(v)}
    if "beta1" in fields:
        fields["betas"] = (fields.pop("beta1"), fields.pop("beta2"))
    return fields


def make_probe(optimizer: tuple, scheduler: tuple | None):
    """``(probe optimizer, scheduler)`` for the job's ``(cls, kwargs)`` pair, or ``(None, None)``."""
    if scheduler is None:
        return None, None
    cls, kwargs = optimizer
    probe = cls([torch.zeros(1, requires_grad=True)], **kwargs)
    scls, skwargs = scheduler
    return probe, scls(probe, **skwargs)


def scheduler_state(scheduler, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint keeps of a scheduler: its own state and the fields it last set."""
    return {"scheduler": scheduler.state_dict(), "fields": scheduled_fields(optimizer)}


def load_scheduler_state(scheduler, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore :func:`scheduler_state`: a scheduler's ``load_state_dict`` restores its counters, not
    the momentum or betas it last set, so the fields are put back on ``optimizer`` too. A checkpoint
    written before the fields were kept holds the scheduler's state alone: only ``lr`` is restored."""
    if "fields" not in state:
        scheduler.load_state_dict(state)
        apply_fields(optimizer, {"lr": scheduler.get_last_lr()[0]})
        return
    scheduler.load_state_dict(state["scheduler"])
    apply_fields(optimizer, state["fields"])


def _numeric(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, tuple):
        return all(_numeric(v) for v in value)
    return isinstance(value, (int, float))


_UNSET = object()


class StageFields:
    """The optimizer fields of every stage's optimizer, kept equal to what the job's scheduler
    sets (see [Note: schedulers in pipeline mode]); ``send(changed)`` writes fields to every
    stage (over RPC, in pipeline mode) and is called only with fields that changed."""

    def __init__(self, optimizer: tuple, scheduler: tuple | None, send: Callable[[dict[str, Any]], None]):
        self.probe, self.scheduler = make_probe(optimizer, scheduler)
        self.sent: dict[str, Any] = dict(optimizer[1])
        self._send = send
        self._push()  # what the scheduler sets at construction reaches every stage before step 1

    def set(self, fields: dict[str, Any]) -> None:
        changed = {k: v for k, v in fields.items() if self.sent.get(k, _UNSET) != v}
        if changed:
            self._send(changed)
            self.sent.update(changed)

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
        load_scheduler_state(self.scheduler, self.probe, state)
        self._push()

    @property
    def lr(self) -> float | None:
        return self.sent.get("lr")

    def _push(self) -> None:
        if self.probe is not None:
            self.set(scheduled_fields(self.probe))
