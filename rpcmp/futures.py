"""Waiting on RPC futures: every one settles before the first error is raised."""
from __future__ import annotations

__all__ = ["wait_all"]


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
