"""The master's side of the wire: micro-batches go to the first stage's owner, the last
stage's output comes back here (the owner's side is :mod:`rpcmp.owner.stage`; see [Note: why
activations skip the master] there). The outputs wait in the process's
:class:`rpcmp.core.served.Awaited`."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed.rpc as rpc

from ..owner import stage
from ..core.failure import Failure
from ..core.microbatch import compact
from ..core.served import current

__all__ = ["send", "deliver", "abandon", "cancel"]


def send(pid: int, seq: int, first: str, x: Any, grad: bool, owners: list[str], alone: bool = False,
         steps: bool = False) -> torch.futures.Future:
    """On the master: start micro-batch ``seq`` at the first stage's owner ``first``.

    The returned future completes with the last stage's output the moment :func:`deliver`
    brings it, or with the first error of the chain. Each ``forward`` answers its caller
    only when the rest of the chain has answered it (that is how an error travels back), so
    waiting for the chain's own future would add a one-way trip per stage after the output
    has arrived; see [Note: why activations skip the master]. If the chain fails, every
    stage (``owners[k]`` holds stage k) is told to skip ``seq``, so that the stages after
    the failure do not wait for it with later micro-batches. ``alone``: ``seq`` is its step's only
    micro-batch (each stage runs it on the RPC thread that receives it). ``steps``: the owners take the optimizer
    step in its backward where they can, and the future's value is ``(output, the owners that will)`` (see [Note: a
    step steps where its gradients are made] in rpcmp/owner/stepping.py).
    """
    served = current()
    awaited = served.inbox
    out = awaited.expect((pid, seq))

    def failed(chain: torch.futures.Future) -> None:
        try:
            value = chain.wait()
        except Exception as exc:  # noqa: BLE001 - a transport error: handed to the waiting master
            error = exc
        else:
            if not isinstance(value, Failure):
                return
            error = value.error()
        awaited.settle((pid, seq), error)
        for index, owner in enumerate(owners):
            try:
                rpc.rpc_async(owner, stage.skip, args=(pid, index, seq))
            except Exception:  # noqa: BLE001 - an owner that is gone has nothing to skip
                pass
    args = (pid, 0, seq, compact(x), grad, alone) + (((),) if steps else ())
    rpc.rpc_async(served.worker(first), stage.forward, args=args).add_done_callback(failed)
    return out


def deliver(pid: int, seq: int, y: Any, stepped: tuple | None = None) -> None:
    """The last stage's output (called by its owner over RPC, or directly when it is the master); with the owners
    that take the step in its backward, when the master asked for that (:func:`send`)."""
    current().inbox.settle((pid, seq), y if stepped is None else (y, stepped))


def abandon(pid: int, seqs: list[int]) -> None:
    """A failed step gives up the outputs it still waits for."""
    current().inbox.drop([(pid, seq) for seq in seqs])


def cancel(pid: int, seqs: list[int], owners: list[str]) -> None:
    """A step failed: every owner drops the micro-batches ``seqs`` that have not started on it (fire and
    forget, as :func:`send` tells owners to skip: an owner that is gone has nothing to drop, and the step
    waits for what did start)."""
    for owner in sorted(set(owners)):
        try:
            rpc.rpc_async(owner, stage.cancel, args=(pid, seqs))
        except Exception:  # noqa: BLE001 - an owner that is gone
            pass
