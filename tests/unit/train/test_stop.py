"""The first SIGINT / SIGTERM asks a run to stop after its step; the second stops at once, even while the master waits
inside torch; the exit code says which."""
import os
import signal
import threading
import time

import pytest
import torch

from rpcmp.train import stop as stop_module
from rpcmp.train.stop import StopRequest, exit_status, requested


@pytest.fixture
def handlers():
    """Python's own handlers, whatever the test runner installed (a pytest-xdist worker ignores SIGINT)."""
    saved = {s: signal.signal(s, h) for s, h in ((signal.SIGINT, signal.default_int_handler),
                                                  (signal.SIGTERM, signal.SIG_DFL))}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.fixture
def ended(monkeypatch):
    """What a second signal ends at once (the process, exit 128 + N), recorded instead."""
    calls = []
    monkeypatch.setattr(stop_module, "end_now", calls.append)
    return calls


def _soon(condition, seconds=5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_the_first_signal_is_recorded_the_second_ends_at_once_and_the_handlers_come_back(handlers, ended):
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert _soon(lambda: stop.signum == signal.SIGTERM) and stop.name == "SIGTERM" and not ended
        os.kill(os.getpid(), signal.SIGINT)  # the second
        assert _soon(lambda: ended == [signal.SIGINT])
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.set_wakeup_fd(-1) == -1  # given back


def test_a_master_waiting_inside_torch_takes_both_signals(handlers, ended):
    """Python runs a signal's handler when the main thread runs Python: a master waiting in torch for a step that
    never ends (a future, distributed autograd's backward) took neither Ctrl-C nor a second one."""
    future, seen = torch.futures.Future(), {}

    def signals():
        os.kill(os.getpid(), signal.SIGINT)
        seen["first"] = _soon(lambda: stop.signum == signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        seen["second"] = _soon(lambda: ended == [signal.SIGINT])
        future.set_result(None)
    with StopRequest() as stop:
        threading.Thread(target=signals).start()
        future.wait()  # inside torch until the thread above is done
    assert seen == {"first": True, "second": True}


def test_a_stop_an_owner_handed_on_is_not_the_masters_first_signal(handlers, ended):
    """SIGTERM to every process at once (docker stop): an owner's, handed on to the master, may arrive before the
    master's own, which then stopped the master at once (exit -15, no checkpoint: seen in a run of the suite beside a
    busy core). Only a second signal of its own stops the master at once."""
    with StopRequest() as stop:
        assert requested(signal.SIGTERM, "worker2")
        os.kill(os.getpid(), signal.SIGTERM)  # the master's own, from the same kill
        assert _soon(lambda: stop.own) and stop.signum == signal.SIGTERM and ended == []
        os.kill(os.getpid(), signal.SIGTERM)  # its second
        assert _soon(lambda: ended == [signal.SIGTERM])


def test_an_ignored_signal_stays_ignored(handlers):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with StopRequest() as stop:
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum is None


def test_disabled_it_leaves_the_handlers_alone(handlers):
    with StopRequest(enabled=False) as stop:
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert stop.signum is None and stop.name is None


def test_exit_status():
    assert exit_status({"steps": 3, "stopped": None}) == 0 and exit_status(None) == 0
    assert exit_status({"stopped": "SIGINT"}) == 130 and exit_status({"stopped": "SIGTERM"}) == 143


def test_a_child_forked_during_a_run_has_its_own_signals(handlers, ended):
    """A process the run forks (a user's own workers) took the master's pipe and handlers with it: Ctrl-C, which
    reaches every process of the terminal's group, counted twice on the master (its own, and the child's written
    to its pipe), so the first stopped it at once; and the child ignored SIGTERM."""
    with StopRequest() as stop:
        child = os.fork()
        if child == 0:  # the child: SIGTERM ends it, as it would have before the run
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            os._exit(7)  # SIGTERM did not end it
        _, status = os.waitpid(child, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        time.sleep(0.3)
        assert stop.signum is None and not stop.own and ended == []  # the child's signal is not the master's
