"""A split model's state as the unsplit model would hold it, gathered from every owner:
parameters and buffers, optimizer state, RNG, and the per-stage checkpoint files.

:class:`PipelineState` is the master's side; the owner's endpoints it calls over RPC are in
:mod:`rpcmp.owner.state`."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.rpc as rpc

from ..owner import state as stage_state
from ..core.futures import wait_all
from ..core.health import unresponsive
from ..plan.placement import MASTER

__all__ = ["PipelineState"]


class PipelineState:
    """Mixed into :class:`rpcmp.Pipeline`, whose ``pid``, ``places``, ``optimizer``,
    ``_each`` and ``held`` it uses."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated state of every stage, keyed as in the unsplit model."""
        state: dict[str, torch.Tensor] = {}
        for part in self._each(stage_state.state_dict):
            state.update(part)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._each(stage_state.load_state_dict, state)

    def state_meta(self) -> dict[str, torch.Tensor]:
        """The keys of :meth:`state_dict` with tensors of their shapes and dtypes on the meta
        device: what checks need, without moving any value."""
        return {k: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
                for part in self._each(stage_state.state_meta) for k, (shape, dtype) in part.items()}

    def load_files(self, files: list[str], optimizer: bool = True) -> None:
        """Each owner reads its own stages' keys, and their optimizer state, from checkpoint
        ``files`` (memory-mapped; see [Note: a checkpoint nobody holds whole]): nothing whole
        travels, whatever split wrote them."""
        optims = {r.owner().name: r for r in self._remote_optimizers} if optimizer else {}
        wait_all([rpc.rpc_async(p.process, stage_state.load_files, args=(self.pid, i, optims.get(p.process), files))
                  for i, p in enumerate(self.places)])

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Optimizer state of every stage, keyed by the unsplit model's parameter names."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        for part in wait_all([rpc.rpc_async(r.owner(), stage_state.optimizer_state, args=(self.pid, r))
                              for r in self._remote_optimizers]):
            state.update(part)
        return state

    def load_optimizer_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        wait_all([rpc.rpc_async(r.owner(), stage_state.load_optimizer_state, args=(self.pid, r, state))
                  for r in self._remote_optimizers])

    def init_from(self, path: str) -> None:
        """Each owner gives its stages their values from the state_dict file ``path``, reading its
        own keys only (``Job(init_from=...)``)."""
        from ..core.checkpoint import CheckpointError, check_model_keys, fill_tied, read_state_file
        state = read_state_file(path)
        for aliases in self._each(stage_state.aliases):  # a tied weight written once (checkpoint.fill_tied)
            state = fill_tied(state, aliases)
        try:
            check_model_keys({"model": state, "path": path}, self.state_meta(), "this job's model")
        except CheckpointError as exc:
            raise CheckpointError(f"Job(init_from=...): {exc}; write the file with torch.save(model.state_dict(), "
                                  f"path) from the model the job builds") from None
        self._each(stage_state.init_from, path)

    def save_stage_files(self, directory: str, step: int, keep_last: int, run: str | None = None) -> list[dict]:
        """Each owner writes its stages' parts of the checkpoint of run ``run``, on its node; returns
        what the index says of each (see [Note: a checkpoint nobody holds whole])."""
        optims = {r.owner().name: r for r in self._remote_optimizers}
        paths = wait_all([rpc.rpc_async(p.process, stage_state.save_stage,
                                       args=(self.pid, i, optims.get(p.process), directory, step, keep_last, run))
                          for i, p in enumerate(self.places)])
        return [{"file": os.path.basename(path), "stage": i, "owner": str(p)}
                for i, (path, p) in enumerate(zip(paths, self.places))]

    def label_stages(self) -> None:
        """What failure messages say each process holds (``status.stages``), from where the stages are now."""
        self.status.stages = {o: [f"stage {s.index} {s.name}" for s in held] for o, held in self.held().items()}

    def remove_incomplete(self, directory: str) -> list[tuple[str, int]]:
        """Remove what an interrupted save left in ``directory`` here and on every owner's node (see
        [Note: what a killed save leaves] in rpcmp/core/checkpoint.py); (name, bytes) of each file. An owner lost
        meanwhile keeps its node's (the next start removes them): the first step meets the loss, and with a spare
        recovers from it; this call used to end the run "before the first step"."""
        from ..core.checkpoint import complete_stems, remove_incomplete
        complete = complete_stems(directory)
        removed = remove_incomplete(directory, complete)
        futs = {o: rpc.rpc_async(o, stage_state.remove_incomplete, args=(directory, complete))
                for o in sorted(set(self.owners) - {MASTER})}
        failed = None
        for fut in futs.values():
            try:
                removed += fut.wait()
            except Exception as exc:  # noqa: BLE001 - re-raised below unless its owner is lost
                failed = failed or exc
        if failed is not None and not unresponsive(list(futs), timeout=3.0):
            raise failed
        return sorted(set(removed))

    def rng_state(self) -> dict[str, Any]:
        """Every process's RNG state, by process name, and the stages each one holds."""
        owners = self._rng_owners()
        states = wait_all([rpc.rpc_async(o, stage_state.rng_state) for o in owners])
        return {"processes": dict(zip(owners, states)), "stages": self._stage_map()}

    def load_rng_state(self, saved: dict[str, Any] | None) -> bool:
        """Restore every process's RNG if each process holds the same stages as when saved
        (same split and placement); return whether it did."""
        if not saved or saved.get("stages") != self._stage_map():  # another split, placement or replica count
            return False
        wait_all([rpc.rpc_async(o, stage_state.set_rng_state, args=(saved["processes"][o],)) for o in self._rng_owners()])
        return True

    def _stage_map(self) -> dict[str, list[str]]:
        return {o: [f"{s.index}:{s.name}" for s in held] for o, held in self.held().items()}

    def _rng_owners(self) -> list[str]:
        return sorted(set(self.owners) | {MASTER})

    @property
    def _remote_optimizers(self) -> list:
        return self.optimizer.remote_optimizers if self.optimizer is not None else []
