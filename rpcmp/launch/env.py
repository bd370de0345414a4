"""The launch context a process starts in, read once from the environment and handed down.

torchrun, the local launcher and worker daemons describe a rank's place in the job through
environment variables (``RANK``, ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT``, ...);
so do the command-line options that must reach every rank a launcher starts (``--iface``).
Only ``rpcmp/launch/`` reads or writes ``os.environ``; everything else receives what it
needs from here as arguments.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["LaunchEnv", "set_options"]

_TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _int(env: Mapping[str, str], key: str) -> int | None:
    return int(env[key]) if env.get(key, "").strip() else None


@dataclass(frozen=True)
class LaunchEnv:
    rank: int | None  # torchrun's RANK
    world_size: int | None
    local_rank: int | None  # the rank on this node (picks the GPU)
    local_world_size: int | None  # processes on this node (share the cores)
    node_rank: int | None  # torchrun's GROUP_RANK
    nodes: int  # torchrun's GROUP_WORLD_SIZE, 1 elsewhere
    restart: int  # torchrun's TORCHELASTIC_RESTART_COUNT as the node's agent counts it (see runtime._agree_on_attempt)
    under_torchrun: bool  # an elastic agent's store and run id are there
    connect_timeout: float  # RPCMP_CONNECT_TIMEOUT / --connect-timeout
    missing: tuple[str, ...]  # which of torchrun's variables are not set
    store_address: tuple[str, int] | None = None  # MASTER_ADDR:MASTER_PORT, the launch's store (rpcmp.core.store)

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> "LaunchEnv":
        env = os.environ if env is None else env
        return cls(rank=_int(env, "RANK"), world_size=_int(env, "WORLD_SIZE"), local_rank=_int(env, "LOCAL_RANK"),
                   local_world_size=_int(env, "LOCAL_WORLD_SIZE"), node_rank=_int(env, "GROUP_RANK"),
                   nodes=_int(env, "GROUP_WORLD_SIZE") or 1, restart=_int(env, "TORCHELASTIC_RESTART_COUNT") or 0,
                   under_torchrun=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RUN_ID" in env,
                   connect_timeout=float(env.get("RPCMP_CONNECT_TIMEOUT") or 60),
                   missing=tuple(k for k in _TORCHRUN if k not in env),
                   store_address=(env["MASTER_ADDR"], int(env["MASTER_PORT"])) if env.get("MASTER_ADDR")
                   and env.get("MASTER_PORT", "").strip() else None)


def set_options(iface: str | None = None, connect_timeout: float | None = None) -> None:
    """Command-line options every process of this launch reads (the local ranks and torchrun's
    inherit the environment): ``--iface`` and ``--connect-timeout``."""
    for value, key in ((iface, "RPCMP_IFACE"), (connect_timeout, "RPCMP_CONNECT_TIMEOUT")):
        if value is not None:
            os.environ[key] = str(value)
