"""One call on each of several processes: this process's by a plain call on the caller's thread, the
others' by RPC, results in the processes' order, every call settled before an error is raised."""
import threading

import pytest

from rpcmp.core.futures import call_each
from rpcmp.core.served import serve


def _where(tag):
    return tag, threading.current_thread().name


def _fails(tag):
    raise ValueError(f"failed {tag}")


def test_this_process_is_called_on_the_caller_s_thread_with_its_own_arguments(world):
    serve(world)
    assert call_each(["master"], _where, lambda p: (p + "!",)) == [("master!", threading.current_thread().name)]
    assert call_each([], _fails) == []


def test_this_process_s_error_is_raised_as_it_is(world):
    serve(world)
    with pytest.raises(ValueError, match="failed here"):
        call_each(["master"], _fails, ("here",))
