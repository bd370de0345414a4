"""The owner's side of moving a stage to another process while training
(:func:`rpcmp.master.move.move_stage`): the old owner hands its stage over by name, the new
one takes it, every owner learns the new route, and each process's new local optimizer takes
the state of the parameters it holds.

[Note: what a stage is, to move it]
A stage is more than its ``state_dict``: its parameters and *every* buffer (non-persistent
ones too: RoPE ``inv_freq``, masks), its optimizer state (keyed by the unsplit model's
parameter names, as in a checkpoint) and the optimizer's scheduled fields (learning rate,
momentum, ...), whether it is in training mode, the figures it has counted and the trace
slices it holds. The new owner builds the stage afresh from the job (the same
``build_stage`` as at start: constants a trace lifts come out the same) and copies every
parameter and buffer into it in place; one that the old stage does not have, or has with
another shape, is an error naming it. The process's random number generators travel too
when the move leaves nothing else of the pipeline on either side (a spare taking the one
stage of a process): then dropout draws the masks it would have drawn, and a run with a
move equals one without, bit for bit on CPU. Where the old owner keeps other stages, it keeps
its generators as they are.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed.rpc as rpc

from ..core.hparams import apply_fields, read_fields
from ..core.served import current
from ..errors import StageError, StepCancelled
from ..plan.partition import warm_trace
from . import state as stage_state
from .stage import named_params

__all__ = ["prepare", "export_stage", "take_stage", "gather_stage", "rekey", "fill_stage", "set_routes", "drop_stage",
           "adopt_optimizer", "leave_soon"]

_COUNTERS = ("compute_s", "runs", "bytes_in", "bytes_out", "events")


def prepare(spec) -> None:
    """A spare, while it waits (or an owner, while the master plans a re-cut): trace the model of a traced
    split now (``spec``: any of its stages) where the plan does not carry its graphs (see [Note: an owner
    builds the graphs the master traced] in rpcmp/plan/shipped.py), so that taking over a lost or drained stage
    later costs a build, not a trace as well (seconds: 5 s of a 5 s recovery for a small GPT-2); of a split by
    name or slice, make the model on the meta device. A failure here says nothing: the build that needs it reports it."""
    served = current()
    try:
        with served.build_lock:
            warm_trace(served.job, spec)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def export_stage(pid: int, index: int, optim_rref, rng: bool, copy: bool = False,
                 only: set[str] | None = None) -> dict[str, Any]:
    """Everything of stage ``index`` here that its next owner needs (see [Note: what a stage is, to
    move it]); with ``copy``, copies that later steps leave alone (a snapshot); with ``only``, of the
    tensors named there (the unsplit model's names) alone."""
    host = current().host(pid, index)
    module, prefix = host.module, host.spec.prefix
    wanted = (lambda n: True) if only is None else (lambda n: prefix + n in only)
    names = {prefix + n for n, _ in module.named_parameters() if wanted(n)}
    local = stage_state.local_optimizer(pid, optim_rref)
    optim = stage_state.optimizer_state(pid, optim_rref, names, copy=copy) if local is not None else {}
    return {"params": {n: stage_state.on_host(p, copy) for n, p in module.named_parameters() if wanted(n)},
            "buffers": {n: stage_state.on_host(b, copy) for n, b in module.named_buffers() if wanted(n)},
            "optimizer": optim, "fields": read_fields(local.optim) if local is not None else {},
            "training": module.training, "rng": stage_state.rng_state() if rng else None,
            "counters": {k: getattr(host, k) for k in _COUNTERS}, "prefix": host.spec.prefix}


def take_stage(pid: int, index: int, source: str, optimizer: bool, rng: bool, source_pid: int | None = None,
               counters: bool = True) -> None:
    """Fill the stage ``index`` here (just built; or, not ``counters``, a stage that keeps the figures it
    counted) with the values of its copy on ``source`` (of pipeline ``source_pid``: another copy of a
    replicated pipeline; default ``pid``), and, with ``optimizer``, its optimizer state there."""
    host = current().host(pid, index)
    got = rpc.rpc_sync(source, export_stage, args=(pid if source_pid is None else source_pid, index,
                                                   True if optimizer else None, rng), timeout=host.timeout)
    fill_stage(host, got, f"moving stage {index} ({host.spec.name}) from {source} to {rpc.get_worker_info().name}",
               counters=counters)


def fill_stage(host, got: dict[str, Any], where: str, counters: bool = True, copy: bool = False,
               optim_rref=None, rollback: bool = False) -> None:
    """Give ``host``'s stage the values of ``got`` (what :func:`export_stage` returns) in place, by name;
    its optimizer state goes into ``optim_rref``'s local optimizer, the one that keeps serving the stage (a
    rollback), or waits for :func:`adopt_optimizer`: copied, with ``copy`` (``got`` is kept). ``rollback``: the
    step failed, and a forward of it still running here stops (see :func:`_stopping_forward`)."""
    with _stopping_forward(host) if rollback else host.lock, torch.no_grad():
        for kind, mine in (("params", dict(host.module.named_parameters())), ("buffers", dict(host.module.named_buffers()))):
            theirs = got[kind]
            if set(mine) != set(theirs):
                raise StageError(f"{where}: the stage built here has other {kind} than the one it replaces "
                                 f"(only here: {sorted(set(mine) - set(theirs))[:5]}, only there: "
                                 f"{sorted(set(theirs) - set(mine))[:5]}); was the job file changed since the start?")
            for name, tensor in mine.items():
                if tensor.shape != theirs[name].shape:
                    raise StageError(f"{where}: {kind[:-1]} {name} has shape {tuple(tensor.shape)} here and "
                                     f"{tuple(theirs[name].shape)} there")
                tensor.copy_(theirs[name])
    host.module.train(got["training"])
    for key, value in got["counters"].items() if counters else ():
        setattr(host, key, value)
    if got["rng"] is not None:
        stage_state.set_rng_state(got["rng"])
    optim = got["optimizer"]
    if optim_rref is not None:
        _take_states(host, optim_rref.local_value().optim.state, optim, copy)
        optim = None  # in place already: adopt_optimizer takes the fields alone
    elif copy:  # here, beside the other stages' rollbacks, not in adopt_optimizer after them
        optim = {n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()} for n, st in optim.items()}
    host.moved_optimizer = (optim, got["fields"])  # taken by adopt_optimizer


