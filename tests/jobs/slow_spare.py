"""tests/jobs/three.py (or the job ``SLOW_SPARE_OF`` names: ``replicated_dies``) where the process ``SLOW_BUILD_ON``
names (in the environment; unset: none), once asked to build a stage (or, with ``SLOW_AT=restore``, to take a
snapshot's values into it; ``take``: to snapshot its stages; ``remove_incomplete``: to clear an interrupted save, at
the start; ``load_files``: to read its part of the checkpoint a resumed run starts from; ``take_stage``: a live
copy's; ``adopt_optimizer``, ``set_routes``: the last calls of a move, after the stage came; ``gather_stage``: a
re-cut's new part taking its tensors), writes its process id to the file ``BUILDING`` names and sleeps ``SLOW_S``
seconds (60 unless set) first: a test kills a spare while it takes over a lost owner's stage, or a drained one's, or
kills another process meanwhile."""
import importlib
import os
import time

import rpcmp.owner.move as move
import rpcmp.owner.snapshot as snapshot
import rpcmp.owner.stage as stage
import rpcmp.owner.state as state
from rpcmp.core.served import current

job = importlib.import_module(os.environ.get("SLOW_SPARE_OF", "three")).job

SLOW_ON = os.environ.get("SLOW_BUILD_ON")
NAME = os.environ.get("SLOW_AT", "build")
MODULE = {"build": stage, "restore": snapshot, "take": snapshot, "remove_incomplete": state, "load_files": state}.get(NAME, move)
_real = getattr(MODULE, NAME)


def _slow(*args, **kwargs):
    if SLOW_ON and current().me == SLOW_ON:
        with open(os.environ["BUILDING"] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.environ["BUILDING"] + ".tmp", os.environ["BUILDING"])
        time.sleep(float(os.environ.get("SLOW_S", "60")))
    return _real(*args, **kwargs)


# sent by name over RPC: the receiving process resolves the patched name there too
_slow.__module__, _slow.__qualname__ = MODULE.__name__, NAME
setattr(MODULE, NAME, _slow)
