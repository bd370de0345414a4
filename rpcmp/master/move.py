"""Move a stage to another process while training: ``pipe.move_stage(k, "worker4/cpu")``.

[Note: moving a stage]
Between two steps (nothing in flight), the master has the stage built on its new owner
with the same ``build`` as at start, and the new owner takes every tensor of it from the
old one by name, owner to owner (the master never holds it; see [Note: what a stage is, to
move it] in :mod:`rpcmp.owner.move`). Then every owner of the pipeline learns the new route
(where stage k - 1 sends its output, where skip values go), the old owner drops its copy, and
the master makes a new DistributedOptimizer over the new parameter handles: its local
optimizer on each process takes over the state of the old one for the parameters that
stayed (the same tensors, not copies) and the moved stage's state by name, with the fields
the scheduler had set. Nothing else of the pipeline changes: the same split, the same names,
the same numbers. A run with a move equals one without (tests/integration/test_move.py).
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed.rpc as rpc
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer

from ..core.futures import raise_failures, wait_all
from ..core.health import reason, unresponsive
from ..core.served import current
from ..errors import JobError, PlacementError, WorkerLostError
from ..owner import move as owner_move
from ..owner import stage
from ..owner import state as stage_state
from ..owner import stepping
from ..plan.placement import Place
from .sync import LocalMerge

__all__ = ["move_stage", "parse_target", "build_on", "build_many", "install", "new_optimizer", "warm", "held_handles",
           "restore_handles", "register_optimizers", "route"]


def parse_target(target: str) -> Place:
    """``"worker4"`` or ``"worker4/cuda:0"`` as a :class:`Place` of a process of this run."""
    process, _, device = str(target).partition("/")
    try:
        rpc.get_worker_info(process)
    except RuntimeError:
        raise PlacementError(f"cannot move a stage to {target!r}: {process!r} is not a process of this run "
                             f"(processes are named master, worker1, worker2, ...)") from None
    return Place(process, device or "cpu")


def move_stage(pipe, index: int, target: str, copy_of: bool = False, replica: int = 0) -> float:
    """Move stage ``index`` of ``pipe`` to ``target`` (see [Note: moving a stage]); the seconds it took.
    ``copy_of``: ``pipe`` is a copy of a replicated pipeline, whose caller gives the stage's copies a
    new process group after (:meth:`rpcmp.master.replicas.Replicated.move_stage`); otherwise
    ``replica`` can only be 0, the one copy."""
    if not 0 <= index < len(pipe.specs):
        raise JobError(f"move_stage: the pipeline has stages 0..{len(pipe.specs) - 1}, not {index}")
    if replica and not copy_of:
        raise JobError(f"move_stage: this pipeline has no replicas (replica 0 only), not replica {replica}")
    if not copy_of and not isinstance(pipe.sync, LocalMerge):
        raise JobError("move_stage: this pipeline is one copy of a replicated one: move its stages with "
                       "Replicated.move_stage(index, target, replica), which regroups the stage's copies")
    new, old = parse_target(target), pipe.places[index]
    if new == old:
        return 0.0
    start = time.perf_counter()
    owners = list(pipe.owners)
    owners[index] = new.process
    old_optims = {r.owner().name: r for r in (pipe.optimizer.remote_optimizers if pipe.optimizer else [])}
    # The generators travel when the move leaves no other stage on either process: see [Note: what a stage is, to move it].
    alone = pipe.owners.count(old.process) == 1 and new.process not in pipe.owners
    handles = held_handles(pipe)
    try:  # nothing is final before the old owner drops its copy: see [Note: a target lost late]
        built = build_on(pipe, index, new, owners)
        rpc.rpc_sync(new.process, owner_move.take_stage, args=(pipe.pid, index, old.process,
                                                              old.process in old_optims, alone))
        pipe.places[index], pipe.owners[index] = new, new.process
        install(pipe, index, new, built)
        new_optimizer(pipe, old_optims, {old.process, new.process})
        route(pipe, owners)
    except Exception as exc:  # noqa: BLE001 - the stage stays where it was; a lost target is said so
        lost = unresponsive([new.process], timeout=3.0)
        if lost:
            current().lost.add(new.process)
        if pipe.owners[index] != old.process:
            _put_back(pipe, index, old, handles)
        if lost:
            raise WorkerLostError(f"move_stage: stage {index} stays on {old.process}: {new.process} was lost while it "
                                  f"took the stage ({reason(exc)})") from exc
        raise
    rpc.rpc_sync(old.process, owner_move.drop_stage, args=(pipe.pid, index))
    return time.perf_counter() - start


# [Note: a target lost late]
# A move is final when the old owner drops its copy, the last call. Until then the target can be
# lost (killed, stopped past the RPC timeout) in any of the calls that hand it the stage, the
# last of them after the master's handles and optimizer point at it and some owners send to it.
# The stage then stays where it was: the master takes its old handles and optimizer back (as an
# undone re-cut does) and routes every surviving owner as before; the move fails as one whose
# target was lost while it built (tests/integration/test_move.py kills it in each of those calls).
def _put_back(pipe, index: int, place: Place, handles: tuple) -> None:
    """Stage ``index`` of ``pipe`` on ``place`` again, as before a move that failed (its target lost)."""
    current().keep_lost([pipe.stages[index].module_rref, *pipe.stage_rrefs[index]])
    pipe.places[index], pipe.owners[index] = place, place.process
    restore_handles(pipe, handles)
    route(pipe, pipe.owners)


def route(pipe, owners: list[str]) -> None:
    """Every one of ``owners`` sends ``pipe``'s values on to the stages' owners as ``owners`` places them."""
    wait_all([rpc.rpc_async(o, owner_move.set_routes, args=(pipe.pid, owners)) for o in sorted(set(owners))])


def held_handles(pipe) -> tuple:
    """What the master holds of ``pipe``'s stages and optimizer (for :func:`restore_handles`)."""
    optimizers = list(pipe.optimizer.remote_optimizers) if pipe.optimizer is not None else None
    return list(pipe.stages), list(pipe.stage_rrefs), optimizers


