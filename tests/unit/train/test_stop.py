"""The first SIGINT / SIGTERM asks a run to stop after its step; the second stops at once; the exit code says which."""
import os
import signal

import pytest

from rpcmp.train.stop import StopRequest, exit_status


def test_the_first_signal_is_recorded_the_second_interrupts_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and stop.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second: Python's own Ctrl-C handler, at once
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_disabled_it_leaves_the_handlers_alone():
    with StopRequest(enabled=False) as stop:
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert stop.signum is None and stop.name is None


def test_exit_status():
    assert exit_status({"steps": 3, "stopped": None}) == 0 and exit_status(None) == 0
    assert exit_status({"stopped": "SIGINT"}) == 130 and exit_status({"stopped": "SIGTERM"}) == 143
