"""rpcmp: RPC-based pipeline model parallelism for PyTorch.

Declare stages in a job file, then launch it::

    rpcmp run examples/unet_split/job.py --local 3
    torchrun --nnodes=3 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        -m rpcmp.master examples/unet_split/job.py
"""
from .errors import (CheckpointError, CheckpointWriteError, JobError, LaunchError, MicroBatchError, NetworkError, NonFiniteLossError,
                     PartitionError, PlacementError, RpcmpError, RunAbortedError, StageError, StageOutputError, WorkerLostError)
from .job import Job, load_job
from .plan.partition import Split, SplitAt
from .master.pipeline import Pipeline

__all__ = [
    "Job", "Split", "SplitAt", "Pipeline", "load_job",
    "RpcmpError", "JobError", "NonFiniteLossError", "PartitionError", "PlacementError", "MicroBatchError", "StageError", "StageOutputError",
    "WorkerLostError", "CheckpointError", "CheckpointWriteError", "LaunchError", "RunAbortedError", "NetworkError",
]
__version__ = "0.1.0"
