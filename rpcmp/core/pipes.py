"""Every pipe of a run's RPC world, opened as the world forms.

[Note: pipes opened before a peer can die mid-handshake]
TensorPipe's listener stops for good when a connection it accepted closes before its first message: the
peer died while it connected (killed, out of memory), or anything else reached the port and left (a port
scan, a health probe). From then on every new connection to that process is refused (ECONNREFUSED, from
transport/uv/connection_impl.cc), while the pipes already open go on working. A pipe opens on a process's
first call to a peer, and many first calls come late: a spare's, when it takes over a lost stage (to the
lost owner's neighbours, to the buddy holding its snapshot), an owner's whose neighbour moved (a re-cut, a
rebalance), every owner's at the first step. Where a process had died while it connected to one of them, or
a stray connection had reached one, the run ended with "connection refused" at the next such call (a spare
killed while it took over, on a busy machine; a port scan during the master's trace ended the first step).
So each process, once it has joined the RPC world, opens a pipe to every process, itself included (a call a
process makes to itself by RPC goes through its own listener: a re-cut's gather of a stage it keeps), with a
no-op call each, all at once, waited for: about 50 ms for 8 processes and 160 ms for 16, seven file
descriptors per pair, as a gloo group connects every pair of ranks when it forms. Later, a loss or a stray connection meets pipes that
are open; the pipes to a lost process close with it, and nobody connects to it again. Not covered: a
connection that breaks off while the world forms (the first second of a run).
"""
from __future__ import annotations

import resource
import threading

import torch
import torch.distributed.rpc as rpc

__all__ = ["open_pipes"]

_FDS_PER_PEER = 8  # measured: about 7 per pair in a process (its pipe to the peer and the peer's to it)


def _nothing() -> None:
    return None


def open_pipes(processes: list[str], timeout: float = 20.0) -> None:
    """Open a pipe from this process to each of ``processes``, itself included (a call it makes to itself by RPC
    goes through one too), waiting at most ``timeout`` seconds in all (see [Note: pipes opened before a peer can die
    mid-handshake]). A call that fails or does not answer is not this one's to report: the call that needs that
    process finds it lost."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 256 + _FDS_PER_PEER * len(processes)
    if soft != resource.RLIM_INFINITY and soft < need:  # 1024 by default: about 100 peers
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))
    done = threading.Event()
    torch.futures.collect_all([rpc.rpc_async(p, _nothing, timeout=timeout) for p in processes]).add_done_callback(
        lambda _: done.set())
    done.wait(timeout)
