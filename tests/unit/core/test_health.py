"""DDP heartbeats through a real TCPStore, in one process: no wall clocks, no silent death."""
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rpcmp.core import health
from rpcmp.core.health import Heartbeats
from rpcmp.launch.runtime import free_port
from rpcmp.core.served import RunStatus
from rpcmp.errors import WorkerLostError


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
    beating = Heartbeats(1, 2, 0, store, RunStatus(), interval=0.05)  # beats; looks at nothing (rank 0 does not beat)
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


def test_rank_0_stopped_with_the_others_and_continued_gives_them_a_fresh_window(store, monkeypatch):
    """Every rank stopped for longer than the hang timeout (Ctrl-Z) and continued: rank 0's first look may come
    before another rank's first beat; it must not end the job for a silence that was its own."""
    exits = []
    monkeypatch.setattr(health.os, "_exit", exits.append)
    watcher = Heartbeats(0, 2, 2.0, store, RunStatus(), interval=0.05)
    store.add("rpcmp/hb/1", 1)
    assert watcher.silent(2.0) == []  # rank 1's count seen once
    real, jump = time.monotonic, []
    monkeypatch.setattr(health.time, "monotonic", lambda: real() + (100.0 if jump else 0.0))
    watcher.start()
    try:
        time.sleep(0.3)
        jump.append(True)  # 100 s pass at once, as for a stopped process; rank 1 beats 0.5 s after that
        time.sleep(0.5)
        store.add("rpcmp/hb/1", 1)
        time.sleep(0.5)
    finally:
        watcher.stop()
        watcher.join()
    assert exits == []


def test_a_rank_whose_rank_0_stops_beating_ends_itself_naming_the_master(store, monkeypatch, capfd):
    """DDP mode: a collective may wait Job.call_timeout; a rank 0 that froze is found by the other ranks' heartbeats."""
    exits = []
    monkeypatch.setattr(health.os, "_exit", lambda code: exits.append(code) or beats.stop())
    store.add("rpcmp/hb/0", 1)  # rank 0 beat once, then froze
    beats = Heartbeats(1, 2, 0.5, store, RunStatus(), interval=0.05)
    beats.start()
    _wait(lambda: exits)
    beats.join()
    assert exits == [3]
    assert "WorkerLostError: before the first step: master (DDP replica) did not answer for 0s" in capfd.readouterr().err


class SilentStore:
    """The store of a local run lives in rank 0's process: frozen with it, a call waits and never ends."""

    def add(self, key, value):
        time.sleep(3600)


def test_a_rank_whose_store_stops_answering_ends_itself_but_not_for_a_call_its_own_pause_made_late(monkeypatch, capfd):
    """A frozen store keeps a call waiting whatever its own timeout says: the heartbeat waits for it on the side."""
    exits = []
    monkeypatch.setattr(health.os, "_exit", lambda code: exits.append(code) or beats.stop())
    beats = Heartbeats(1, 2, 0.5, SilentStore(), RunStatus(), interval=0.05, store_timeout=0.1)
    beats.start()
    _wait(lambda: exits)
    beats.join()
    assert exits == [3] and "did not answer for 0s, nor did the store it serves" in capfd.readouterr().err
    # a call out while this process was stopped (100 s pass on its clock) fails late: not rank 0's silence
    real, late = time.monotonic, []
    monkeypatch.setattr(health.time, "monotonic", lambda: real() + sum(late))

    class StoppedMeanwhile:
        def add(self, key, value):
            late.append(100.0)
            raise RuntimeError("Socket Timeout")
    beats = Heartbeats(1, 2, 0.5, StoppedMeanwhile(), RunStatus(), interval=0.05, store_timeout=1.0)
    beats._answered = start = health.time.monotonic()
    assert beats._round(start) == ([], "") and beats._answered >= start + 100


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


def _fake_world(monkeypatch, dead=(), hung=()):
    """Pings as TensorPipe answers them: a dead peer's call fails at once, a hung one's at the timeout."""
    def rpc_async(to, fn, timeout):
        fut = torch.futures.Future()
        if to in dead:
            fut.set_exception(RuntimeError("EOF: end of file"))
        elif to in hung:
            threading.Timer(timeout, fut.set_exception, (RuntimeError("RPC ran for more than set timeout"),)).start()
        else:
            fut.set_result(fn())
        return fut
    monkeypatch.setattr(health.rpc, "rpc_async", rpc_async)


