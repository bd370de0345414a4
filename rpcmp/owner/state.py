"""The owner's side of a split model's state: the RPC endpoints that read and write the
parameters, buffers, optimizer state and RNG of the stages this process hosts, and write its
checkpoint parts (the master's side is :class:`rpcmp.master.state.PipelineState`)."""
from __future__ import annotations

from typing import Any

import torch

from ..core.served import current
from ..errors import StageError
from .stage import named_params

__all__ = ["on_host", "state_meta", "aliases", "init_from", "load_files", "state_dict", "load_state_dict", "optimizer_state",
           "load_optimizer_state", "beside", "rng_state", "set_rng_state", "save_stage", "remove_incomplete"]


def on_host(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """``t`` on the CPU, where state leaves a stage (over RPC, which takes CPU tensors, or into a snapshot, which
    must not take device memory): a CUDA tensor's copy; a CPU tensor itself, or with ``copy`` a copy that later
    steps leave alone."""
    t = t.detach()
    return t.cpu() if t.device.type != "cpu" else t.clone() if copy else t


def _cpu_state(host, copy: bool = True) -> dict[str, torch.Tensor]:
    """The stage's parameters and buffers on the CPU, keyed as in the stage (without ``copy``,
    CPU tensors are the live ones)."""
    return {k: on_host(v, copy) for k, v in host.module.state_dict().items()}


def state_meta(pid: int, index: int) -> dict[str, tuple[tuple[int, ...], str]]:
    host = current().host(pid, index)
    return {host.spec.prefix + k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in host.module.state_dict().items()}


def aliases(pid: int, index: int) -> dict[str, list[str]]:
    """Each key of this stage (the unsplit model's name) -> the other names of its tensor: in this stage (a tied
    weight), and the unsplit model's first name of a parameter another stage shares."""
    from ..plan.materialize import tensor_aliases
    host = current().host(pid, index)
    out = tensor_aliases(host.module, host.spec.prefix)
    for here, first in host.spec.tied:
        out.setdefault(host.spec.prefix + here, []).append(first)
    return out


def init_from(pid: int, index: int, path: str) -> None:
    from ..core.checkpoint import fill_tied, read_state_file
    host = current().host(pid, index)
    state = fill_tied(read_state_file(path), aliases(pid, index))
    host.module.load_state_dict({k: state[host.spec.prefix + k] for k in host.module.state_dict()}, strict=True)


def load_files(pid: int, index: int, optim_rref, files: list[str]) -> None:
    """Load this stage's keys and optimizer state from ``files``, memory-mapped. The model's values are
    copied into the stage and their mapping dropped at once; the optimizer state stays mapped from a
    second mapping of the file and is copied page by page as the optimizer writes it, so resuming needs
    no more memory than training does."""
    from ..core.checkpoint import read_part
    host = current().host(pid, index)
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
    load_optimizer_state(pid, optim_rref, optim, copy=False)


def state_dict(pid: int, index: int) -> dict[str, torch.Tensor]:
    """This stage's parameters and buffers, keyed as in the unsplit model, on the CPU."""
    host = current().host(pid, index)
    return {host.spec.prefix + k: v for k, v in _cpu_state(host).items()}


def load_state_dict(pid: int, index: int, state: dict[str, torch.Tensor]) -> None:
    host = current().host(pid, index)
    own = {k: state[host.spec.prefix + k] for k in host.module.state_dict() if host.spec.prefix + k in state}
    host.module.load_state_dict(own, strict=True)


# [Note: no handle of a third process]
# An owner that takes a stage from another owner (a move, a re-cut, a live copy's refill) asks that owner
# for the stage's optimizer state too. It used to pass on the master's RRef of that owner's local
# optimizer; an RRef an owner receives is a user of it, and when the call ended the owner told the RRef's
# owner it let go, a message torch retries and then, when that owner has died meanwhile, ends the process
# with `terminate called ... The RPC has not succeeded after the specified number of max retries`: a lost
# owner took a second process with it, 8 s later, and a run that spares could have saved ended. Owners now
# name it by ``True`` (this process's local optimizer of that pipeline, kept here by pipeline id as the
# master's calls made or adopted it, weakly) and hold no RRef of any process but their own.
def register_optimizer(pid: int, optim_rref) -> None:
    """This process's local optimizer of pipeline ``pid`` is ``optim_rref``'s (see the Note above)."""
    current().optimizers[pid] = optim_rref.local_value()


def local_optimizer(pid: int, handle):
    """The local optimizer (``.optim``: the optimizer) that ``handle`` names: its RRef (the master's calls), True
    (this process's of pipeline ``pid``: another owner's call), or None (none)."""
    if handle is None:
        return None
    if handle is True:
        found = current().optimizers.get(pid)
        if found is None:  # its state would be left behind without a word
            raise StageError(f"{current().me}: no local optimizer of pipeline {pid} is known here (it holds the state "
                             f"of the stage asked for)")
        return found
    return handle.local_value()


def optimizer_state(pid: int, optim_rref, only: set[str] | None = None,
                     copy: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """This process's optimizer state (of parameters named in ``only``, if given), keyed by
    the unsplit model's parameter names, on the CPU (without ``copy``: the live tensors of CPU stages)."""
    optim = local_optimizer(pid, optim_rref).optim
    names = named_params(pid)
    return {names[p]: {k: on_host(v, copy) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for p, st in optim.state.items() if p in names and (only is None or names[p] in only)}


def load_optimizer_state(pid: int, optim_rref, states: dict[str, dict[str, torch.Tensor]], copy: bool = True) -> int:
    """Give this process's parameters their optimizer state by name, on each parameter's device as
    ``Optimizer.load_state_dict`` puts it (a step count stays on the CPU). Without ``copy``, CPU
    tensors themselves: memory-mapped ones are copied on write, page by page, as the optimizer
    updates them."""
    optim = optim_rref.local_value().optim
    loaded = 0
    for param, name in named_params(pid).items():
        if name in states:
            optim.state[param] = {k: beside(v, param, copy) for k, v in states[name].items()}
            loaded += 1
    return loaded


def beside(value: Any, param: torch.Tensor, copy: bool) -> Any:
    """An optimizer state value for ``param`` where the optimizer keeps it: a tensor with dimensions on the
    parameter's device, a step count where it is (as ``Optimizer.load_state_dict`` puts them); with ``copy``,
    never ``value`` itself."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim():
        return value.to(param.device, copy=copy)
    return value.clone() if copy else value


def rng_state() -> dict[str, Any]:
    """This process's random number generators (dropout in its stages draws from them)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_stage(pid: int, index: int, optim_rref, directory: str, step: int, keep_last: int, run: str | None) -> str:
    """Write this stage's own checkpoint file here, on its owner (see rpcmp/core/checkpoint.py)."""
    from ..core.checkpoint import save_stage_file
    host = current().host(pid, index)
    names = {host.spec.prefix + n for n, _ in host.module.named_parameters()}
    # The live tensors, not copies (the step is over and the next waits for this answer): an owner's
    # memory does not grow by its stage while it saves.
    return save_stage_file(directory, index, {
        "stage": index, "name": host.spec.name, "prefix": host.spec.prefix, "owner": str(host.place), "step": step,
        "model": _cpu_state(host, copy=False),
        "optimizer": optimizer_state(pid, optim_rref, names, copy=False) if optim_rref is not None else {},
    }, step, keep_last, run)


def remove_incomplete(directory: str, complete: set[str]) -> list[tuple[str, int]]:
    """What an interrupted save left in ``directory`` on this owner's node, removed (see rpcmp/core/checkpoint.py)."""
    from ..core.checkpoint import remove_incomplete as remove
    return remove(directory, complete)
