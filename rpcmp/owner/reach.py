"""A stage whose output does not depend on its input through anything differentiable.

[Note: an input the backward never reaches]
Distributed autograd's backward (its FAST mode, the one PyTorch has) waits until every tensor
received over RPC with ``requires_grad`` in the context has had its gradient sent back. A stage whose
training forward reads its input only through ``detach``, a ``torch.no_grad()`` block or an op without
a gradient (``argmax``, a comparison) leaves that message unreached, and the step waited for it
forever: the unsplit model just trains the stages before with no gradient. So the stage's first
training forward looks for each received message in its output's graph (:func:`rpcmp.core.microbatch.unreached`); from
then on, where one is missing, the stage's output takes the received tensors along as inputs of an
identity (:class:`Reach`) that gives them no gradient, and the backward runs through their
``RecvRpcBackward``, which sends zeros. Where nothing the stage before sent is reached, it is told to
send its output detached from then on (:func:`send_detached`): its parameters get no gradient, as in
the unsplit model. One tensor of a message whose other tensors are reached (a gate made from another
value's sign: ``h * (g > 0)``) must not cut the message: the stage before goes on sending the reached
ones with their gradient (told to send detached, it left the stages before it untrained, and a step
waited forever for the value it no longer sent a gradient of). A ``SplitAt`` plan finds such a tensor
on fake tensors (:mod:`rpcmp.plan.unreached`), and the stage before sends it alone detached from the
first step (``StageSpec.detached_values``), as a stage further back does a value it posts to the stage
(``StageSpec.detached_posts``); a ``Split`` or names plan finds it on the meta device
(:func:`rpcmp.plan.writes.meta_findings`). Where neither run can (a forward that reads values) it keeps
its zeros, which leave plain SGD (momentum too) and Adam where no gradient would; weight decay acts on
them.
Where the plan runs the model on the meta device (a ``Split`` or names plan: rpcmp.plan.writes), it
finds such a stage beforehand, and the stage before sends detached from the first step
(``StageSpec.detached``). Otherwise what it sent before it learnt that (the first step) brought zeros
back to it, which leaves plain SGD and Adam where no gradient would (their update of zeros is zero)
but counts as a step for their state and weight decay. A stage that outputs no floating tensor
(``argmax`` codes) has nothing to carry its inputs, and a backward started in the process that sent
them waits for every send it made: with the stage before in the master's process, the step waited
forever. Every plan finds such a stage before the first step (a ``SplitAt`` plan from the traced
graph's output values: :func:`rpcmp.plan.traced.outputs_no_gradient`), and the stage before sends
detached from the start.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed.rpc as rpc

from ..core.microbatch import map_tensors, received, tensors, unreached
from ..core.served import current

__all__ = ["reach", "send_detached", "detach_sent", "Reach", "tie"]

_RECV = "RecvRpcBackward"


def reach(host, x: Any, y: Any) -> Any:
    """Stage ``host``'s training output ``y`` of input ``x``, made to reach every received input in the backward
    where the forward does not; the stage before is told to stop sending one."""
    chain = x[0] if host.mail_in else x  # what the stage before sent (the rest was posted from further back)
    if host.cut is None:  # the stage's first training forward
        nodes = received(x, _RECV)
        missed = unreached(y, nodes) if nodes else []
        host.cut = bool(missed)
        host.cut_chain = bool(missed) and all(n in missed for n in received(chain, _RECV))
    if not host.cut:
        return y
    index = host.spec.index
    if host.cut_chain and index and len(host.owners) >= index and received(chain, _RECV):
        rpc.rpc_async(current().worker(host.owners[index - 1]), send_detached, args=(host.pid, index - 1))
    return tie(y, x)


def detach_sent(host, y: Any, posts: dict | None) -> tuple[Any, dict | None]:
    """What stage ``host`` sends on (``y``) and posts to later stages (``{stage: {name: value}}``), each tensor
    that its reader takes no gradient of detached: the whole output once the next stage said so, the values the
    plan found (``detached_values`` by position, ``detached_posts`` by reader and name)."""
    if host.send_detached and host.next_process is not None:
        y = map_tensors(y, torch.Tensor.detach)
    elif host.detached_values and host.next_process is not None:
        at = itertools.count()
        y = map_tensors(y, lambda t: t.detach() if next(at) in host.detached_values else t)
    if posts and host.detached_posts:
        posts = {j: {name: map_tensors(v, torch.Tensor.detach) if (j, name) in host.detached_posts else v
                     for name, v in values.items()} for j, values in posts.items()}
    return y, posts


def send_detached(pid: int, index: int) -> None:
    """The next stage takes no gradient of stage ``index``'s output: send it without one (an RPC endpoint)."""
    host = current().hosts.get((pid, index))
    if host is not None:
        host.send_detached = True


class Reach(torch.autograd.Function):
    """``y`` itself; its backward reaches ``inputs`` with no gradient (see [Note: an input the backward ...])."""

    @staticmethod
    def forward(ctx, y, *inputs):
        ctx.inputs = len(inputs)
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * ctx.inputs


def tie(y: Any, x: Any) -> Any:
    """``y`` with its first floating tensor made to carry the received tensors of ``x`` into the backward."""
    inputs = [t for t in tensors(x) if t.requires_grad and t.grad_fn is not None and _RECV in t.grad_fn.name()]
    first = next((t for t in tensors(y) if t.is_floating_point()), None)
    if not inputs or first is None:
        return y
    tied = Reach.apply(first, *inputs)
    return map_tensors(y, lambda t: tied if t is first else t)
