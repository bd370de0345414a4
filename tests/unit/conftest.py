"""The in-process tests of the master and the owner share one one-process RPC world (real RPC and
distributed autograd, no other process): ``init_rpc`` works once per process."""
import dataclasses
import os

import pytest
import torch
import torch.distributed.rpc as rpc

from helpers import load
from rpcmp.launch.runtime import _backend_options, free_port

_ON_MASTER = ["master", "master"]


@pytest.fixture(scope="session")
def world():
    """One RPC world for the whole session: init_rpc works once per process."""
    job = dataclasses.replace(load("mlp"), placement=_ON_MASTER)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    rpc.init_rpc("master", rank=0, world_size=1, rpc_backend_options=_backend_options(job, 1))
    yield job
    rpc.shutdown()
