"""tests/jobs/three.py whose worker2 waits in its build of the stages, once it has written the file its
environment names (``RPCMP_TEST_BUILDING``): an owner lost while the stages build. Every other process, and
worker2 without that variable, builds the model of tests/jobs/three.py as it is."""
import dataclasses
import os
import time

import torch.distributed.rpc as rpc
from three import job as three_job


def waiting(factory, name: str = "worker2"):
    """``factory``, but process ``name`` writes RPCMP_TEST_BUILDING's file and waits there for 120 s first."""
    def model():
        path = os.environ.get("RPCMP_TEST_BUILDING")
        if path and rpc.api._is_current_rpc_agent_set() and rpc.get_worker_info().name == name:
            open(path, "w").close()
            time.sleep(120)
        return factory()
    return model


job = dataclasses.replace(three_job, model=waiting(three_job.model))
