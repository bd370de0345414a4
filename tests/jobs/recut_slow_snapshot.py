"""tests/jobs/uneven.py whose processes take 2 s to keep a neighbour's snapshot of step 10 (the one after
``--rebalance``'s first re-cut) and create the file named by SNAPSHOT_FLAG as it arrives: a test kills an
owner while that snapshot travels."""
import os
import time

import rpcmp.owner.snapshot as snapshot
from uneven import job  # noqa: F401

_keep = snapshot.keep


def _slow_keep(pid, index, step, data):
    if step == 10:
        flag = os.environ.get("SNAPSHOT_FLAG", "")
        if flag:
            open(flag, "w").close()
        time.sleep(2)
    _keep(pid, index, step, data)


# sent by name over RPC: the receiving process resolves rpcmp.owner.snapshot.keep, patched there too
_slow_keep.__module__, _slow_keep.__qualname__ = snapshot.__name__, "keep"
snapshot.keep = _slow_keep
