"""tests/jobs/mlp.py whose master, once it has told the workers that the run ended, creates the file
named by ENDS_FLAG and waits 3 s before its own shutdown: the workers wait in the shutdown's barrier
meanwhile, where a test can kill one."""
import os
import time

import rpcmp.launch.ending as ending
from mlp import job  # noqa: F401

_tell = ending._tell_outcome


def _tell_then_linger(workers, ok, graceful=True):
    told = _tell(workers, ok, graceful)
    flag = os.environ.get("ENDS_FLAG", "")
    if flag and graceful:
        open(flag, "w").close()
        time.sleep(3)
    return told


ending._tell_outcome = _tell_then_linger
