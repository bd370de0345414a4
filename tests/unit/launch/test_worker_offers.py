"""A daemon's checks of a job offer, in one process: its form, and the proof that the master holds
the token over these exact bytes (a real TCPStore, the master's side played by the test)."""
import base64
import json
import os
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from rpcmp.launch.runtime import free_port
from rpcmp.launch.daemon import OfferError, _accept, _answer, parse_offer

JOB_ID = "0123456789abcdef"


def _offer(**fields):
    job = {"id": JOB_ID, "world_size": 3, "job": "job.py", "files": {"job.py": base64.b64encode(b"job = 1").decode()},
           "overrides": {}, "rpc_port": 29500, **fields}
    return json.dumps(job).encode()


def test_a_well_formed_offer_is_read_with_its_files_decoded():
    job = parse_offer(_offer(), rank=1)
    assert job["files"] == {"job.py": b"job = 1"} and job["world_size"] == 3


@pytest.mark.parametrize("raw,match", [
    (b"\xff", "not JSON"),
    (b"[1]", "expected a JSON object"),
    (_offer(world_size=True), "field 'world_size' must be a int"),
    (_offer(id="../../etc"), "job id must be 16-64 hex digits"),
    (_offer(world_size=1), "do not fit rank 1"),
    (_offer(files={"../evil.py": ""}), "is not a plain .py base name"),
    (_offer(files={".hidden.py": ""}), "is not a plain .py base name"),
    (_offer(files={"job.py": "not base64!"}), "is not base64"),
    (_offer(job="other.py"), "is not among the offered files"),
])
def test_a_malformed_or_hostile_offer_is_refused_by_name(raw, match):
    with pytest.raises(OfferError, match=match):
        parse_offer(raw, rank=1)


def _stores():
    """The store's server and two clients: the daemon's and the master's (one socket each: a client
    waits for one key at a time)."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    clients = [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)) for _ in range(2)]
    return server, *clients


@pytest.mark.parametrize("master_token,accepted", [("s3cret", True), ("guess", False)])
def test_only_a_master_that_holds_the_token_gets_the_daemon_to_write_the_files(tmp_path, master_token, accepted):
    server, store, theirs = _stores()
    raw = _offer()

    def master():  # answers the daemon's challenge, as rpcmp.launch.daemon.publish_job does
        theirs.wait([f"{JOB_ID}/challenge/1"], timedelta(seconds=10))
        challenge = theirs.get(f"{JOB_ID}/challenge/1").decode()
        theirs.set(f"{JOB_ID}/response/1", _answer(master_token, challenge, raw))
    answering = threading.Thread(target=master)
    answering.start()
    job = _accept(store, raw, 1, "s3cret", "127.0.0.1")
    answering.join(10)
    if not accepted:
        assert job is None and not store.check([f"{JOB_ID}/ready/1"])
        return
    assert open(job["path"], "rb").read() == b"job = 1" and os.path.basename(job["path"]) == "job.py"
    assert store.check([f"{JOB_ID}/ready/1"])


def test_an_offer_altered_after_the_proof_is_refused():
    server, store, theirs = _stores()
    honest, altered = _offer(), _offer(overrides={"epochs": 999})

    def master():
        theirs.wait([f"{JOB_ID}/challenge/1"], timedelta(seconds=10))
        theirs.set(f"{JOB_ID}/response/1", _answer("s3cret", theirs.get(f"{JOB_ID}/challenge/1").decode(), honest))
    answering = threading.Thread(target=master)
    answering.start()
    assert _accept(store, altered, 1, "s3cret", "127.0.0.1") is None
    answering.join(10)
