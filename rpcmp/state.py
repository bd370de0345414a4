"""A split model's state as the unsplit model would hold it, gathered from every owner:
parameters and buffers, optimizer state, RNG, and the per-stage checkpoint files."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed.rpc as rpc

from . import stage as _stage
from .futures import wait_all
from .placement import MASTER

__all__ = ["PipelineState"]


class PipelineState:
    """Mixed into :class:`rpcmp.Pipeline`, whose ``pid``, ``places``, ``optimizer``,
    ``_each`` and ``_held`` it uses."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated state of every stage, keyed as in the unsplit model."""
        state: dict[str, torch.Tensor] = {}
        for part in self._each(_stage._state_dict):
            state.update(part)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._each(_stage._load_state_dict, state)

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Optimizer state of every stage, keyed by the unsplit model's parameter names."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        for part in wait_all([rpc.rpc_async(r.owner(), _stage._optimizer_state, args=(self.pid, r))
                              for r in self._remote_optimizers]):
            state.update(part)
        return state

    def load_optimizer_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        wait_all([rpc.rpc_async(r.owner(), _stage._load_optimizer_state, args=(self.pid, r, state))
                  for r in self._remote_optimizers])

    def save_stage_files(self, directory: str, step: int, keep_last: int) -> list[str]:
        """Each owner writes its stages' own checkpoint files, on its node."""
        optims = {r.owner().name: r for r in self._remote_optimizers}
        return wait_all([rpc.rpc_async(p.process, _stage._save_stage,
                                       args=(self.pid, i, optims.get(p.process), directory, step, keep_last))
                         for i, p in enumerate(self.places)])

    def rng_state(self) -> dict[str, Any]:
        """Every process's RNG state, by process name, and the stages each one holds."""
        owners = self._rng_owners()
        states = wait_all([rpc.rpc_async(o, _stage._rng_state) for o in owners])
        return {"processes": dict(zip(owners, states)), "stages": self._stage_map()}

    def load_rng_state(self, saved: dict[str, Any] | None) -> bool:
        """Restore every process's RNG if each process holds the same stages as when saved
        (same split and placement); return whether it did."""
        if not saved or saved["stages"] != self._stage_map():
            return False
        wait_all([rpc.rpc_async(o, _stage._set_rng_state, args=(saved["processes"][o],)) for o in self._rng_owners()])
        return True

    def _stage_map(self) -> dict[str, list[str]]:
        return {o: [f"{s.index}:{s.name}" for s in held] for o, held in self._held().items()}

    def _rng_owners(self) -> list[str]:
        return sorted(set(self._owners) | {MASTER})

    @property
    def _remote_optimizers(self) -> list:
        return self.optimizer.remote_optimizers if self.optimizer is not None else []
