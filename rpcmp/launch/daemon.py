"""Worker daemons: started once per node, they serve one job after another.

    rpcmp worker --master 10.0.0.1:29500 --rank 1 --token-file /etc/rpcmp/token   # each worker node
    rpcmp run job.py --workers 2 --listen 10.0.0.1:29500 --token-file /etc/rpcmp/token  # the master

[Note: how a daemon joins a job]
The master publishes the job (its id, world size, the job file and the ``.py`` files
beside it, the overrides) on a small TCP store at PORT + 1, as JSON bytes, nothing
unpickled. Anyone who reaches that port can read and write the store, so nothing in it
is trusted until proven:

- A daemon reads the offer once and checks its form (plain ``.py`` base names only, the
  fields and types it expects); a malformed offer is logged and refused, and the daemon
  keeps serving.
- It sends a fresh random challenge; the master answers with
  HMAC-SHA256(token, challenge + SHA-256 of the offer bytes *it* published). The daemon
  computes the same over the bytes *it* read: an offer whose files were swapped under
  the job's id, a replayed answer or a guessed token all fail, and the daemon runs
  nothing of it.
- Its ``ready`` is HMAC-SHA256(token, job id + rank + its challenge): the master starts
  the job only when every rank's ``ready`` proves the token.

It then starts a fresh child process for the job (``run_rank`` with the job's rank and
world size, RPC on PORT) and, when the job ends or its master dies, waits for the next
one. SIGTERM stops the child and the daemon.
"""
from __future__ import annotations

import base64
import gc
import hashlib
import hmac
import json
import os
import re
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

from ..errors import JobError
from ..errors import NetworkError
from .server import process_context, start_server
from .env import LaunchEnv
from .network import bound_store, port_free, select_interface

__all__ = ["serve_forever", "publish_job"]

_KEY = "rpcmp/job"


_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.py$")  # a plain base name: no folders, no "..", no hidden files
_HEX = re.compile(r"^[0-9a-f]{16,64}$")


def _mac(token: str, *parts: str | bytes) -> str:
    mac = hmac.new(token.encode(), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part if isinstance(part, bytes) else part.encode())
        mac.update(b"\n")
    return mac.hexdigest()


def _answer(token: str, challenge: str, offer: bytes) -> str:
    """What proves the token and binds the exact offer bytes: see [Note: how a daemon joins a job]."""
    return _mac(token, "rpcmp-offer/2", challenge, hashlib.sha256(offer).hexdigest())


def _ready(token: str, job_id: str, rank: int, challenge: str) -> str:
    return _mac(token, "rpcmp-ready/2", job_id, str(rank), challenge)


def _same(a: str, b: str) -> bool:
    """Constant-time comparison of two hex strings; anything else (non-ASCII, junk) is simply unequal."""
    return bool(_HEX.match(a)) and bool(_HEX.match(b)) and hmac.compare_digest(a, b)


class OfferError(ValueError):
    """An offer on the store that is not a well-formed rpcmp job."""


def parse_offer(raw: bytes, rank: int) -> dict:
    """The job offered in ``raw`` (the store's bytes), checked field by field; raise :class:`OfferError`."""
    try:
        job = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise OfferError(f"not JSON ({exc})") from None
    if not isinstance(job, dict):
        raise OfferError(f"expected a JSON object, got {type(job).__name__}")
    want = {"id": str, "world_size": int, "job": str, "files": dict, "overrides": dict, "rpc_port": int}
    for key, kind in want.items():
        if not isinstance(job.get(key), kind) or isinstance(job.get(key), bool):
            raise OfferError(f"field {key!r} must be a {kind.__name__}, got {job.get(key)!r:.60}")
    if not _HEX.match(job["id"]):
        raise OfferError(f"job id must be 16-64 hex digits, got {job['id']!r:.60}")
    if not 1 <= rank < job["world_size"] <= 4096 or not 0 < job["rpc_port"] < 65536:
        raise OfferError(f"world size {job['world_size']} / RPC port {job['rpc_port']} do not fit rank {rank}")
    for name, data in job["files"].items():
        if not _FILE.match(name):
            raise OfferError(f"file name {name!r:.60} is not a plain .py base name")
        try:
            job["files"][name] = base64.b64decode(data, validate=True)
        except (TypeError, ValueError) as exc:
            raise OfferError(f"file {name!r} is not base64 ({exc})") from None
    if job["job"] not in job["files"]:
        raise OfferError(f"the job file {job['job']!r:.60} is not among the offered files")
    return job


