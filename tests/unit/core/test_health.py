"""DDP heartbeats through a real TCPStore, in one process: no wall clocks, no silent death."""
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from rpcmp.core.health import Heartbeats
from rpcmp.launch.runtime import free_port
from rpcmp.core.served import RunStatus


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_wall_clock_step_does_not_make_a_beating_rank_silent(store, monkeypatch):
    watcher = Heartbeats(0, 2, 1.0, store, RunStatus())
    beating = Heartbeats(1, 2, 1.0, store, RunStatus(), interval=0.05)
    beating.start()
    try:
        assert watcher.silent(0.5) == []
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 600)  # this node's clock is 10 minutes ahead
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert watcher.silent(0.5) == []
            time.sleep(0.1)
    finally:
        beating.stop()
        beating.join()
    _wait(lambda: watcher.silent(0.5) == [1])  # and a rank that stops beating is found


class FlakyStore:
    """A store that fails ``failures`` calls, then answers as the real one."""

    def __init__(self, store, failures):
        self.store, self.failures = store, failures

    def add(self, key, value):
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("Connection reset by peer")
        return self.store.add(key, value)


def test_the_heartbeat_thread_survives_store_errors_and_says_so(store, capfd):
    beats = Heartbeats(1, 2, 0, FlakyStore(store, 3), RunStatus(), interval=0.05)
    beats.start()
    try:
        _wait(lambda: store.add("rpcmp/hb/1", 0) >= 3)  # beating again after the errors
        assert beats.is_alive() and beats.store_errors == 3
    finally:
        beats.stop()
        beats.join()
    err = capfd.readouterr().err
    assert err.count("the heartbeat store did not answer (RuntimeError: Connection reset by peer)") == 1, err