def restore_handles(pipe, handles: tuple) -> None:
    """The master's handles of the stages as they were: a move or a re-cut undone after :func:`install` and
    :func:`new_optimizer` ran. The old local optimizers are untouched: a new one shares their state."""
    pipe.stages, pipe.stage_rrefs, optimizers = handles
    pipe.param_rrefs = [r for refs in pipe.stage_rrefs for r in refs]
    pipe.param_owners = sorted({r.owner().name for r in pipe.param_rrefs})
    if optimizers is not None:
        current().keep_lost([r for r in pipe.optimizer.remote_optimizers if r not in optimizers])
        pipe.optimizer.remote_optimizers = optimizers
    pipe.label_stages()


def build_on(pipe, index: int, place: Place, owners: list[str], empty: bool = True):
    """Build stage ``index`` on ``place`` for a pipeline whose stages will be on ``owners``; with ``empty``,
    to be filled with every value it holds (not drawn); its gate waits for the pipeline's next micro-batch.
    What ``stage.build`` returned."""
    return build_many(pipe, {index: place}, owners, empty)[index]


def build_many(pipe, places: dict, owners: list[str], empty: bool = True) -> dict:
    """:func:`build_on` for several stages (``places``: index -> place) at once, each on its process."""
    def options(k):
        nxt = owners[k + 1] if k + 1 < len(owners) else None
        return (pipe.pid, pipe.specs[k], places[k], nxt, pipe.job.call_timeout,
                {**pipe.build_options, "owners": owners, "empty": empty})
    built = dict(zip(places, wait_all([rpc.rpc_async(p.process, stage.build, args=options(k)) for k, p in places.items()])))
    raise_failures(list(built.values()))
    wait_all([rpc.rpc_async(p.process, stage.resync, args=(pipe.pid, k, pipe.next_seq)) for k, p in places.items()])
    return built


def install(pipe, index: int, place: Place, built) -> None:
    """The master's handles of stage ``index``, now built on ``place`` (what ``stage.build`` returned)."""
    refs, _, module = built
    current().keep_lost([pipe.stages[index].module_rref, *pipe.stage_rrefs[index]])  # see Served.keep_lost
    pipe.stage_rrefs[index] = refs
    pipe.param_rrefs = [r for stage_refs in pipe.stage_rrefs for r in stage_refs]
    pipe.stages[index] = RemoteModule.init_from_module_rref(str(place), module)
    pipe.label_stages()


def distributed_optimizer(cls, params: list, **kwargs) -> DistributedOptimizer:
    """A DistributedOptimizer over ``params`` whose local optimizers rpcmp can read and write.

    [Note: local optimizers rpcmp can write]
    rpcmp reads and writes each local optimizer's ``state`` by parameter: checkpoints and resumes, moves,
    snapshots and rollbacks. torch releases that compile the functional optimizers with TorchScript
    (``_new_script_local_optimizer`` in torch.distributed.optim.optimizer) hand Python a copy of that
    state: what a resume or a rollback writes is lost, and Adam starts its moments afresh without a word
    (torch 2.11 on CUDA: a resumed run's model 0.037 off the run left alone; make gpu-check). Under such a
    torch the local optimizers are torch.optim ones (TorchScript off while the constructor chooses), whose
    state is the live dict; under a torch whose functional optimizers are plain Python, they stay."""
    from torch.distributed.optim import optimizer as dist_optim
    level = dist_optim.logger.level
    dist_optim.logger.setLevel(logging.ERROR)  # its warning that the optimizer is not the functional one
    scripted = hasattr(dist_optim, "_new_script_local_optimizer")
    if scripted:
        torch.jit._state.disable()
    try:
        return _Optimizer(cls, params, **kwargs)
    finally:
        if scripted:
            torch.jit._state.enable()
        dist_optim.logger.setLevel(level)


