"""rpcmp: RPC-based pipeline model parallelism for PyTorch.

Declare stages in a job file, then launch it::

    rpcmp run examples/unet_split/job.py --local 3
    torchrun --nnodes=3 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        -m rpcmp.master examples/unet_split/job.py
"""
from .errors import (CallTimeoutError, CheckpointError, CheckpointWriteError, JobError, LaunchError, MicroBatchError, NetworkError,
                     NonFiniteLossError, PartitionError, PlacementError, RpcmpError, RunAbortedError, StageError, StageOutputError, WorkerLostError)
import importlib

# Imported on first use: `rpcmp run` starts its fork server before this process imports torch.
_LAZY = {"Job": ".job", "load_job": ".job", "Split": ".plan.partition", "SplitAt": ".plan.partition",
         "Pipeline": ".master.pipeline", "no_decay": ".core.groups"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'rpcmp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_LAZY])

__all__ = [
    "Job", "Split", "SplitAt", "Pipeline", "load_job", "no_decay",
    "RpcmpError", "JobError", "NonFiniteLossError", "PartitionError", "PlacementError", "MicroBatchError", "StageError", "StageOutputError",
    "WorkerLostError", "CheckpointError", "CheckpointWriteError", "LaunchError", "RunAbortedError", "NetworkError",
    "CallTimeoutError",
]
__version__ = "0.1.0"
