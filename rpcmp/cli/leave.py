"""How the ``rpcmp`` command and ``python -m rpcmp.master`` end their process (see [Note: leaving without the teardown])."""
from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import traceback
from typing import Callable, NoReturn

__all__ = ["program"]


# [Note: leaving without the teardown]
# A process that imported torch (and, for a traced job, dynamo and sympy) spends 0.6-0.9 s of CPU after
# its command has returned, in the interpreter's own teardown: freeing every module and object one by one
# (measured with strace: no system call in that stretch), then C++ static destructors. Nothing of the run
# depends on it: every file rpcmp writes is closed where it is written, and the RPC world is left before
# the command returns. A command line therefore ends as the interpreter would up to that point (its threads'
# exit hooks, the non-daemon threads joined, the atexit handlers: multiprocessing's join of its children,
# logging's flush, torch's), flushes Python's and C's standard streams, and leaves with ``os._exit``.
# Measured on `rpcmp run tests/jobs/three.py --local 5 --max-steps 60 --spares 1`, idle 2-core machine:
# 5.8-6.2 s from start to exit before, 5.2-5.4 s after (three alternating launches each).
def program(command: Callable[[], object]) -> NoReturn:
    """Run ``command`` (a click command, standalone) as this process's program, then leave it."""
    try:
        command()
        code = 0
    except SystemExit as exc:
        code = _code(exc.code)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # what the interpreter's exit does first (a thread pool's exit hook, then joins)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a closed pipe or stream: nothing more can be said
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # what C or C++ code wrote to a buffered stdout
    except (OSError, AttributeError):
        pass
    os._exit(code)


def _code(code: object) -> int:
    """``sys.exit``'s argument as the exit status the interpreter would give."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
