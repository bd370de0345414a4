"""Waiting on RPC futures: every one settles before the first error is raised."""
from __future__ import annotations

from .failure import Failure

__all__ = ["wait_all", "raise_failures"]


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