def test_a_ping_tells_a_dead_worker_from_a_silent_one(monkeypatch):
    _fake_world(monkeypatch, dead={"worker1"}, hung={"worker2"})
    assert health._pings(["worker1", "worker2", "worker3"], 0.3) == {"worker1": "gone", "worker2": "silent", "worker3": None}
    assert health.unresponsive(["worker1", "worker2", "worker3"], 0.3) == ["worker1", "worker2"]


def test_a_ping_that_failed_long_after_its_deadline_is_sent_again_once(monkeypatch):
    """This process stopped while its pings were out (Ctrl-Z, SIGSTOP): when it runs again each has run past its
    deadline and fails at once, seconds late. The peers were stopped too, and answer the next ping: that one says."""
    calls = []

    def rpc_async(to, fn, timeout):
        calls.append(to)
        fut = torch.futures.Future()
        late = calls.count(to) == 1 or to == "worker2"  # worker2 is late twice: silent; worker1 answers again
        threading.Timer(3.0 if late else 0.01, fut.set_exception if late else fut.set_result,
                        (RuntimeError("RPC ran for more than set timeout"),) if late else (fn(),)).start()
        return fut
    monkeypatch.setattr(health.rpc, "rpc_async", rpc_async)
    assert health._pings(["worker1", "worker2"], 0.3) == {"worker1": None, "worker2": "silent"}
    assert sorted(calls) == ["worker1", "worker1", "worker2", "worker2"]


@pytest.mark.parametrize("lost", ["dead", "hung"])
def test_the_watchdog_leaves_a_dead_worker_to_the_master_for_a_while_and_ends_a_hung_one_at_once(monkeypatch, capfd, lost):
    _fake_world(monkeypatch, dead={"worker1"} if lost == "dead" else (), hung={"worker1"} if lost == "hung" else ())
    exits = []

    def exit_(code):
        exits.append((code, time.monotonic()))
        raise SystemExit  # ends the watchdog's thread
    monkeypatch.setattr(health.os, "_exit", exit_)
    monkeypatch.setattr(health.multiprocessing, "active_children", lambda: [])
    monkeypatch.setattr(health, "GRACE", 1.0)
    status = RunStatus()
    status.stages = {"worker1": ["stage 0"], "worker2": ["stage 1"]}
    start = time.monotonic()
    timeout = 3.0 if lost == "dead" else 0.3
    dog = health.Watchdog(["worker1", "worker2"], timeout, status, interval=0.05)
    dog.start()
    dog.join(10)
    assert [code for code, _ in exits] == [3]
    err = capfd.readouterr().err
    assert "WorkerLostError" in err and "worker1 (stage 0)" in err and "worker2" not in err, err
    if lost == "dead":  # the master had GRACE seconds to report it first (its pending call fails at once too)
        assert exits[0][1] - start >= 1.0 and "exited (its connections closed)" in err, err
    else:
        assert "hung or unreachable" in err, err


def test_a_call_between_steps_that_met_a_lost_process_gives_the_default_and_names_it(monkeypatch):
    def fails():
        raise RuntimeError("EOF: end of file")

    monkeypatch.setattr(health, "unresponsive", lambda processes, timeout: ["worker2"])
    assert health.unless_lost(lambda: 7, ["worker1", "worker2"]) == (7, [])
    assert health.unless_lost(fails, ["worker1", "worker2"], default={}) == ({}, ["worker2"])
    monkeypatch.setattr(health, "unresponsive", lambda processes, timeout: [])
    with pytest.raises(RuntimeError, match="EOF"):  # every process answers: the failure is its own
        health.unless_lost(fails, ["worker1", "worker2"])


def test_a_recovery_line_names_a_closed_connection_alike_whichever_call_saw_it():
    """The same loss read "RuntimeError: EOF: end of file" in one run and "WorkerLostError: the connection to worker1
    closed (EOF: end of file)" in another, by which call failed first."""
    watch = WorkerLostError("the connection to worker1 closed (EOF: end of file)")
    assert health.loss_cause(watch, "worker1") == health.loss_cause(RuntimeError("EOF: end of file"), "worker1") == (
        "the connection to worker1 closed (EOF: end of file)")
    assert health.loss_cause(ValueError("bad shape"), "worker1") == "ValueError: bad shape"