def read_token(token: str | None, token_file: str | None) -> str:
    if token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            import getpass
            raise JobError(f"cannot read the token file {token_file} as user {getpass.getuser()}: {exc.strerror}. A daemon "
                           f"running as User=rpcmp reads it through its group: chown root:rpcmp {token_file} && "
                           f"chmod 640 {token_file}") from None
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
    offer = json.dumps({"id": job_id, "world_size": workers + 1, "job": os.path.basename(job_file),
                        "files": files, "overrides": overrides or {}, "rpc_port": port}).encode()
    store.set(_KEY, offer)

    # One loop answers every challenge: a TCPStore client is one socket, so no concurrent waits.
    deadline, answered, joined = time.monotonic() + join_timeout, {}, set()
    ranks = range(1, workers + 1)
    while True:
        for r in ranks:
            if r in joined:
                continue
            challenge = _read(store, f"{job_id}/challenge/{r}")
            if challenge is not None and _HEX.match(challenge) and answered.get(r) != challenge:
                store.set(f"{job_id}/response/{r}", _answer(token, challenge, offer))
                answered[r] = challenge
            ready = _read(store, f"{job_id}/ready/{r}")
            if ready is not None and r in answered and _same(ready, _ready(token, job_id, r, answered[r])):
                joined.add(r)  # a `ready` that does not prove the token is ignored
        missing = [r for r in ranks if r not in joined]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise NetworkError(
                f"worker daemons of rank {missing} did not join within {join_timeout:.0f}s: is `rpcmp worker "
                f"--master {host}:{port} --rank R` running on their nodes, with the same token?")
        time.sleep(0.05)
    return store, rendezvous


def _read(store, key: str) -> str | None:
    """The store's value at ``key`` as text, or None if absent or not ASCII."""
    if not store.check([key]):
        return None
    try:
        return store.get(key).decode("ascii")
    except UnicodeDecodeError:
        return None


# -- daemon side -------------------------------------------------------------------------
def serve_forever(master: str, rank: int, token: str, poll: float = 1.0, libraries: list[str] | None = None) -> None:
    """Wait for jobs from ``master`` (HOST:PORT) and serve them as ``rank``, until SIGTERM. The fork server the
    jobs start from imports torch, rpcmp and ``libraries`` once (None: every model library installed)."""
    host, _, port = master.rpartition(":")
    port = int(port)
    start_server(every_library=libraries is None, libraries=libraries or ())  # imports done once, before the first job
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
        store, raw = offer
        done.add(hashlib.sha256(raw).hexdigest())  # this exact offer is looked at once
        try:
            job = _accept(store, raw, rank, token, host)
        except Exception as exc:  # noqa: BLE001 - nothing a peer writes may stop the daemon
            _log(f"offer refused: {type(exc).__name__}: {exc}")
            job = None
        del store
        if job is None:
            continue
        _log(f"job {job['id'][:8]}: serving rank {rank} of {job['world_size']}")
        ctx = process_context(job["path"])  # see [Note: forked from a warm server]
        finished = ctx.Event()
        proc = ctx.Process(
            target=_serve_job, args=(job["path"], rank, job["world_size"], host,
                                     job["rpc_port"], job["overrides"] or None, finished), name=f"rpcmp-job-{job['id'][:8]}")
        child[0] = proc
        proc.start()
        _supervise(proc, host, port + 1, job["id"], finished)
        child[0] = None
        _log(f"job {job['id'][:8]}: ended (exit {proc.exitcode}); waiting for the next job")
    _log("worker daemon stopped")


