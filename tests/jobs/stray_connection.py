"""tests/jobs/mlp.py where the process ``STRAY_ON`` names (in the environment) has its RPC listener reached by a
connection that closes at once, as a port scan's does, once it has joined the RPC world and before the others open
their pipes (they wait for it): its listener stops, as TensorPipe's does, and the run has to end at its start."""
import os
import sys
import time

import torch.distributed.rpc as rpc

import rpcmp.launch.runtime as runtime
from mlp import job  # noqa: F401 - the job
from rpcmp.core.store import launch_store

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers
from helpers import half_open  # noqa: E402 - after the path

_real = runtime.open_pipes


def _open_pipes(processes, timeout=20.0):
    store = launch_store(60)
    if rpc.get_worker_info().name == os.environ.get("STRAY_ON"):
        half_open(os.getpid())  # its own RPC listener, as a port scan would
        time.sleep(0.5)  # the listener has met the closed connection
        store.set("stray/done", "1")
    else:
        store.wait(["stray/done"])
    return _real(processes, timeout)


runtime.open_pipes = _open_pipes
