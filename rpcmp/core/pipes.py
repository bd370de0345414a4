"""The pipes a pipeline may need, opened while its stages build.

[Note: pipes opened before a peer can die mid-handshake]
TensorPipe's listener stops for good when a connection it accepted closes before its first message: the
peer died while it connected (killed, out of memory), or anything else reached the port and left (a port
scan, a health probe). From then on every new connection to that process is refused (ECONNREFUSED, from
transport/uv/connection_impl.cc), while the pipes already open go on working. A spare that takes over a
lost stage connects to the lost owner's neighbours and to the buddy holding its snapshot, often for the
first time, and so does an owner whose neighbour moved (a re-cut, a rebalance): where a process had died
while it connected to one of them, the recovery failed with "connection refused" and the run ended (a spare
killed while it took over, on a busy machine). So while the stages build, each of a pipeline's owners, the
spares and the master opens a pipe to every other one (a no-op call each): about 50 ms for 8 processes and
160 ms for 16, all at once, and seven file descriptors per pair. Later, a loss or a stray connection meets
pipes that are open. Pipes to a process that is lost close with it, and nobody connects to it again. What
this cannot cover: a process that dies while these pipes open (in the first tens of milliseconds of the
build), and the copies of a replicated pipeline, which reach each other through their groups, not RPC.
"""
from __future__ import annotations

import torch.distributed.rpc as rpc

from .served import current

__all__ = ["open_pipes"]


def _nothing() -> None:
    return None


def _open(peers: list[str], timeout: float) -> None:
    """Open a pipe from this process to each of ``peers``. A peer lost meanwhile is not this call's to report:
    the call that needs it finds it lost."""
    served = current()
    futs = [rpc.rpc_async(served.worker(p), _nothing, timeout=timeout) for p in peers if p != served.me]
    for fut in futs:
        try:
            fut.wait()
        except Exception:  # noqa: BLE001 - see the docstring
            pass


def open_pipes(processes, timeout: float) -> None:
    """Have each of ``processes`` (this one among them, or not) open a pipe to every other one, without waiting for
    it (see [Note: pipes opened before a peer can die mid-handshake]); each call gives up after ``timeout``."""
    served = current()
    names = sorted(set(processes) - served.lost)
    for name in names:
        if name == served.me:
            for peer in names:
                if peer != name:
                    rpc.rpc_async(served.worker(peer), _nothing, timeout=timeout)
        else:
            rpc.rpc_async(served.worker(name), _open, args=(names, timeout), timeout=2 * timeout)
