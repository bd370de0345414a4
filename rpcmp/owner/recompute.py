"""Activation checkpointing per stage: ``Job(recompute=True)``.

[Note: recompute]
With ``Job(recompute=True)`` a stage keeps only its input for backward and runs its
forward again when the backward reaches it (``torch.utils.checkpoint``, non-reentrant): the M
micro-batches in flight then hold M stage inputs instead of M sets of activations, at
the cost of one more forward per micro-batch. The second forward runs on an autograd
thread while the stage's compute thread may be running a later micro-batch's forward,
so (1) the two take the stage's lock in turn, and the recomputation sets the global RNG
to the state its first pass started from and puts it back (checkpoint's own
``preserve_rng_state`` would reset the RNG under the other thread's feet); (2) it must
not move BatchNorm's running statistics a second time, and cannot switch the shared
layers' momentum off, so the stage's BatchNorm layers get a subclass that, on a
recomputing thread, normalises with the batch's statistics (what the first pass did)
without touching the running ones.
"""
from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["Recomputed", "make_recomputable"]

_RECOMPUTING = threading.local()


class Recomputed:
    """Calls the stage module; the second call is the recomputation. See [Note: recompute]."""

    @classmethod
    def run(cls, module: torch.nn.Module, lock: threading.RLock, device: torch.device, x: Any) -> Any:
        """The stage's forward, keeping only ``x`` for backward (call it holding ``lock``)."""
        return checkpoint(cls(module, lock, device), x, use_reentrant=False, preserve_rng_state=False)

    def __init__(self, module: torch.nn.Module, lock: threading.RLock, device: torch.device):
        self.module, self.lock, self.device, self.rng = module, lock, device, None

    def __call__(self, x: Any) -> Any:
        if self.rng is None:  # the first pass, on the thread that runs the stage (it holds the lock)
            self.rng = self._rng()
            return self.module(x)
        with self.lock:
            now = self._rng()
            self._set_rng(self.rng)
            _RECOMPUTING.on = True
            try:
                return self.module(x)
            finally:
                _RECOMPUTING.on = False
                self._set_rng(now)

    def _rng(self):
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set_rng(self, state) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)


class _RecomputableBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Mixed into a stage's BatchNorm classes when it recomputes: see [Note: recompute]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(_RECOMPUTING, "on", False) and self.training and self.track_running_stats:
            self._check_input_dim(x)  # copies of the running statistics take the update (and keep the saved
            return F.batch_norm(x, self.running_mean.clone(), self.running_var.clone(),  # tensors as in pass 1)
                                self.weight, self.bias, True, 0.0, self.eps)
        return super().forward(x)


def make_recomputable(module: torch.nn.Module) -> None:
    for m in module.modules():
        cls = type(m)
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, _RecomputableBatchNorm):
            m.__class__ = _recomputable(cls)


@functools.cache
def _recomputable(cls: type) -> type:
    """``cls`` with :class:`_RecomputableBatchNorm` mixed in: one class per class (a pure function of it)."""
    return type(cls.__name__, (_RecomputableBatchNorm, cls), {})
