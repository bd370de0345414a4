"""tests/jobs/uneven.py whose processes take 4 s to keep a neighbour's snapshot of the first re-cut's pipeline (id
1: ``--rebalance``'s first re-cut, after step 10 as a rule, later where a busy machine's figures did not show the
gain then) and create the file named by SNAPSHOT_FLAG as it arrives: a test kills an owner while that snapshot
travels. The periodic snapshots, of the first pipeline (id 0), and those of later re-cuts keep as they would."""
import os
import time

import rpcmp.owner.snapshot as snapshot
from uneven import job  # noqa: F401

_keep = snapshot.keep


def _slow_keep(pid, index, step, data):
    flag = os.environ.get("SNAPSHOT_FLAG", "")
    if pid == 1 and flag:  # every copy of it: the owner the test kills waits for its own as well
        open(flag, "a").close()
        time.sleep(4)  # the window the test kills in, on a busy machine too
    _keep(pid, index, step, data)


# sent by name over RPC: the receiving process resolves rpcmp.owner.snapshot.keep, patched there too
_slow_keep.__module__, _slow_keep.__qualname__ = snapshot.__name__, "keep"
snapshot.keep = _slow_keep
