"""tests/jobs/three.py (or the job ``SLOW_SPARE_OF`` names: ``replicated_dies``) where the process ``SLOW_BUILD_ON``
names (in the environment; unset: none), once asked to build a stage, writes its process id to the file ``BUILDING``
names and sleeps 60 s before it builds: a test kills a spare while it takes over a lost owner's stage."""
import importlib
import os
import time

import rpcmp.owner.stage as stage
from rpcmp.core.served import current

job = importlib.import_module(os.environ.get("SLOW_SPARE_OF", "three")).job

_build = stage.build
SLOW_ON = os.environ.get("SLOW_BUILD_ON")


def _slow_build(*args, **kwargs):
    if SLOW_ON and current().me == SLOW_ON:
        with open(os.environ["BUILDING"] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.environ["BUILDING"] + ".tmp", os.environ["BUILDING"])
        time.sleep(60)
    return _build(*args, **kwargs)


# sent by name over RPC: the receiving process resolves rpcmp.owner.stage.build, patched there too
_slow_build.__module__, _slow_build.__qualname__ = stage.__name__, "build"
stage.build = _slow_build