def _accept(store, raw: bytes, rank: int, token: str, host: str) -> dict | None:
    """Check the offer's form and the master's proof of the token over these exact bytes; write
    the job's files into a fresh folder and answer ``ready``. None: refused (logged)."""
    try:
        job = parse_offer(raw, rank)
    except OfferError as exc:
        _log(f"malformed job offer from {host} refused: {exc}")
        return None
    challenge = secrets.token_hex(16)
    try:
        store.set(f"{job['id']}/challenge/{rank}", challenge)
        store.wait([f"{job['id']}/response/{rank}"], timedelta(seconds=30))
        answer = store.get(f"{job['id']}/response/{rank}").decode("ascii", errors="replace")
    except Exception as exc:  # noqa: BLE001
        _log(f"job {job['id'][:8]}: no answer to the token challenge ({exc}); waiting for the next job")
        return None
    if not _same(answer, _answer(token, challenge, raw)):
        _log(f"job {job['id'][:8]} from {host}: wrong job token or an altered offer, refused")
        return None
    folder = tempfile.mkdtemp(prefix=f"rpcmp-job-{job['id'][:8]}-")
    for name, data in job["files"].items():  # plain base names (parse_offer): nothing lands outside the folder
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    job["path"] = os.path.join(folder, job["job"])
    store.set(f"{job['id']}/ready/{rank}", _ready(token, job["id"], rank, challenge))
    return job


def _supervise(proc, host: str, offer_port: int, job_id: str, finished, grace: int = 3, exiting: float = 60.0) -> None:
    """Wait for the job's process; end it if its master is gone.

    The master is gone when its offer port stops answering or offers another job (a new
    master took the port). A master that dies during the RPC rendezvous would otherwise
    leave the job's process waiting out the rendezvous timeout while the next master
    finds this daemon busy. A process whose job has ended (``finished``) is only leaving
    (under load, a finished rank was seen still exiting 3 s after its master had gone): it gets
    ``exiting`` seconds.
    """
    misses = 0
    while proc.is_alive():
        proc.join(1.0)
        misses = 0 if _current_job(host, offer_port) == job_id else misses + 1
        if finished.is_set():
            proc.join(exiting)
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
        raw = store.get(_KEY)
    except Exception:  # noqa: BLE001 - no master yet: keep waiting
        stop.wait(poll)
        return None
    if hashlib.sha256(raw).hexdigest() in done:
        stop.wait(poll)
        return None
    return store, raw


def run_master(job_file: str, workers: int, listen: str, token_file: str | None, overrides, main,
               control=None):
    """``rpcmp run JOB --workers N``: offer the job to N daemons, then be its rank 0 here. ``control``:
    made from (offer store, token, job id), what the trainer looks at between steps (``rpcmp drain``'s
    requests: rpcmp.launch.drain.DrainRequests)."""
    from .runtime import run_rank
    select_interface()
    host, _, port = listen.rpartition(":")
    from ..core.served import current
    token = read_token(None, token_file)
    store = publish_job(job_file, workers, host, int(port), token, overrides, LaunchEnv.read().connect_timeout)
    requests = control(store[0], token, json.loads(store[0].get(_KEY))["id"]) if control is not None else None

    def main_here(job, world_size):
        current().control = requests  # `rpcmp drain` requests reach the trainer: see [Note: draining a rank]
        return main(job, world_size)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True")
    result = run_rank(job_file, 0, workers + 1, main_here, overrides, local_procs=1)
    del store  # the rendezvous store lives as long as the run
    return result


def _serve_job(job_path: str, rank: int, world_size: int, host: str, port: int, overrides, finished) -> None:
    gc.freeze()  # see [Note: what a fork inherits, frozen] in .server
    from ..errors import RpcmpError
    from .runtime import run_rank
    from ..train.trainer import fit
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        # In DDP mode every rank trains (fit); in pipeline mode a worker serves its stages and fit is not called.
        run_rank(job_path, rank, world_size, fit, overrides, local_procs=1)
        finished.set()
    except RpcmpError as exc:  # the daemon logs the exit code; say why once
        _log(f"{type(exc).__name__}: {exc}")
        sys.exit(1)


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} rpcmp-worker: {msg}", file=sys.stderr, flush=True)
