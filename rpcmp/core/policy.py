"""Training policy, apart from the mechanism that computes losses and gradients (a pipeline
of stages, DDP ranks): what a non-finite loss does to a step (:class:`NonFinite`, both modes:
``Job.nonfinite="stop"`` raises before the optimizer step, so the parameters stay finite;
``"skip"`` skips the update with a warning and counts it), and fp16 loss scaling and
gradient clipping over gradients that no process holds whole (:class:`GradientPolicy`).
"""
from __future__ import annotations

import math
import warnings

import torch

from ..errors import NonFiniteLossError

__all__ = ["NonFinite", "GradientPolicy"]


class NonFinite:
    """``Job.nonfinite`` applied to each step's loss."""

    def __init__(self, mode: str, where: str = ""):
        self.mode, self.where, self.skipped = mode, where, 0
        self.updated = False  # whether any step has changed the parameters yet

    def allows(self, loss: torch.Tensor) -> bool:
        """True if the step may update the parameters; False (skip) or raise for a NaN/inf loss."""
        if torch.isfinite(loss).all():
            return True
        value = loss.float().sum().item()
        if self.mode == "skip":
            self.skipped += 1
            warnings.warn(f"loss is {value}{self.where}: this step's update was skipped (Job.nonfinite='skip'); "
                          f"{self.skipped} skipped so far", RuntimeWarning, stacklevel=3)
            return False
        if not self.updated:  # the parameters it started from give it: the learning rate cannot be the cause
            raise NonFiniteLossError(
                f"the loss is {value}{self.where} before any update in this run: the model gives a non-finite loss "
                f"with the parameters it started from, so the learning rate is not the cause. Check the data and the "
                f"loss, compare the stages with the unsplit model on one batch with `rpcmp plan JOB --check`, or set "
                f"Job(nonfinite='skip') to skip such steps")
        raise NonFiniteLossError(
            f"the loss is {value}{self.where}: training stopped before the optimizer step, so the parameters are "
            f"still finite. Lower the learning rate, check the data, or set Job(nonfinite='skip') to skip such steps")


class GradientPolicy:
    """fp16 loss scaling and clipping by the global norm, decided from the norm of every gradient.

    The mechanism that finds the norm and rescales gradients lives with the mode (pipeline
    mode sums each owner's squares over RPC); the decision lives here. Loss scaling works as
    ``torch.amp.GradScaler``: the loss is multiplied by ``scale`` before backward; a step whose
    gradients overflow anywhere is skipped and the scale halved; it doubles after ``growth``
    good steps. Clipping scales the gradients by ``max_norm / norm`` when the norm is larger,
    as ``torch.nn.utils.clip_grad_norm_`` does on the unsplit model. (DDP mode holds whole
    gradients in one process and uses those two torch classes directly.)
    """

    def __init__(self, fp16: bool, max_norm: float | None, growth: int = 2000, scale: float = 2.0 ** 16):
        self.scale = scale if fp16 else None
        self.max_norm, self.growth = max_norm, growth
        self.overflow_steps, self._good_steps = 0, 0
        self.last_norm: float | None = None

    @property
    def needs_norm(self) -> bool:
        return bool(self.max_norm) or self.scale is not None

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scale is None else loss * self.scale

    def coefficient(self, norm: float) -> float | None:
        """What to multiply the gradients by, given the norm of the scaled gradients over every
        stage; None: an fp16 overflow, skip the step."""
        coef = 1.0
        if self.scale is not None:
            if not math.isfinite(norm):
                self.overflow_steps += 1
                self.scale, self._good_steps = max(self.scale / 2, 1.0), 0
                return None
            norm, coef = norm / self.scale, 1.0 / self.scale
            self._good_steps += 1
            if self._good_steps % self.growth == 0:
                self.scale *= 2
        self.last_norm = norm
        if self.max_norm:
            coef *= min(1.0, self.max_norm / (norm + 1e-6))
        return coef
