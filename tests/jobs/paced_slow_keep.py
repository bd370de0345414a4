"""tests/jobs/paced.py whose process takes ``SLOW_KEEP_S`` seconds (in its environment; 0: none) to keep a
neighbour's snapshot of any step after the first: a test kills an owner while a snapshot travels to it."""
import os
import time

import rpcmp.owner.snapshot as snapshot
from paced import job  # noqa: F401

_keep = snapshot.keep
SLOW = float(os.environ.get("SLOW_KEEP_S", "0"))


def _slow_keep(pid, index, step, data):
    if SLOW and step:
        time.sleep(SLOW)
    _keep(pid, index, step, data)


# sent by name over RPC: the receiving process resolves rpcmp.owner.snapshot.keep, patched there too
_slow_keep.__module__, _slow_keep.__qualname__ = snapshot.__name__, "keep"
snapshot.keep = _slow_keep
