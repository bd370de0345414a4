"""tests/jobs/mlp.py where the process ``STRAY_ON`` names (in the environment) has its RPC listener reached by a
connection that closes at once, as a port scan's does, once it has joined the RPC world and before the others open
their pipes (they wait for it): its listener stops, as TensorPipe's does, and the run has to end at its start."""
import os
import socket
import time

import torch.distributed.rpc as rpc

import rpcmp.launch.runtime as runtime
from mlp import job  # noqa: F401 - the job
from rpcmp.core.store import launch_store

_real = runtime.open_pipes


def _listening_ports() -> list[int]:
    """The TCP ports this process listens on (its TensorPipe listener's)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return [int(f[1].split(":")[1], 16) for f in (line.split() for line in open("/proc/self/net/tcp").read().splitlines()[1:])
            if f[3] == "0A" and f[9] in inodes]


def _open_pipes(processes, timeout=20.0):
    store = launch_store(60)
    if rpc.get_worker_info().name == os.environ.get("STRAY_ON"):
        for port in _listening_ports():
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        time.sleep(0.5)  # the listener has met the closed connection
        store.set("stray/done", "1")
    else:
        store.wait(["stray/done"])
    return _real(processes, timeout)


runtime.open_pipes = _open_pipes
