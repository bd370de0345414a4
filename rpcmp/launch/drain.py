"""Drain a node of a daemon job: ``rpcmp drain --master HOST:PORT --rank R --token-file T``.

[Note: draining a rank]
The request travels through the job's offer store (PORT + 1), which anyone who reaches the
port can write, so it is authenticated as every daemon message is: it names the rank and a
fresh nonce and carries HMAC-SHA256(token, job id, rank, nonce); the master acts on a request
only if the MAC proves the token, once per nonce. Between two steps the master moves every
stage of rank R to a spare (``Pipeline.move_stage``: the same math), lets R's process leave
the run (its daemon then says "ended (exit 0)" and waits for the next job, so the node can be
rebooted) and answers with a MAC over its message, which ``rpcmp drain`` checks before it
believes it. Without a free spare the master refuses and the job goes on as it was. With
snapshots (spares left after the drain), R leaves only once the snapshot of the stages where
they now are has reached every buddy: until then R holds buddy copies and the moved stages'
old ones, and an owner lost in that window was a loss no snapshot covered (the run ended).
``rpcmp rebalance --master HOST:PORT --token-file T`` travels the same way (the action is under the
MAC): the master measures its stages over the next steps once, as ``--rebalance`` does, re-cuts if
it pays, and answers with what it decided.
"""
from __future__ import annotations

import json
import secrets
import socket
import time

from .daemon import _KEY, _mac, _read, _same

__all__ = ["DrainRequests", "request_drain", "ACTIONS"]

_COUNT = "rpcmp/drains"
ACTIONS = ("drain", "rebalance")


def _request_mac(token: str, job_id: str, action: str, rank: int, nonce: str) -> str:
    return _mac(token, "rpcmp-control/1", job_id, action, str(rank), nonce)


def _answer_mac(token: str, job_id: str, nonce: str, ok: bool, message: str) -> str:
    return _mac(token, "rpcmp-drained/1", job_id, nonce, "ok" if ok else "refused", message)


class DrainRequests:
    """The master's side: the authenticated requests that arrived since the last look, and the answers."""

    def __init__(self, store, token: str, job_id: str):
        self.store, self.token, self.job_id = store, token, job_id
        self.seen, self.nonces = 0, set()

    def pending(self) -> list[tuple[int, str, int, str]]:
        """(request number, action, rank, nonce) of each new request that proves the token."""
        out = []
        while self.seen < self.store.add(_COUNT, 0):
            raw = _read(self.store, f"rpcmp/drain/{self.seen + 1}")
            if raw is None:
                break  # counted, not written yet: looked at after the next step
            self.seen += 1
            try:
                req = json.loads(raw)
                action, rank, nonce, mac = str(req["action"]), int(req["rank"]), str(req["nonce"]), str(req["mac"])
            except (ValueError, KeyError, TypeError):
                continue  # not a request: ignored
            if (action not in ACTIONS or nonce in self.nonces
                    or not _same(mac, _request_mac(self.token, self.job_id, action, rank, nonce))):
                continue  # a replay, or no proof of the token: nothing happens
            self.nonces.add(nonce)
            out.append((self.seen, action, rank, nonce))
        return out

    def answer(self, number: int, nonce: str, ok: bool, message: str) -> None:
        self.store.set(f"rpcmp/drained/{number}", json.dumps(
            {"ok": ok, "message": message, "mac": _answer_mac(self.token, self.job_id, nonce, ok, message)}))


def request_drain(master: str, rank: int, token: str, timeout: float = 300.0, action: str = "drain") -> tuple[bool, str]:
    """Ask the master of the job at ``master`` (HOST:PORT) to drain ``rank`` (or, ``action="rebalance"``, to
    measure its stages once and re-cut if it pays); (done, the master's message)."""
    import torch.distributed as dist
    from datetime import timedelta
    host, _, port = master.rpartition(":")
    try:  # a plain connection first: no job there is one line, not TCPStore's 30 s of retries and a C++ trace
        socket.create_connection((host, int(port) + 1), timeout=10).close()
    except OSError as exc:
        return False, (f"no job answers at {host}:{int(port) + 1} (the offer store of --master {master}): {exc}; "
                       f"is the job still running, and is --master the address given to `rpcmp run --listen`?")
    store = dist.TCPStore(host, int(port) + 1, is_master=False, timeout=timedelta(seconds=30))
    offer = json.loads(store.get(_KEY))
    job_id, nonce = offer["id"], secrets.token_hex(16)
    number = store.add(_COUNT, 1)
    store.set(f"rpcmp/drain/{number}", json.dumps({"action": action, "rank": rank, "nonce": nonce,
                                                  "mac": _request_mac(token, job_id, action, rank, nonce)}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raw = _read(store, f"rpcmp/drained/{number}")
        if raw is not None:
            got = json.loads(raw)
            ok, message = bool(got["ok"]), str(got["message"])
            if not _same(str(got["mac"]), _answer_mac(token, job_id, nonce, ok, message)):
                return False, "the answer does not prove the job's token: not from this job's master"
            return ok, message
        time.sleep(0.2)
    return False, f"no answer from the master within {timeout:.0f}s (is job {job_id[:8]} still training?)"
