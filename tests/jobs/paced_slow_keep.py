"""tests/jobs/paced.py whose process takes ``SLOW_KEEP_S`` seconds (in its environment; 0: none) to keep a
neighbour's snapshot of any step after the first: a test kills an owner while a snapshot travels to it.
``SLOW_KEEP_ON`` (a process name) and ``SLOW_KEEP_AT`` (a step): only that process, only that step;
``SLOW_KEEP_UNTIL`` (a path): held until that file exists (at most 120 s) instead, and only the first time."""
import os
import time

import rpcmp.owner.snapshot as snapshot
from rpcmp.core.served import current
from paced import job  # noqa: F401

_keep = snapshot.keep
SLOW = float(os.environ.get("SLOW_KEEP_S", "0"))
ON, AT, UNTIL = os.environ.get("SLOW_KEEP_ON"), os.environ.get("SLOW_KEEP_AT"), os.environ.get("SLOW_KEEP_UNTIL")


def _slow_keep(pid, index, step, data):
    global UNTIL
    if (SLOW or UNTIL) and step and (AT is None or step == int(AT)) and (ON is None or current().me == ON):
        deadline, until = time.monotonic() + (SLOW or 120), UNTIL
        UNTIL = None if until else UNTIL  # held once: a later keep of that step (after a recovery) is not
        while time.monotonic() < deadline and not (until and os.path.exists(until)):
            time.sleep(0.01)
    _keep(pid, index, step, data)


# sent by name over RPC: the receiving process resolves rpcmp.owner.snapshot.keep, patched there too
_slow_keep.__module__, _slow_keep.__qualname__ = snapshot.__name__, "keep"
snapshot.keep = _slow_keep
