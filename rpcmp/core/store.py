"""The launch's key-value store, as every process of a run reaches it: torchrun's agent store, the
local launcher's, or a daemon master's (:func:`rpcmp.launch.network.bound_store`)."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from .served import current

__all__ = ["launch_store"]


def launch_store(seconds: float, address: tuple[str, int] | None = None) -> dist.TCPStore:
    """A client of the launch's store, waiting up to ``seconds`` for a key: at ``address``, or where the
    launch said this process's store is (``Served.store_address``, from ``MASTER_ADDR:MASTER_PORT``)."""
    host, port = address or current().store_address
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=seconds))
