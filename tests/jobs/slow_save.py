"""The MLP job whose checkpoint writes take longer than DDP's collective timeout
(Job.rpc_timeout, lowered to 3 s here, so that the test is quick)."""
import time

import rpcmp.train.trainer
from mlp import job

job.rpc_timeout = 3.0
job.hang_timeout = 2.0
_write = rpcmp.train.trainer._write


def _slow_write(*args, **kwargs):
    time.sleep(6)
    return _write(*args, **kwargs)


rpcmp.train.trainer._write = _slow_write