class _Optimizer(DistributedOptimizer):
    """A DistributedOptimizer whose local optimizers read rpcmp's view of a step's gradients.

    [Note: a parameter a step did not reach]
    torch's step of a local optimizer that is a torch.optim one (any optimizer without a functional twin:
    NAdam, RAdam, a user's own; under a TorchScript torch every one, see [Note: local optimizers rpcmp can
    write]) sets ``.grad`` of the parameters the step's context holds and leaves every other one's as it
    was: a parameter that a step did not reach (an expert no token was routed to, a branch not taken) was
    updated again with the gradient of the last step that reached it, where the unsplit model, its
    gradients zeroed to None, leaves it alone (NAdam, tests/jobs/branchy.py: 0.017 off in 3 steps). rpcmp
    steps every local optimizer itself (:func:`rpcmp.owner.stepping.local_step`): a torch.optim one finds every
    parameter's ``.grad`` set, None where the step has no gradient, and let go after; a functional one is
    handed the list, as torch does. Both read the gradients the owner keeps beside the context (see [Note: a
    parameter the first micro-batch did not reach] in rpcmp/owner/reduce.py)."""

    def step(self, context_id, stepped=()):
        """The step of context ``context_id`` on every owner but those in ``stepped``, which took it in the
        backward (see [Note: a step steps where its gradients are made] in
        rpcmp/owner/stepping.py)."""
        wait_all([rpc.rpc_async(o.owner(), stepping.local_step, args=(o, context_id, self.is_functional_optim))
                  for o in self.remote_optimizers if o.owner().name not in stepped])


def register_optimizers(pipe) -> None:
    """Each owner learns its local optimizer of ``pipe`` (see [Note: no handle of a third process] in
    rpcmp/owner/state.py); a new one learns it as it adopts the old one's state."""
    if pipe.optimizer is not None:
        wait_all([rpc.rpc_async(r.owner(), stage_state.register_optimizer, args=(pipe.pid, r))
                  for r in pipe.optimizer.remote_optimizers])


def new_optimizer(pipe, old_optims: dict, changed: set[str]) -> None:
    """The pipeline's optimizer after its stages changed place: a new local optimizer on each process in
    ``changed`` that holds parameters now (it takes the state of the old one there, ``old_optims`` by
    process, and of the stages that came to it: :func:`rpcmp.owner.move.adopt_optimizer`); every other
    process keeps its own, which takes what a rollback stashed."""
    if pipe.optimizer is None:
        return
    holders = {r.owner().name for r in pipe.param_rrefs}
    keep = [r for r in pipe.optimizer.remote_optimizers if r.owner().name in holders - changed]
    cls, kwargs = pipe.optimizer_spec
    params = [r for r in pipe.param_rrefs if r.owner().name in changed]
    fresh = distributed_optimizer(cls, params, **kwargs).remote_optimizers if params else []
    sent = pipe.fields.sent if getattr(pipe, "fields", None) is not None else None  # what every optimizer has now
    wait_all([rpc.rpc_async(r.owner(), owner_move.adopt_optimizer, args=(pipe.pid, r, old_optims.get(r.owner().name),
                                                                          sent))
              for r in fresh] + [rpc.rpc_async(r.owner(), owner_move.adopt_optimizer, args=(pipe.pid, r, None))
                                 for r in keep])
    current().keep_lost([r for r in pipe.optimizer.remote_optimizers if r not in keep])
    pipe.optimizer.remote_optimizers = keep + fresh  # the old local optimizers of `changed` go with their last reference
    pipe.param_owners = sorted(holders)


def warm(processes, spec) -> None:
    """Have ``processes`` trace the model that ``spec`` (any stage of a traced split) was cut from while they
    wait, or while the master plans a re-cut (:func:`rpcmp.owner.move.prepare`): a later build there is a build,
    not a trace as well; of a split by name or slice, keep the model on the meta device. Nothing for modules."""
    if spec.kind in ("traced", "names", "slice"):
        for process in processes:
            rpc.rpc_async(process, owner_move.prepare, args=(spec,))
