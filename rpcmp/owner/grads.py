"""The owner's side of a step's gradients between backward and optimizer step: the micro-batches'
gradients summed as each backward leaves a stage (:class:`rpcmp.owner.reduce.StepMerge`) and, with
replicas, averaged with the stage's copies (:class:`~rpcmp.owner.reduce.StepReduce`); the global
norm for clipping, the scaling it decides, and the gradients of a parameter that two stages share
(see [Note: a parameter shared by stages] in rpcmp/master/tied.py)."""
from __future__ import annotations

import torch

from ..errors import StageError
from ..core.failure import Failure
from ..core.served import current
from .reduce import StepMerge, StepReduce, drop_beside, param_grads
from .stepping import needs_word, stepper
from .stage import StageHost, count_reduce, named_params, running_stats

__all__ = ["begin_merge", "begin_reduce", "reduce_merged", "average_grads", "settle_reduce",
           "grad_sq_norm", "shared_grad", "set_shared_grad", "scale_grads"]


def _trainable(host: StageHost) -> dict[str, torch.Tensor]:
    return {host.spec.prefix + n: p for n, p in host.module.named_parameters() if p.requires_grad}


def _where(host: StageHost) -> str:
    return f"stage {host.spec.index} ({host.spec.name}) on {current().me}"


def begin_merge(pid: int, first_seq: int, count: int, steps: bool = False) -> tuple[bool, bool]:
    """A training step of one pipeline begins: its ``count`` micro-batches from ``first_seq`` on, each
    in its own context; every stage here merges them as their backward leaves it. First: the master
    must say when each micro-batch's whole backward is done, since a stage here may not learn it
    itself (see [Note: a pipeline's merges where its gradients are made] in rpcmp/owner/reduce.py).
    ``steps``: the master asks the owners to take the optimizer step in the backward, after the last merge,
    where they can; second: this process will (see [Note: a step steps where its gradients are made] in
    rpcmp/owner/stepping.py)."""
    hosts = current().hosts_of(pid)
    step = stepper(pid) if steps else None
    for host in hosts:
        params = _trainable(host)
        _drop_last(host)
        host.reduce = StepMerge(params, _where(host), first_seq, count, hook=not host.posts,
                                step=step) if params else None
    return needs_word(hosts), step is not None and any(h.reduce is not None for h in hosts)


def _drop_last(host: StageHost) -> None:
    """What a step that took no optimizer step (failed, or skipped) kept beside its first context."""
    if host.reduce is not None and 0 in host.reduce.contexts:
        drop_beside(host.reduce.contexts[0])


def begin_reduce(pid: int, first_seq: int, count: int) -> bool:
    """A training step of a copy of a replicated pipeline begins (``Job(replicas=R)``): its ``count``
    micro-batches from ``first_seq`` on, each in its own context. True as for :func:`begin_merge`.
    See [Note: the average overlaps the backward] in rpcmp/owner/reduce.py."""
    served = current()
    hosts = served.hosts_of(pid)
    for host in hosts:
        params = _trainable(host)
        if not params:
            continue
        _drop_last(host)
        count_reduce(host)
        group = served.stage_groups[host.spec.index]  # the stage's copies, one per replica
        host.reduce = StepReduce(params, _where(host), group, group.size(), first_seq, count,
                                 hook=not host.posts, stats=running_stats(host.module, host.spec))
    return needs_word(hosts)


def _stepping(pid: int) -> list[StageHost]:
    return [h for h in current().hosts_of(pid) if h.reduce is not None]


def reduce_merged(pid: int, upto: int, contexts: list[int]) -> Failure | bool:
    """The master: micro-batches up to ``upto`` (in ``contexts``) have done their whole backward. True: this
    process took the step's optimizer step in the backward (:class:`StepMerge`)."""
    stepped = False
    for host in _stepping(pid):
        host.reduce.left(upto, contexts)
        if host.reduce.error is not None:
            return Failure.of(str(host.reduce.error), host.reduce.error)
        stepped = stepped or host.reduce.stepped
    return stepped


def average_grads(pid: int, ctx_id: int) -> Failure | None:
    """Average this process's gradients of the step with the copies of its stages (``Job(replicas=R)``:
    see [Note: replicas of a pipeline] in rpcmp/master/replicas.py), into context ``ctx_id``."""
    for host in _stepping(pid):
        try:
            host.reduce.average(ctx_id)
        except StageError as exc:  # see [Note: failures travel as values]
            return Failure.of(str(exc), exc)
    return None


def settle_reduce(pid: int, wait: bool) -> None:
    """A failed step: every stage here takes part in the step's all_reduce (see rpcmp/owner/reduce.py)."""
    for host in _stepping(pid):
        host.reduce.settle(wait)


def grad_sq_norm(pid: int, ctx_id: int, skip: tuple = ()) -> float:
    """Sum of squares of this process's parameter gradients in the context (for global clipping),
    leaving out the names in ``skip`` (copies of a shared parameter counted on another stage)."""
    params = {p: n for p, n in named_params(pid).items() if n not in skip}
    return float(sum(g.double().pow(2).sum() for g in param_grads(params, ctx_id).values()))


def shared_grad(pid: int, index: int, name: str, ctx_id: int) -> torch.Tensor | None:
    """Stage ``index``'s gradient of its parameter ``name`` in the context, or None (see [Note: a
    parameter shared by stages] in rpcmp/master/tied.py)."""
    param = current().host(pid, index).module.get_parameter(name)
    grad = param_grads({param}, ctx_id).get(param)
    return None if grad is None else grad.detach().cpu()


def set_shared_grad(pid: int, index: int, name: str, ctx_id: int, value: torch.Tensor) -> None:
    param = current().host(pid, index).module.get_parameter(name)
    param_grads({param}, ctx_id)[param].copy_(value)


def scale_grads(pid: int, ctx_id: int, scale: float) -> None:
    for g in param_grads(named_params(pid), ctx_id).values():
        g.mul_(scale)
