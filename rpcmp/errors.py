"""Typed errors for user mistakes. Each message says what was expected, what was got, and the fix."""

__all__ = ["RpcmpError", "JobError", "PartitionError", "PlacementError", "MicroBatchError", "StageOutputError", "StageError",
           "WorkerLostError", "NonFiniteLossError", "CheckpointError", "CheckpointWriteError", "LaunchError",
           "RunAbortedError", "NetworkError", "StepCancelled"]


class RpcmpError(Exception):
    """Base class of every error rpcmp raises on purpose."""


class JobError(RpcmpError, ValueError):
    """The job file or a Job field is wrong."""


class PartitionError(RpcmpError, ValueError):
    """The stage declaration does not fit the model."""


class PlacementError(RpcmpError, ValueError):
    """The placement does not fit the stages or the processes."""


class MicroBatchError(RpcmpError, ValueError):
    """A batch cannot be split into the requested micro-batches."""


class StageError(RpcmpError, RuntimeError):
    """A stage failed on its owner. The message is one line (which stage, where, which
    micro-batch, the cause); ``details`` holds the stage's own traceback (the user's frames),
    ``full_traceback`` every frame (``--debug`` prints it)."""

    def __init__(self, message: str, details: str = "", full_traceback: str = ""):
        super().__init__(message)
        self.details, self.full_traceback = details, full_traceback

    def __reduce__(self):  # keeps the tracebacks through pickling (RPC, result queues)
        return (type(self), (str(self), self.details, self.full_traceback))


class StepCancelled(StageError):
    """A micro-batch not run because its step had already failed elsewhere (never the error a step reports)."""


class StageOutputError(MicroBatchError, StageError):
    """A stage returned something that cannot travel between stages (a bad value, and a stage's failure)."""


class NonFiniteLossError(RpcmpError, ArithmeticError):
    """The loss became NaN or infinite (Job.nonfinite='stop')."""


class CheckpointError(RpcmpError, ValueError):
    """A checkpoint cannot be read, or does not fit the model or the run."""


class CheckpointWriteError(RpcmpError, OSError):
    """A checkpoint could not be written (a full disk, a failing device): a run failure, not a
    mistake in the input; the previous checkpoint is intact."""


class LaunchError(RpcmpError, RuntimeError):
    """A process of a local run died or failed before joining the job; the message names its rank and why."""


class RunAbortedError(RpcmpError, RuntimeError):
    """On a worker: the master ended with an error or stopped answering, so this rank did not
    end normally either (it exits 1, and torchrun or a daemon sees a failed rank)."""


class WorkerLostError(StageError):
    """A worker died, hung or became unreachable."""


class CallTimeoutError(RpcmpError, RuntimeError):
    """A call between processes ran past ``Job.rpc_timeout`` while every process still answers."""


class NetworkError(RpcmpError, RuntimeError):
    """The network setup cannot work; the message says why and what to change."""