def gather_stage(pid: int, index: int, old_pid: int, sources: dict[str, list[int]], optims: set[str],
                 aliases: dict[str, tuple[str, ...]] | None = None) -> None:
    """Fill the stage ``index`` just built here (a re-cut: other layers than before) with the tensors it
    now holds, by the unsplit model's names, from the old stages that held them (``sources``: process ->
    old stage indices of pipeline ``old_pid``; ``optims``: the processes with a local optimizer;
    ``aliases``: the other names of a parameter held under several, as a tied head is)."""
    host = current().host(pid, index)
    prefix, aliases = host.spec.prefix, aliases or {}
    keep = {"params": dict(host.module.named_parameters()), "buffers": dict(host.module.named_buffers())}
    wanted = {prefix + n for kind in keep.values() for n in kind}
    wanted |= {a for n in wanted for a in aliases.get(n, ())}
    found: dict[str, dict[str, Any]] = {"params": {}, "buffers": {}, "optimizer": {}}
    got: dict[str, Any] = {"fields": {}, "training": True, "rng": None, "counters": {}}
    for process, olds in sources.items():
        for j in olds:
            part = rpc.rpc_sync(process, export_stage, args=(old_pid, j, True if process in optims else None, False,
                                                             False, wanted),
                                timeout=host.timeout)
            for kind in ("params", "buffers"):
                found[kind].update({part["prefix"] + n: t for n, t in part[kind].items()})
            found["optimizer"].update(part["optimizer"])
            got["fields"] = {**part["fields"], **got["fields"]}  # per group (see [Note: parameter groups])
            got["training"] = part["training"]
    for kind in ("params", "buffers", "optimizer"):  # by its own name, else by another name of the same tensor
        mine = keep["params" if kind == "optimizer" else kind]
        got[kind] = {n: v for n in mine for v in [_by_name(found[kind], prefix + n, aliases)] if v is not None}
    got["optimizer"] = {prefix + n: v for n, v in got["optimizer"].items()}
    fill_stage(host, got, f"re-cutting stage {index} ({host.spec.name}) on {rpc.get_worker_info().name}", counters=False)


@contextlib.contextmanager
def _stopping_forward(host):
    """``host.lock``, taken from a forward of the failed step still running on the stage, not after it.

    [Note: a rollback stops the failed step's forward]
    When an owner is lost, the survivors roll back to the snapshot while the forward of the micro-batch they
    were computing still runs: it holds the stage's lock, and the recovery waited for it (the demo Unet's
    encoder: about 80 ms of a 125 ms recovery; a large stage on a CPU, seconds). Its output is dropped and
    every value it writes (BatchNorm's running statistics) is overwritten by the rollback. So while the
    rollback waits for the lock, a module forward pre-hook of this process raises at the next call of one of
    the stage's modules: the forward ends there, its micro-batch fails as cancelled, and the rollback takes
    the lock. The hook is registered only for that wait, so a step never pays for it. A stage whose forward
    calls no module of its own (a flat traced graph) still runs to its end first."""
    if not host.lock.acquire(blocking=False):
        mine = {id(m) for m in host.module.modules()}

        def stop(module, args):
            if id(module) in mine:
                raise StepCancelled(f"stage {host.spec.index} ({host.spec.name}): its step failed elsewhere, and "
                                    f"the stage rolls back")
        hook = torch.nn.modules.module.register_module_forward_pre_hook(stop)
        try:
            host.lock.acquire()
        finally:
            hook.remove()
    try:
        yield
    finally:
        host.lock.release()


def _by_name(table: dict[str, Any], name: str, aliases: dict[str, tuple[str, ...]]) -> Any:
    return next((table[n] for n in (name, *aliases.get(name, ())) if n in table), None)


