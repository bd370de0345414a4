"""The first SIGINT / SIGTERM asks a run to stop after its step; the second stops at once; the exit code says which."""
import os
import signal

import pytest

from rpcmp.train.stop import StopRequest, exit_status, requested


@pytest.fixture
def handlers():
    """Python's own handlers, whatever the test runner installed (a pytest-xdist worker ignores SIGINT)."""
    saved = {s: signal.signal(s, h) for s, h in ((signal.SIGINT, signal.default_int_handler),
                                                  (signal.SIGTERM, signal.SIG_DFL))}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_the_first_signal_is_recorded_the_second_interrupts_and_the_handlers_come_back(handlers):
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and stop.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second: Python's own Ctrl-C handler, at once
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_stop_an_owner_handed_on_is_not_the_masters_first_signal(handlers):
    """SIGTERM to every process at once (docker stop): an owner's, handed on to the master, may arrive before the
    master's own, which then stopped the master at once (exit -15, no checkpoint: seen in a run of the suite beside a
    busy core). Only a second signal of its own stops the master at once."""
    calls = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))  # what "at once" would run
    with StopRequest() as stop:
        assert requested(signal.SIGTERM, "worker2")
        os.kill(os.getpid(), signal.SIGTERM)  # the master's own, from the same kill
        assert stop.signum == signal.SIGTERM and calls == []
        os.kill(os.getpid(), signal.SIGTERM)  # its second
        assert calls == [signal.SIGTERM]


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
