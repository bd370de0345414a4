"""Worker daemons: started once per node, they serve one job after another.

    rpcmp worker --master 10.0.0.1:29500 --rank 1 --token-file /etc/rpcmp/token   # each worker node
    rpcmp run job.py --workers 2 --listen 10.0.0.1:29500 --token-file /etc/rpcmp/token  # the master

[Note: how a daemon joins a job]
The master publishes the job (its id, world size, the job file and the ``.py`` files
beside it, the overrides) on a small TCP store at PORT + 1, bytes only, nothing
unpickled. A daemon sends a fresh random challenge; the master answers with
HMAC-SHA256(token, challenge); a daemon whose token gives another answer refuses the
job and keeps waiting, so it never runs a stranger's code. It then starts a fresh
child process for the job (``run_rank`` with the job's rank and world size, RPC on
PORT) and, when the job ends or its master dies, waits for the next one. SIGTERM stops
the child and the daemon.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from .errors import JobError
from .network import NetworkError, bound_store, port_free

__all__ = ["serve_forever", "publish_job"]

_KEY = "rpcmp/job"


def _answer(token: str, challenge: str) -> str:
    return hmac.new(token.encode(), challenge.encode(), hashlib.sha256).hexdigest()


def read_token(token: str | None, token_file: str | None) -> str:
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
    token = token or os.environ.get("RPCMP_TOKEN")
    if not token:
        raise JobError("a job token is required: --token-file FILE (or RPCMP_TOKEN); the master and its "
                       "daemons must share it")
    return token


# -- master side ---------------------------------------------------------------------
def publish_job(job_file: str, workers: int, host: str, port: int, token: str, overrides: dict | None,
                join_timeout: float) -> object:
    """Offer the job to ``workers`` daemons and wait until all have joined; return the store."""
    for p in (port, port + 1):
        port_free(host, p)
    rendezvous = bound_store(host, port)  # the RPC rendezvous, on `host` only
    store = bound_store(host, port + 1)
    job_id = uuid.uuid4().hex
    folder = os.path.dirname(os.path.abspath(job_file))
    files = {n: base64.b64encode(open(os.path.join(folder, n), "rb").read()).decode()
             for n in os.listdir(folder) if n.endswith(".py")}
    store.set(_KEY, json.dumps({"id": job_id, "world_size": workers + 1, "job": os.path.basename(job_file),
                                "files": files, "overrides": overrides or {}, "rpc_port": port}))

    # One loop answers every challenge: a TCPStore client is one socket, so no concurrent waits.
    deadline, answered = time.monotonic() + join_timeout, set()
    ranks = range(1, workers + 1)
    while True:
        for r in ranks:
            if r not in answered and store.check([f"{job_id}/challenge/{r}"]):
                store.set(f"{job_id}/response/{r}", _answer(token, store.get(f"{job_id}/challenge/{r}").decode()))
                answered.add(r)
        missing = [r for r in ranks if not store.check([f"{job_id}/ready/{r}"])]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise NetworkError(
                f"worker daemons of rank {missing} did not join within {join_timeout:.0f}s: is `rpcmp worker "
                f"--master {host}:{port} --rank R` running on their nodes, with the same token?")
        time.sleep(0.05)
    return store, rendezvous


# -- daemon side -------------------------------------------------------------------------
def serve_forever(master: str, rank: int, token: str, poll: float = 1.0) -> None:
    """Wait for jobs from ``master`` (HOST:PORT) and serve them as ``rank``, until SIGTERM."""
    host, _, port = master.rpartition(":")
    port = int(port)
    stop = threading.Event()
    child: list = [None]

    def on_term(signum, frame):
        stop.set()
        if child[0] is not None and child[0].is_alive():
            child[0].terminate()
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    done: set[str] = set()
    _log(f"worker daemon rank {rank} waiting for jobs from {host}:{port}")
    while not stop.is_set():
        offer = _next_offer(host, port + 1, done, stop, poll)
        if offer is None:
            continue
        store, job = offer
        done.add(job["id"])
        challenge = secrets.token_hex(16)
        try:
            store.set(f"{job['id']}/challenge/{rank}", challenge)
            store.wait([f"{job['id']}/response/{rank}"], timedelta(seconds=30))
            answer = store.get(f"{job['id']}/response/{rank}").decode()
        except Exception as exc:  # noqa: BLE001
            _log(f"job {job['id'][:8]}: no answer to the token challenge ({exc}); waiting for the next job")
            continue
        if not hmac.compare_digest(answer, _answer(token, challenge)):
            _log(f"job {job['id'][:8]} from {host}: wrong job token, refused")
            continue
        folder = tempfile.mkdtemp(prefix=f"rpcmp-job-{job['id'][:8]}-")
        for name, data in job["files"].items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(base64.b64decode(data))
        store.set(f"{job['id']}/ready/{rank}", "1")
        del store
        _log(f"job {job['id'][:8]}: serving rank {rank} of {job['world_size']}")
        proc = mp.get_context("spawn").Process(
            target=_serve_job, args=(os.path.join(folder, job["job"]), rank, job["world_size"], host,
                                     job["rpc_port"], job["overrides"] or None), name=f"rpcmp-job-{job['id'][:8]}")
        child[0] = proc
        proc.start()
        _supervise(proc, host, port + 1, job["id"])
        child[0] = None
        _log(f"job {job['id'][:8]}: ended (exit {proc.exitcode}); waiting for the next job")
    _log("worker daemon stopped")


def _supervise(proc, host: str, offer_port: int, job_id: str, grace: int = 3) -> None:
    """Wait for the job's process; end it if its master is gone.

    The master is gone when its offer port stops answering or offers another job (a new
    master took the port). A master that dies during the RPC rendezvous would otherwise
    leave the job's process waiting out the rendezvous timeout while the next master
    finds this daemon busy.
    """
    misses = 0
    while proc.is_alive():
        proc.join(1.0)
        misses = 0 if _current_job(host, offer_port) == job_id else misses + 1
        if misses >= grace and proc.is_alive():
            _log("the master is gone: ending this job's process")
            proc.terminate()
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _current_job(host: str, port: int) -> str | None:
    try:
        socket.create_connection((host, port), timeout=2).close()
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=3))
        return json.loads(store.get(_KEY))["id"]
    except Exception:  # noqa: BLE001 - unreachable or not an rpcmp master
        return None


def _next_offer(host: str, port: int, done: set, stop: threading.Event, poll: float):
    try:
        socket.create_connection((host, port), timeout=2).close()  # quiet probe: no master, no store noise
    except OSError:
        stop.wait(poll)
        return None
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
        job = json.loads(store.get(_KEY))
    except Exception:  # noqa: BLE001 - no master yet: keep waiting
        stop.wait(poll)
        return None
    if job["id"] in done:
        stop.wait(poll)
        return None
    return store, job


def _serve_job(job_path: str, rank: int, world_size: int, host: str, port: int, overrides) -> None:
    from .runtime import run_rank
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    run_rank(job_path, rank, world_size, None, overrides, local_procs=1)


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} rpcmp-worker: {msg}", file=sys.stderr, flush=True)


def main() -> None:  # python -m rpcmp.worker
    from .cli import worker
    worker()


if __name__ == "__main__":
    main()