def rekey(old_pid: int, pid: int, index: int) -> None:
    """A stage that a re-cut leaves as it is joins the re-cut pipeline ``pid`` unchanged (no copy), and its own
    snapshots with it: a re-cut that fails (an owner lost) keys them back, and its recovery needs them; after
    one that succeeds they never make a whole snapshot with the rebuilt stages, which have none of their steps."""
    served = current()
    hosts = served.hosts
    snaps = served.snapshots.pop((old_pid, index), None)
    if snaps is not None:
        served.snapshots[(pid, index)] = snaps
    host = hosts.pop((old_pid, index))
    host.pid = pid
    hosts[(pid, index)] = host


def set_routes(pid: int, owners: list[str]) -> None:
    """Every stage of pipeline ``pid`` here sends on to the owners it now has."""
    for host in current().hosts_of(pid):
        host.owners = list(owners)
        i = host.spec.index
        host.next_process = owners[i + 1] if i + 1 < len(owners) else None


def leave_soon(code: int = 0) -> None:
    """This process leaves the run with exit code ``code`` once its answer is on its way: a drained rank
    (rpcmp/launch/drain.py), or any worker after a peer was lost (see [Note: leaving a world with a lost
    peer] in rpcmp/launch/ending.py)."""
    leave_after(code, 0.5)


def leave_after(code: int, after: float) -> threading.Event:
    """This process leaves the run with exit code ``code`` in ``after`` seconds unless the event returned is set
    first (a worker whose shutdown still waits long after the run ended: [Note: an end told] in
    rpcmp/launch/ending.py)."""
    me, stay = rpc.get_worker_info().name, threading.Event()

    def leave():
        if stay.wait(after):
            return
        if after > 1:
            print(f"rpcmp: {me} leaves {after:.0f}s after the run ended, its shutdown still waiting (for a peer gone "
                  "since)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    threading.Thread(target=leave, daemon=True).start()
    return stay


def drop_stage(pid: int, index: int) -> None:
    """The old owner lets its copy of the stage go (the old optimizer's reference goes with the master's)."""
    served = current()
    host = served.hosts.pop((pid, index), None)
    served.snapshots.pop((pid, index), None)
    if host is not None:
        host.compute.shutdown(wait=False)


def adopt_optimizer(pid: int, new_rref, old_rref, sent: dict | None = None) -> int:
    """This process's new local optimizer takes the state of its parameters: from the old local
    optimizer for the stages that stayed (the same tensors), by name from what a moved stage
    brought; and the fields (learning rate, ...) the old one had, or what came, over ``sent``: the fields
    the master last wrote to every optimizer (a stage rebuilt from a checkpoint brings none, and the
    master then writes only what its scheduler changes). Returns the parameters with state."""
    stage_state.register_optimizer(pid, new_rref)
    new = new_rref.local_value().optim
    if sent:
        apply_fields(new, sent)
    fields = None
    if old_rref is not None:
        old = old_rref.local_value().optim
        for param in named_params(pid):
            if param in old.state:
                new.state[param] = old.state[param]
        fields = read_fields(old)
    for host in current().hosts_of(pid):
        moved = host.moved_optimizer
        if moved is None:
            continue
        states, moved_fields = moved
        if states is not None:  # None: in place already (fill_stage)
            _take_states(host, new.state, states, copy=False)
        fields = {**moved_fields, **(fields or {})}  # per group: a moved stage may bring groups new here
        host.moved_optimizer = None
    if fields:
        apply_fields(new, fields)
    return len([p for p in named_params(pid) if p in new.state])


def _take_states(host, state: dict, states: dict[str, dict], copy: bool) -> None:
    """An optimizer's ``state`` for ``host``'s parameters from ``states`` (by the unsplit model's names)."""
    for name, param in ((host.spec.prefix + n, p) for n, p in host.module.named_parameters()):
        if name in states:
            _take_state(state, param, states[name], copy)
        elif param in state:  # no state in what came (a snapshot before the first step): none now
            del state[param]


def _take_state(state: dict, param: torch.Tensor, got: dict[str, Any], copy: bool) -> None:
    """``param``'s optimizer state from ``got``, on the parameter's device. With ``copy`` (``got`` is kept: a
    snapshot) written into the tensors the optimizer holds for it already where they match (a stage rolled back
    keeps its optimizer: no fresh memory, whose copy was most of a survivor's rollback, 56 ms for the demo
    Unet's encoder with Adam), else into copies; without, ``got``'s own tensors are taken."""
    have = state.get(param)
    if copy and have is not None and have.keys() == got.keys() and all(
            isinstance(have[k], torch.Tensor) and have[k].shape == v.shape and have[k].dtype == v.dtype
            for k, v in got.items() if isinstance(v, torch.Tensor)):
        with torch.no_grad():
            for k, v in got.items():
                if isinstance(v, torch.Tensor):
                    have[k].copy_(v)
                else:
                    have[k] = v
        return

    state[param] = {k: stage_state.beside(v, param, copy) for k, v in got.items()}
