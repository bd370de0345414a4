"""The master's side of the wire: micro-batches go to the first stage's owner, the last
stage's output comes back here (the owner's side is :mod:`rpcmp.stage`; see [Note: why
activations skip the master] there)."""
from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed.rpc as rpc

from . import stage as _stage
from .failure import Failure

__all__ = ["send", "deliver", "abandon", "clear"]

_INBOX: dict[tuple[int, int], torch.futures.Future] = {}  # (pipeline id, seq) -> its output
_LOCK = threading.Lock()


def clear() -> None:
    """A new RPC world in this process: nothing is awaited."""
    with _LOCK:
        _INBOX.clear()


def send(pid: int, seq: int, first: str, x: Any, grad: bool, owners: list[str]) -> torch.futures.Future:
    """On the master: start micro-batch ``seq`` at the first stage's owner ``first``.

    The returned future completes with the last stage's output the moment :func:`deliver`
    brings it, or with the first error of the chain. Each ``_forward`` answers its caller
    only when the rest of the chain has answered it (that is how an error travels back), so
    waiting for the chain's own future would add a one-way trip per stage after the output
    has arrived; see [Note: why activations skip the master]. If the chain fails, every
    stage (``owners[k]`` holds stage k) is told to skip ``seq``, so that the stages after
    the failure do not wait for it with later micro-batches.
    """
    out = torch.futures.Future()
    with _LOCK:
        _INBOX[(pid, seq)] = out

    def failed(chain: torch.futures.Future) -> None:
        try:
            value = chain.wait()
        except Exception as exc:  # noqa: BLE001 - a transport error: handed to the waiting master
            error = exc
        else:
            if not isinstance(value, Failure):
                return
            error = value.error()
        _settle(pid, seq, error)
        for index, owner in enumerate(owners):
            try:
                rpc.rpc_async(owner, _stage._skip, args=(pid, index, seq))
            except Exception:  # noqa: BLE001 - an owner that is gone has nothing to skip
                pass
    rpc.rpc_async(first, _stage._forward, args=(pid, 0, seq, x, grad)).add_done_callback(failed)
    return out


def _settle(pid: int, seq: int, value: Any) -> None:
    with _LOCK:
        out = _INBOX.pop((pid, seq), None)
    if out is None:  # delivered already (a later error in the answers back) or abandoned
        return
    if isinstance(value, Exception):
        out.set_exception(value)
    else:
        out.set_result(value)


def deliver(pid: int, seq: int, y: Any) -> None:
    """Called by the last stage's owner (over RPC, or directly when it is the master)."""
    _settle(pid, seq, y)


def abandon(pid: int, seqs: list[int]) -> None:
    """A failed step gives up the outputs it still waits for."""
    with _LOCK:
        for seq in seqs:
            _INBOX.pop((pid, seq), None)
