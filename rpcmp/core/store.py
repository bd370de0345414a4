"""The launch's key-value store, as every process of a run reaches it: torchrun's agent store, the
local launcher's, or a daemon master's (:func:`rpcmp.launch.network.bound_store`)."""
from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

__all__ = ["launch_store"]


def launch_store(seconds: float) -> dist.TCPStore:
    """A client of the launch's store at ``MASTER_ADDR:MASTER_PORT``, waiting up to ``seconds`` for a key."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=seconds))
