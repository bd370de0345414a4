"""Waiting on RPC futures: every one settles before the first error is raised; and one call on
each of several processes, this one included."""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed.rpc as rpc

from .failure import Failure
from .served import current

__all__ = ["wait_all", "raise_failures", "call_each"]


def wait_all(futs) -> list:
    """Wait for every future; raise the first error after all have settled."""
    results, error = [], None
    for fut in futs:
        try:
            results.append(fut.wait())
        except Exception as exc:  # noqa: BLE001 - re-raised below
            results.append(None)
            error = error or exc
    if error is not None:
        raise error
    return results


def raise_failures(results: list) -> list:
    """``results``, unless one is a :class:`~rpcmp.core.failure.Failure` (see [Note: failures travel as
    values]): then the first one's error is raised."""
    failed = [r for r in results if isinstance(r, Failure)]
    if failed:
        raise failed[0].error()
    return results


def call_each(processes, fn, args: tuple | Callable[[str], tuple] = ()) -> list[Any]:
    """``fn(*args)`` on each of ``processes`` (``args(process)``: each its own), the results in their order:
    by RPC on the others, by a plain call on this one (an RPC to itself costs two messages and a hop through
    its RPC threads for nothing). The RPCs leave first, so a call here that waits for the others (an
    ``all_reduce``) does not wait for calls not yet sent; every call settles before the first error is raised,
    as in :func:`wait_all`."""
    if not processes:
        return []
    served = current()
    me = served.me
    args_of = args if callable(args) else (lambda _: args)
    futs = {p: rpc.rpc_async(served.worker(p), fn, args=args_of(p)) for p in processes if p != me}
    here, error = None, None
    if me in processes:
        try:
            here = fn(*args_of(me))
        except Exception as exc:  # noqa: BLE001 - raised once the others have settled
            error = exc
    try:
        there = dict(zip(futs, wait_all(futs.values())))
    except Exception as exc:  # noqa: BLE001 - this process's error first: it happened here
        raise error or exc
    if error is not None:
        raise error
    return [here if p == me else there[p] for p in processes]
