"""Waiting on RPC futures: every one settles before the first error is raised, typed."""
from __future__ import annotations

from .errors import StageError

__all__ = ["wait_all", "unwrap"]


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
        raise unwrap(error)
    return results


def unwrap(exc: Exception) -> Exception:
    """RPC re-raises remote errors with the remote traceback in the message; keep it, type it."""
    if isinstance(exc, StageError):
        return exc
    text = str(exc)
    if "StageError" in text or "stage " in text:
        return StageError(text)
    return exc
