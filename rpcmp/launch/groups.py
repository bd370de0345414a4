"""The process groups of a run with replicas: every rank's node, learnt through the launch's
store before RPC starts, and one group per stage over the ranks that hold its copies (see
[Note: replicas of a pipeline] in rpcmp/master/replicas.py)."""
from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from ..core.store import launch_store

__all__ = ["this_node", "share_nodes", "join_stage_groups", "leave_stage_groups"]


def this_node(node_rank: int | None) -> str:
    """The node this process runs on: torchrun's node rank, else the host's name."""
    return f"node {node_rank}" if node_rank is not None else socket.gethostname()


def share_nodes(rank: int, world_size: int, timeout: float, attempt: int, node_rank: int | None) -> list[str]:
    """Every rank's node, the same list on every rank (through the launch's store, before RPC)."""
    store = launch_store(timeout)
    key = f"rpcmp/node/{attempt}/"
    store.set(key + str(rank), this_node(node_rank))
    return [store.get(key + str(q)).decode() for q in range(world_size)]


def join_stage_groups(topology, rank: int, hang_timeout: float | None, served, attempt: int) -> None:
    """On every rank of a run with replicas: one process group over all ranks, and one per stage
    over the ranks that hold its copies (``served.stage_groups[k]``). Every rank must call this:
    creating a group is a collective of the whole world."""
    timeout = timedelta(seconds=max(60.0, hang_timeout or 0))
    store = launch_store(timeout.total_seconds())
    # The world's group is gloo whatever the devices (a master or a CPU stage has no GPU for NCCL);
    # the groups of CUDA stages are NCCL's.
    dist.init_process_group("gloo", store=dist.PrefixStore(f"rpcmp/pg/{attempt}", store),
                            rank=rank, world_size=topology.world_size, timeout=timeout)
    groups = {}
    for k in range(topology.stages):
        copies = topology.copies(k)
        ranks = sorted(p.rank for p in copies)
        backend = "nccl" if copies[0].device.startswith("cuda") else "gloo"
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            groups[k] = group
    served.stage_groups = groups
    dist.barrier()  # a rank outside a group passes new_group at once: no stage is used before every group exists


def leave_stage_groups(served) -> None:
    if served.stage_groups is not None and dist.is_initialized():
        dist.destroy_process_group()
    served.stage_groups = None
