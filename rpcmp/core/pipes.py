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
are open; the pipes to a lost process close with it, and nobody connects to it again.

A connection that breaks off while the world forms (its first second) can stop a listener before every
pipe to that process is open. The run cannot go on then (nobody can open the missing pipes), and it used to
end at the first call that needed one, with a bare "ECONNREFUSED" traceback. A refused pipe reads the same
whether its process is alive with its listener stopped or dead (a dead one is the spares' to replace: see
[Note: an owner lost while the stages build] in rpcmp/master/building.py). So each process, its pipes
opened, keeps which processes refused it, and the master asks every process for its list over its own
pipe, opened as ``init_rpc`` gathered the world (:func:`check_refused`); it ends the run before anything is
built when a process that answers was refused by another: saying which, why, and to run it again. A process
that does not answer (dead or hung) is not judged: the stages' build meets it. A refusal inside ``init_rpc`` itself, which torch reports as "timed
out in _all_gather after 1800 seconds" at once, is said the same way (rpcmp/launch/runtime.py, ``_init_rpc``).
"""
from __future__ import annotations

import resource
import threading

import torch
import torch.distributed.rpc as rpc

from ..errors import NetworkError
from .served import current

__all__ = ["open_pipes", "check_refused"]

_FDS_PER_PEER = 8  # measured: about 7 per pair in a process (its pipe to the peer and the peer's to it)


def _nothing() -> None:
    return None


def open_pipes(processes: list[str], timeout: float = 20.0) -> None:
    """Open a pipe from this process to each of ``processes``, itself included (a call it makes to itself by RPC
    goes through one too), waiting at most ``timeout`` seconds in all (see [Note: pipes opened before a peer can die
    mid-handshake]); keep those that refused the connection for :func:`check_refused`. A call that fails otherwise
    or does not answer is not this one's to report: the call that needs that process finds it lost."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 256 + _FDS_PER_PEER * len(processes)
    if soft != resource.RLIM_INFINITY and soft < need:  # 1024 by default: about 100 peers
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))
    done = threading.Event()
    calls = [rpc.rpc_async(p, _nothing, timeout=timeout) for p in processes]
    torch.futures.collect_all(calls).add_done_callback(lambda _: done.set())
    done.wait(timeout)
    served = current()
    served.refused = [p for p, call in zip(processes, calls) if call.done() and _refused(call)]
    served.pipes_open.set()


def _refused(call: torch.futures.Future) -> bool:
    try:
        call.wait()
    except Exception as exc:  # noqa: BLE001 - only a refused connection is looked at
        return "ECONNREFUSED" in str(exc)
    return False


def refused_here(timeout: float) -> list[str] | None:
    """The processes that refused this one's pipes, once it has opened them (None: not within ``timeout`` s)."""
    served = current()
    return list(served.refused) if served.pipes_open.wait(timeout) else None


def check_refused(processes: list[str], timeout: float = 10.0) -> None:
    """On the master, once its own pipes are open: raise :class:`NetworkError` when a process that answers was
    refused by another (its listener stopped as the world formed; see the Note above). One that does not answer
    within ``timeout`` seconds is lost or hung: the stages' build meets it (with spares, replaces it)."""
    me = rpc.get_worker_info().name
    asked = {p: rpc.rpc_async(p, refused_here, args=(timeout,), timeout=timeout + 5) for p in processes if p != me}
    said = {me: refused_here(timeout)}
    for p, call in asked.items():
        try:
            said[p] = call.wait()
        except Exception:  # noqa: BLE001 - not answering, whatever the reason
            continue
    pairs = [(p, q) for p, refused in said.items() if refused is not None for q in refused
             if said.get(q) is not None]
    if pairs:
        where = "; ".join(f"{p} could not connect to {'itself' if q == p else q}" for p, q in pairs)
        raise NetworkError(
            f"the run's processes could not all connect as it started ({where}, connection refused), although "
            f"{', '.join(sorted({q for _, q in pairs}))} is running: TensorPipe stops listening for good when a "
            f"connection to it closes before its first message, so something reached that port and left while the run "
            f"started (a port scan, a health probe, a process that died while it connected). Nothing was built or "
            f"trained: run it again; if this recurs, keep scanners and probes off the run's ports")
