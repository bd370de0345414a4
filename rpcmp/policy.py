"""Training policy that both modes share: what a non-finite loss does to a step.

The mechanism that computes a loss differs (a pipeline of stages, DDP ranks); the decision
does not, so it lives here once: ``Job.nonfinite="stop"`` raises before the optimizer step
(the parameters stay finite), ``"skip"`` skips the update with a warning and counts it.
"""
from __future__ import annotations

import warnings

import torch

from .errors import NonFiniteLossError

__all__ = ["NonFinite"]


class NonFinite:
    """``Job.nonfinite`` applied to each step's loss."""

    def __init__(self, mode: str, where: str = ""):
        self.mode, self.where, self.skipped = mode, where, 0

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
        raise NonFiniteLossError(
            f"the loss is {value}{self.where}: training stopped before the optimizer step, so the parameters are "
            f"still finite. Lower the learning rate, check the data, or set Job(nonfinite='skip') to skip such steps")
