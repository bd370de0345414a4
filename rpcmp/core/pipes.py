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
spares and the master opens a pipe to every other one (a no-op call each; about 50 ms for 8 processes and
160 ms for 16, all at once, and seven file descriptors per pair), and the first step waits for them (for 20 s
at most: a process stopped then is left to the watchdog). Later, a loss or a stray connection meets pipes
that are open. Pipes to a process that is lost close with it, and nobody connects to it again. What
this cannot cover: a process that dies while these pipes open (in the first tens of milliseconds of the
build), and the copies of a replicated pipeline, which reach each other through their groups, not RPC.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed.rpc as rpc

from .served import current

__all__ = ["open_pipes", "settle"]


def _nothing() -> None:
    return None


def _open(peers: list[str], timeout: float) -> None:
    """Open a pipe from this process to each of ``peers``, waiting up to ``timeout`` for each."""
    served = current()
    settle([rpc.rpc_async(served.worker(p), _nothing, timeout=timeout) for p in peers if p != served.me], timeout)


def open_pipes(processes, timeout: float = 10.0) -> list[torch.futures.Future]:
    """Have each of ``processes`` (this one among them, or not) open a pipe to every other one (see [Note: pipes
    opened before a peer can die mid-handshake]); the calls, to wait for with :func:`settle`. A process that does
    not answer within ``timeout`` seconds (stopped, or lost) is left to the calls that need it."""
    served = current()
    names = sorted(set(processes) - served.lost)
    futs = []
    for name in names:
        if name == served.me:
            futs += [rpc.rpc_async(served.worker(peer), _nothing, timeout=timeout) for peer in names if peer != name]
        else:
            futs.append(rpc.rpc_async(served.worker(name), _open, args=(names, timeout), timeout=2 * timeout))
    return futs


def settle(futs: list[torch.futures.Future], within: float) -> None:
    """Wait for ``futs`` to end, however they end, for at most ``within`` seconds: a call that failed or did not
    answer is not theirs to report (the call that needs the process finds it lost)."""
    if futs:
        done = threading.Event()
        torch.futures.collect_all(futs).add_done_callback(lambda _: done.set())
        done.wait(within)
