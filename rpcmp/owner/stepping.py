"""The optimizer step on an owner: asked for by the master after a step's backward (:func:`local_step`), or
taken in the backward itself (:func:`arm` for a step of one micro-batch; :class:`rpcmp.owner.reduce.StepMerge`
after the last merge of several).

[Note: a step steps where its gradients are made]
A step's optimizer step used to wait for the whole backward on the master and then ask every owner by RPC:
the last stage's update waited for the first stage's backward, and the whole step for one round trip and
every owner's update after it (the bench MLP at M = 1: 5.8 ms of a 199 ms step). ``torch.distributed.pipelining``
steps each rank when its own backward is over. So does rpcmp now, when nothing between the backward and the
update needs every stage's gradients: one pipeline (not a copy of R: the copies average first), no clipping by
the global norm and no fp16 loss scaling (both read every gradient), no parameter shared by two stages (its
gradients are summed first), and a loss per micro-batch (gpipe's gathered loss is not). It is taken by each owner
whose stage learns by itself when its part of a backward is over (the same test as for the merges: one stage of
the pipeline here, not one that posts values, not a stage of the master's other than the last; a CPU stage, since
a GPU stage's update would run on the autograd engine's thread): :func:`stepper`.

- The step's only micro-batch (M = 1): the master asks in the forward message (``steps``); each owner that can
  hooks its output as :class:`StepMerge` does and, when the output's gradient arrives, queues its local
  optimizer's step on the autograd engine, which runs it once this process's part of the backward is over,
  every gradient of the stage in the context. Each owner that armed adds its name to the message, and the last
  stage hands the names to the master with its output, so the master asks only the others after the backward.
- Several (M > 1): the master asks as the step begins (:func:`rpcmp.owner.grads.begin_merge`, which says whether
  this process will); the owner's :class:`StepMerge` takes the step on the engine's thread right after the last
  merge, when every micro-batch's backward has left the stage (not when the master's word merged any of them:
  one whose output took no gradient), and says so in its answer to the master's word on the last micro-batch.

An owner answers its part of a backward only after its callbacks ran, so the master's ``backward`` returns with
every such update taken: the last stage's ran while the stages before it still computed, the first stage's right
after its own backward, with no round trip; the master asks only the others.

The numbers are the same (the same gradients, the same local optimizer). What moves: the master checks each
loss (``Job.nonfinite``) before its backward instead of the step's after the last one, once a step, and a loss
that ``nonfinite="skip"`` skips has no backward at all (so no owner completes its merges by the backward, and
none steps); and a step that fails in the backward after a later stage stepped leaves that stage updated, where
before it left every stage as it was. A failed step ends the run, or rolls every stage back to a snapshot
(``Job(spares=K)``), so neither is a model a run goes on with. Measured, the step switched on and off in
alternating blocks in one launch of the bench MLP: about 1 % at M = 1, 3-4 % at M = 8 (benchmarks/PERFORMANCE.md).
"""
from __future__ import annotations

import threading
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim.optimizer import _LocalOptimizer
from torch.distributed.optim.utils import functional_optim_map

from ..core.microbatch import tensors
from ..core.served import current
from ..plan.placement import MASTER
from .reduce import drop_beside, param_grads

__all__ = ["local_step", "arm", "stepper", "cancel", "needs_word"]

_FUNCTIONAL = tuple(functional_optim_map.values())


def needs_word(hosts: list) -> bool:
    """Whether the stages here may not learn by themselves that a micro-batch's backward is over on this process:
    two stages here, a posting stage, or a stage of the master's that is not the last (see [Note: the average
    overlaps the backward] in rpcmp/owner/reduce.py)."""
    return (len(hosts) > 1 or any(h.posts for h in hosts)
            or any(h.place.process == MASTER and h.next_process is not None for h in hosts))


def local_step(optim_rref, ctx_id: int, functional: bool | None = None) -> None:
    """A local optimizer's step on context ``ctx_id``'s gradients and those kept beside it (see [Note: a
    parameter the first micro-batch did not reach] in rpcmp/owner/reduce.py), which it lets go: a functional
    optimizer is handed them, None where a parameter has none; a torch.optim one finds them in ``.grad``, None
    where a parameter has none, and None again after the step (see [Note: a parameter a step did not reach]
    in rpcmp/master/move.py). ``optim_rref``: the RRef of the master's calls, or the local optimizer itself."""
    local = optim_rref.local_value() if isinstance(optim_rref, rpc.PyRRef) else optim_rref
    if functional is None:
        functional = isinstance(local.optim, _FUNCTIONAL)
    params = local._local_params
    got = param_grads(set(params), ctx_id)
    try:
        if functional:
            local.optim.step([got.get(p) for p in params])
            return
        with _LocalOptimizer.global_lock:  # as torch's own step: one step at a time on this process
            for p in params:
                p.grad = got.get(p)
            try:
                local.optim.step()
            finally:
                for p in params:
                    p.grad = None
    finally:
        drop_beside(ctx_id, params)


class _Gate:
    """The steps a process takes in the backward of pipeline ``pid``'s steps, and the rollbacks that cancel them."""

    def __init__(self):
        self.lock = threading.Lock()
        self.era = 0  # a rollback begins a new one: a step armed before it is not taken


def stepper(pid: int) -> Callable[[int], None] | None:
    """This process's local optimizer step of pipeline ``pid`` on a context's gradients, where it may be taken in
    the backward: a local optimizer here, one stage that learns by itself when its part of a micro-batch's backward
    is over (not :func:`needs_word`), on the CPU. None: the master asks for the step after the backward.

    A step that failed may still take it here after the master has rolled the stage back (another owner lost while
    this one's backward ran, the rollback arriving before the engine's callback): :func:`cancel` makes such a step
    a no-op, or waits for one being taken, so that the snapshot's values are the stage's."""
    served = current()
    local, hosts = served.optimizers.get(pid), served.hosts_of(pid)
    if local is None or not hosts or needs_word(hosts) or hosts[0].device.type != "cpu":  # needs_word: one host
        return None
    gate = served.step_gates.setdefault(pid, _Gate())
    era = gate.era

    def step(ctx_id: int) -> None:
        with gate.lock:
            if gate.era == era:
                local_step(local, ctx_id)
    return step


def cancel(pid: int) -> None:
    """A rollback of pipeline ``pid``'s stages here begins: no step armed before it is taken from now on, and one
    being taken is over (see :func:`stepper`)."""
    gate = current().step_gates.get(pid)
    if gate is not None:
        with gate.lock:
            gate.era += 1


def arm(pid: int, output: Any) -> bool:
    """The step's only micro-batch left a stage of pipeline ``pid`` here as ``output``, and the master asks the
    owners to step in its backward: hook the output so that this process's local optimizer steps once its part
    of the backward is over. True: armed, this process steps itself (see the Note above). A step of M > 1
    micro-batches steps after its last merge instead (:class:`rpcmp.owner.reduce.StepMerge`)."""
    step = stepper(pid)
    needing = [t for t in tensors(output) if t.requires_grad]
    if step is None or not needing:
        return False
    ctx_id = dist_autograd._current_context()._context_id()
    queued = []

    def arrived(grad: torch.Tensor) -> None:
        if not queued:  # one step, however many of the outputs take a gradient
            queued.append(True)
            torch.autograd.Variable._execution_engine.queue_callback(partial(step, ctx_id))
    for t in needing:
        t.register_hook(arrived)
    return True
