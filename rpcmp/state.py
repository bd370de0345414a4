"""A split model's state as the unsplit model would hold it, gathered from every owner:
parameters and buffers, optimizer state, RNG, and the per-stage checkpoint files.

:class:`PipelineState` is the master's side; the ``_``-functions below it run on each
owner, called over RPC."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.rpc as rpc

from .stage import _HOSTS, _named_params
from .futures import wait_all
from .placement import MASTER

__all__ = ["PipelineState"]


class PipelineState:
    """Mixed into :class:`rpcmp.Pipeline`, whose ``pid``, ``places``, ``optimizer``,
    ``_each`` and ``_held`` it uses."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated state of every stage, keyed as in the unsplit model."""
        state: dict[str, torch.Tensor] = {}
        for part in self._each(_state_dict):
            state.update(part)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._each(_load_state_dict, state)

    def state_meta(self) -> dict[str, torch.Tensor]:
        """The keys of :meth:`state_dict` with tensors of their shapes and dtypes on the meta
        device: what checks need, without moving any value."""
        return {k: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
                for part in self._each(_state_meta) for k, (shape, dtype) in part.items()}

    def load_files(self, files: list[str], optimizer: bool = True) -> None:
        """Each owner reads its own stages' keys, and their optimizer state, from checkpoint
        ``files`` (memory-mapped; see [Note: a checkpoint nobody holds whole]): nothing whole
        travels, whatever split wrote them."""
        optims = {r.owner().name: r for r in self._remote_optimizers} if optimizer else {}
        wait_all([rpc.rpc_async(p.process, _load_files, args=(self.pid, i, optims.get(p.process), files))
                  for i, p in enumerate(self.places)])

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Optimizer state of every stage, keyed by the unsplit model's parameter names."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        for part in wait_all([rpc.rpc_async(r.owner(), _optimizer_state, args=(self.pid, r))
                              for r in self._remote_optimizers]):
            state.update(part)
        return state

    def load_optimizer_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        wait_all([rpc.rpc_async(r.owner(), _load_optimizer_state, args=(self.pid, r, state))
                  for r in self._remote_optimizers])

    def init_from(self, path: str) -> None:
        """Each owner gives its stages their values from the state_dict file ``path``, reading its
        own keys only (``Job(init_from=...)``)."""
        from .checkpoint import CheckpointError, check_model_keys, read_state_file
        try:
            check_model_keys({"model": read_state_file(path), "path": path}, self.state_meta(), "this job's model")
        except CheckpointError as exc:
            raise CheckpointError(f"Job(init_from=...): {exc}; write the file with torch.save(model.state_dict(), "
                                  f"path) from the model the job builds") from None
        self._each(_init_from, path)

    def save_stage_files(self, directory: str, step: int, keep_last: int, run: str | None = None) -> list[dict]:
        """Each owner writes its stages' parts of the checkpoint of run ``run``, on its node; returns
        what the index says of each (see [Note: a checkpoint nobody holds whole])."""
        optims = {r.owner().name: r for r in self._remote_optimizers}
        paths = wait_all([rpc.rpc_async(p.process, _save_stage,
                                       args=(self.pid, i, optims.get(p.process), directory, step, keep_last, run))
                          for i, p in enumerate(self.places)])
        return [{"file": os.path.basename(path), "stage": i, "owner": str(p)}
                for i, (path, p) in enumerate(zip(paths, self.places))]

    def rng_state(self) -> dict[str, Any]:
        """Every process's RNG state, by process name, and the stages each one holds."""
        owners = self._rng_owners()
        states = wait_all([rpc.rpc_async(o, _rng_state) for o in owners])
        return {"processes": dict(zip(owners, states)), "stages": self._stage_map()}

    def load_rng_state(self, saved: dict[str, Any] | None) -> bool:
        """Restore every process's RNG if each process holds the same stages as when saved
        (same split and placement); return whether it did."""
        if not saved or saved["stages"] != self._stage_map():
            return False
        wait_all([rpc.rpc_async(o, _set_rng_state, args=(saved["processes"][o],)) for o in self._rng_owners()])
        return True

    def _stage_map(self) -> dict[str, list[str]]:
        return {o: [f"{s.index}:{s.name}" for s in held] for o, held in self._held().items()}

    def _rng_owners(self) -> list[str]:
        return sorted(set(self._owners) | {MASTER})

    @property
    def _remote_optimizers(self) -> list:
        return self.optimizer.remote_optimizers if self.optimizer is not None else []


# -- on each owner, over RPC ---------------------------------------------------------
def _cpu_state(host, copy: bool = True) -> dict[str, torch.Tensor]:
    """The stage's parameters and buffers on the CPU, keyed as in the stage (without ``copy``,
    CPU tensors are the live ones)."""
    return {k: v.detach().cpu().clone() if copy else v.detach().cpu() for k, v in host.module.state_dict().items()}


def _state_meta(pid: int, index: int) -> dict[str, tuple[tuple[int, ...], str]]:
    host = _HOSTS[(pid, index)]
    return {host.spec.prefix + k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in host.module.state_dict().items()}


def _init_from(pid: int, index: int, path: str) -> None:
    from .checkpoint import read_state_file
    host = _HOSTS[(pid, index)]
    state = read_state_file(path)
    host.module.load_state_dict({k: state[host.spec.prefix + k] for k in host.module.state_dict()}, strict=True)


def _load_files(pid: int, index: int, optim_rref, files: list[str]) -> None:
    """Load this stage's keys and optimizer state from ``files``, memory-mapped. The model's values are
    copied into the stage and their mapping dropped at once; the optimizer state stays mapped from a
    second mapping of the file and is copied page by page as the optimizer writes it, so resuming needs
    no more memory than training does."""
    from .checkpoint import read_part
    host = _HOSTS[(pid, index)]
    mine = {host.spec.prefix + k: k for k in host.module.state_dict()}
    own = {}
    for path in files:
        own.update({mine[k]: v for k, v in read_part(path)[0].items() if k in mine})
    host.module.load_state_dict(own, strict=True)
    del own  # unmaps the pages just read
    if optim_rref is None:
        return
    names = {host.spec.prefix + n for n, _ in host.module.named_parameters()}
    optim = {}
    for path in files:
        optim.update({k: v for k, v in read_part(path)[1].items() if k in names})
    _load_optimizer_state(pid, optim_rref, optim, copy=False)


def _state_dict(pid: int, index: int) -> dict[str, torch.Tensor]:
    """This stage's parameters and buffers, keyed as in the unsplit model, on the CPU."""
    host = _HOSTS[(pid, index)]
    return {host.spec.prefix + k: v for k, v in _cpu_state(host).items()}


def _load_state_dict(pid: int, index: int, state: dict[str, torch.Tensor]) -> None:
    host = _HOSTS[(pid, index)]
    own = {k: state[host.spec.prefix + k] for k in host.module.state_dict() if host.spec.prefix + k in state}
    host.module.load_state_dict(own, strict=True)


def _optimizer_state(pid: int, optim_rref, only: set[str] | None = None,
                     copy: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """This process's optimizer state (of parameters named in ``only``, if given), keyed by
    the unsplit model's parameter names (without ``copy``: the live tensors)."""
    optim = optim_rref.local_value().optim
    names = _named_params(pid)
    return {names[p]: {k: v.detach().clone() if isinstance(v, torch.Tensor) and copy else v for k, v in st.items()}
            for p, st in optim.state.items() if p in names and (only is None or names[p] in only)}


def _load_optimizer_state(pid: int, optim_rref, states: dict[str, dict[str, torch.Tensor]], copy: bool = True) -> int:
    """Give this process's parameters their optimizer state by name (without ``copy``, the tensors
    themselves: memory-mapped ones are copied on write, page by page, as the optimizer updates them)."""
    optim = optim_rref.local_value().optim
    loaded = 0
    for param, name in _named_params(pid).items():
        if name in states:
            optim.state[param] = {k: v.clone() if isinstance(v, torch.Tensor) and copy else v
                                  for k, v in states[name].items()}
            loaded += 1
    return loaded


def _rng_state() -> dict[str, Any]:
    """This process's random number generators (dropout in its stages draws from them)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_stage(pid: int, index: int, optim_rref, directory: str, step: int, keep_last: int, run: str | None) -> str:
    """Write this stage's own checkpoint file here, on its owner (see rpcmp/checkpoint.py)."""
    from .checkpoint import save_stage_file
    host = _HOSTS[(pid, index)]
    names = {host.spec.prefix + n for n, _ in host.module.named_parameters()}
    # The live tensors, not copies (the step is over and the next waits for this answer): an owner's
    # memory does not grow by its stage while it saves.
    return save_stage_file(directory, index, {
        "stage": index, "name": host.spec.name, "prefix": host.spec.prefix, "owner": str(host.place), "step": step,
        "model": _cpu_state(host, copy=False),
        "optimizer": _optimizer_state(pid, optim_rref, names, copy=False) if optim_rref is not None else {},
    }, step, keep_last, run)
