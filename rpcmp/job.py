"""The job: one Python file that every process imports, holding ``job = rpcmp.Job(...)``.

Every process (master, workers, torchrun ranks) imports the same file, so the model
factory, data and loss are plain importable functions and never travel over RPC.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .errors import JobError
from .plan.schedule import SCHEDULES
from .plan.partition import Split, SplitAt, declaration_kind
from .plan.topology import check_replicas
from .core.wire import WIRES

__all__ = ["Job", "load_job", "check_movable", "loss_of"]

_TRANSPORTS = ("uv", "shm")


@dataclass
class Job:
    """Everything rpcmp needs to train a model split into stages.

    Example (``examples/unet_split/job.py``)::

        job = rpcmp.Job(
            model=lambda: smp.Unet("resnet34", encoder_weights=None, in_channels=1, classes=1),
            stages=["encoder", "decoder", "segmentation_head"],
            data=make_datasets, loss=dice_bce_loss, metric=dice_score,
            optimizer=(torch.optim.Adam, {"lr": 1e-3}), batch_size=8, microbatches=4,
        )
    """

    model: Callable[[], torch.nn.Module] | None = None
    stages: Sequence[Any] | Split = ()
    placement: str | Sequence[str] = "auto"
    data: Callable[[], tuple[Any, Any]] | None = None  # -> (train_dataset, heldout_dataset or None)
    collate: Callable[[list], Any] | None = None  # the DataLoader's collate_fn (None: torch's): samples -> (x, y)
    loss: Callable[[Any, Any], torch.Tensor] | None = None  # loss(output, target), on the master; per micro-batch unless schedule="gpipe"
    metric: Callable[[Any, Any], float] | None = None  # higher is better, on held-out data
    metric_name: str = "metric"
    optimizer: tuple[type, dict] = (torch.optim.SGD, {"lr": 0.01})
    # (torch.optim.lr_scheduler.<Class>, {kwargs}), or a function of the optimizer that returns a scheduler
    # (lambda opt: transformers.get_cosine_schedule_with_warmup(opt, 100, 1000)); stepped once per optimizer step
    scheduler: tuple[type, dict] | Callable | None = None
    # model -> torch.optim-style groups with settings of their own, e.g. no weight decay on biases and norms:
    # [{"params": [parameters or names], "weight_decay": 0.0}, ...] (see [Note: parameter groups])
    param_groups: Callable[[torch.nn.Module], list[dict]] | None = None
    clip_grad_norm: float | None = None  # clip by the global norm over every stage
    batch_size: int = 8
    microbatches: int = 1
    mode: str = "pipeline"  # "pipeline": stages over processes; "ddp": the whole model on every rank
    replicas: int = 1  # pipeline mode: copies of the pipeline, each on its share of every batch (rpcmp/master/replicas.py)
    spares: int = 0  # pipeline mode: the last ranks hold no stage and wait to take one (rpcmp/master/recovery.py)
    rebalance: bool = False  # a Split or SplitAt pipeline re-cuts itself when its stages' measured work is out of balance
    snapshot_every: int | None = None  # with spares: steps between in-memory snapshots of the stages (None: 10; 0: off)
    accumulate: int = 1  # batches whose gradients add up to one optimizer step
    precision: str = "fp32"  # "bf16": autocast; "fp16": autocast + loss scaling (DDP mode: on GPUs only)
    wire: str = "fp32"  # "bf16" / "fp16" (half the bytes) / "int8" (a quarter): activations and their gradients between stages
    recompute: bool = False  # keep only each stage's inputs for backward; recompute the rest (see rpcmp/owner/stage.py)
    batchnorm: str = "batch"  # "batch": whole-batch statistics (exact); "micro": per micro-batch (see rpcmp/master/pipeline.py)
    sync_batchnorm: bool = False  # DDP mode: BatchNorm statistics over all ranks
    # "overlap": each micro-batch's backward starts when its forward ends; "1f1b": that, with at most S
    # micro-batches in flight (activation memory of S, not M); "gpipe": the loss once, on the gathered batch
    # (exact for any loss; rpcmp/master/pipeline.py)
    schedule: str = "overlap"
    epochs: int = 1
    max_steps: int | None = None
    seed: int = 0
    threads: int | None = None  # intra-op threads per process; None: cores / processes on the node
    transport: str = "uv"  # TensorPipe transport: "uv" (TCP) or "shm" (busy-polls; see README)
    # seconds a call between processes may run before it fails; None: 60 with spares (how a silent worker on
    # another host is found and replaced), else 1800 (see [Note: a paused job goes on])
    rpc_timeout: float | None = None
    nonfinite: str = "stop"  # NaN/inf loss: "stop" with an error, or "skip" the update with a warning
    hang_timeout: float = 20.0  # a worker silent this long ends the job (0: never; a dead one is seen at once)
    # seconds a training step may go with no process working before the run ends (None: it warns after 3 x
    # hang_timeout and goes on waiting; see [Note: a stalled step] in rpcmp/core/stall.py)
    stall_timeout: float | None = None
    trace_file: str | None = None  # pipeline mode: Chrome-trace JSON of steps 2-4 (see rpcmp/train/timeline.py)
    metrics_file: str | None = None  # JSON lines: one per step, epoch and run end
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: at the end of every epoch
    keep_last: int = 2
    resume: bool = False  # continue from the latest checkpoint in checkpoint_dir
    device_maps: bool = False  # opt-in: CUDA tensors go stage to stage directly (TensorPipe device maps)
    # initial values from a plain state_dict file (or an rpcmp checkpoint): each owner reads only its own
    # keys, memory-mapped (see [Note: each owner materializes only its part])
    init_from: str | None = None
    source: str | None = field(default=None, repr=False)  # path of the job file, set by load_job

    def __post_init__(self):
        declaration_kind(self.stages)
        for name in ("batch_size", "microbatches", "epochs", "accumulate", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise JobError(f"Job.{name} must be a positive integer, got {value!r}")
        if self.microbatches > self.batch_size:
            raise JobError(
                f"Job.microbatches ({self.microbatches}) is larger than Job.batch_size ({self.batch_size}): "
                f"each micro-batch needs at least one sample; lower microbatches or raise batch_size"
            )
        check_replicas(self)
        for name in ("spares", "snapshot_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise JobError(f"Job.{name} must be 0 or a positive integer, got {value!r}")
        if self.rebalance:
            check_movable(self.stages)
        if self.spares and self.mode != "pipeline":
            raise JobError(f"Job.spares={self.spares}: spare processes take over a lost pipeline stage; DDP mode has no "
                           f"stages: drop spares, or use mode='pipeline'")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise JobError(f"Job.checkpoint_every must be 0 (every epoch) or a positive step count, got {self.checkpoint_every!r}")
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise JobError(f"Job.keep_last must be a positive integer, got {self.keep_last!r}")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise JobError(f"Job.max_steps must be None or a positive integer, got {self.max_steps!r}")
        if self.schedule not in SCHEDULES:
            raise JobError(f"Job.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.mode not in ("pipeline", "ddp"):
            raise JobError(f"Job.mode must be 'pipeline' or 'ddp', got {self.mode!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise JobError(f"Job.precision must be 'fp32', 'bf16' or 'fp16', got {self.precision!r}")
        if self.wire not in WIRES:
            raise JobError(f"Job.wire must be 'fp32' (activations cross between stages as computed), 'bf16' or "
                           f"'fp16' (half the bytes on the wire, rounded) or 'int8' (a quarter, a scale per row), "
                           f"got {self.wire!r}")
        if self.batchnorm not in ("batch", "micro"):
            raise JobError(f"Job.batchnorm must be 'batch' (whole-batch statistics, exact) or 'micro' "
                           f"(per micro-batch, pipelined), got {self.batchnorm!r}")
        if self.nonfinite not in ("stop", "skip"):
            raise JobError(f"Job.nonfinite must be 'stop' or 'skip', got {self.nonfinite!r}")
        if self.transport not in _TRANSPORTS:
            raise JobError(f"Job.transport must be one of {_TRANSPORTS}, got {self.transport!r}")
        cls, kwargs = _optimizer(self.optimizer)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise JobError(f"Job.optimizer must be (torch.optim.<Class>, {{kwargs}}), got {self.optimizer!r}")
        if _needs_closure(cls):
            raise JobError(f"Job.optimizer: {cls.__name__}.step needs a closure that evaluates the whole model's loss "
                           f"again (a line search), but each stage's optimizer steps alone on its own gradients, once "
                           f"a step; use an optimizer that steps on the gradients alone (SGD, Adam, AdamW, ...)")
        self.optimizer = (cls, kwargs)
        if self.scheduler is not None:
            self.scheduler = _scheduler(self.scheduler)
        self._check_optionals()

    def _check_optionals(self) -> None:
        if self.param_groups is not None and not callable(self.param_groups):
            raise JobError(f"Job.param_groups must be None or a function of the model that returns torch.optim's "
                           f'groups, e.g. lambda model: [{{"params": [p for p in model.parameters() if p.dim() >= 2]}}, '
                           f'{{"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}}], '
                           f"got {self.param_groups!r}")
        if self.param_groups is not None and declaration_kind(self.stages) == "modules":
            raise JobError("Job.param_groups is called with the whole model, and stages given as modules have none: "
                           "give Job(model=...) and name its stages, or drop param_groups")
        if self.stall_timeout is not None and not (isinstance(self.stall_timeout, (int, float)) and self.stall_timeout > 0):
            raise JobError(f"Job.stall_timeout must be None (warn only) or a positive number of seconds, got "
                           f"{self.stall_timeout!r}")
        if self.clip_grad_norm is not None and not (isinstance(self.clip_grad_norm, (int, float)) and self.clip_grad_norm > 0):
            raise JobError(f"Job.clip_grad_norm must be None or a positive number, got {self.clip_grad_norm!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise JobError(f"Job.threads must be None or a positive integer, got {self.threads!r}")
        if self.collate is not None and not callable(self.collate):
            raise JobError(f"Job.collate must be None (torch's default collate) or a function from a list of samples to "
                           f"a batch (x, y), as DataLoader's collate_fn, got {self.collate!r}")
        if self.rpc_timeout is not None and not (isinstance(self.rpc_timeout, (int, float)) and self.rpc_timeout > 0):
            raise JobError(f"Job.rpc_timeout must be None (the default) or a positive number of seconds, got "
                           f"{self.rpc_timeout!r}")

    # [Note: a paused job goes on]
    # A process stopped and continued (Ctrl-Z and fg, SIGSTOP and SIGCONT, a frozen and thawed container)
    # finds, when it runs again, every call it had in flight past its deadline: TensorPipe's deadlines run on
    # the monotonic clock, which a stopped process's clock keeps counting. With the old 60 s for every call,
    # a job stopped for a minute failed its step when continued ("RPC ran for more than set timeout"), though
    # every process answered. A silent worker is found by the watchdog's pings (Job.hang_timeout, in
    # rpcmp/core/health.py), which are sent afresh after a pause; so without spares the calls get 30
    # minutes, a bound that is left only to catch a call that never ends. With spares the RPC timeout is
    # also how a silent worker on another host is found (it cannot be killed from here), and it stays 60 s.
    # A call that does run out while every process answers says so (health.explain) and names this field.
    # DDP mode's collectives wait as long: a frozen rank is found by the heartbeats (rank 0 watches every
    # rank, every rank watches rank 0), which a pause of every rank does not fool.
    @property
    def call_timeout(self) -> float:
        """``rpc_timeout``, or its default (see [Note: a paused job goes on])."""
        if self.rpc_timeout is not None:
            return float(self.rpc_timeout)
        return 60.0 if self.spares else 1800.0


def loss_of(job, out: Any, y: Any) -> torch.Tensor:
    """``job.loss(out, y)``, refused unless it is one number (what every backward starts from)."""
    value = job.loss(out, y)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value if value.dim() == 0 else value.reshape(())  # a view (another graph node) only where needed
    got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise JobError(f"Job.loss must return one number (a 0-dimensional tensor), got {got}: reduce it over the "
                   f"samples (reduction='mean')")


def _needs_closure(cls: type) -> bool:
    """Whether ``cls.step`` takes a ``closure`` it cannot do without (LBFGS)."""
    try:
        closure = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _scheduler(value: Any) -> tuple[Any, dict]:
    """``Job.scheduler`` as ``(class or function, kwargs)``; a function is checked when the run calls it
    (:func:`rpcmp.core.hparams.make_scheduler`)."""
    if callable(value) and not isinstance(value, type):
        return value, {}
    scls, skw = _optimizer(value)
    lr = torch.optim.lr_scheduler
    if not (isinstance(scls, type) and issubclass(scls, lr.LRScheduler) and not issubclass(scls, lr.ReduceLROnPlateau)):
        raise JobError(f"Job.scheduler must be (torch.optim.lr_scheduler.<Class>, {{kwargs}}) or a function of the "
                       f"optimizer that returns one, stepped once per optimizer step (ReduceLROnPlateau is not "
                       f"supported), got {value!r}")
    return scls, skw


def _optimizer(value: Any) -> tuple[Any, dict]:
    if isinstance(value, type):
        return value, {}
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], dict):
        return value[0], dict(value[1])
    raise JobError(f"Job.optimizer must be (torch.optim.<Class>, {{kwargs}}), got {value!r}")


def load_job(path: str, name: str = "job", overrides: dict | None = None) -> Job:
    """Import the job file at ``path`` and return its ``Job`` (the attribute ``name``).

    The module is registered under a name derived from the file's absolute path, so
    that every process that loads the same file sees the same module name.
    """
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise JobError(f"job file {path} does not exist: pass the path of a Python file that defines `job = rpcmp.Job(...)`")
    modname = "rpcmp_job_" + hashlib.sha1(path.encode()).hexdigest()[:10]
    module = sys.modules.get(modname)
    if module is None:
        spec = importlib.util.spec_from_file_location(modname, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        sys.path.insert(0, os.path.dirname(path))  # a job may import modules that sit beside it
        torch.manual_seed(0)  # modules built at import time come out the same in every process
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[modname]
            tb = traceback.format_exc(limit=-3)
            raise JobError(f"job file {path} failed to import: {type(exc).__name__}: {exc}\n{tb}") from exc
    job = getattr(module, name, None)
    if not isinstance(job, Job):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, Job))
        hint = f"it defines Job objects named {found}: name one `job`" if found else "add `job = rpcmp.Job(...)`"
        raise JobError(f"job file {path} has no Job named {name!r} (got {type(job).__name__}); {hint}")
    if overrides:
        fields = {k: v for k, v in vars(job).items()}
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise JobError(f"unknown Job settings {unknown}; valid ones are {sorted(fields)}")
        fields.update(overrides)
        job = Job(**fields)
    job.source = path
    return job


def check_movable(stages: Any) -> None:
    """``Job(rebalance=True)`` re-cuts a ``Split``, or a ``SplitAt`` at named children of one module."""
    points = stages.points if isinstance(stages, SplitAt) else None
    if points is None and not isinstance(stages, Split):
        raise JobError(f"Job.rebalance re-cuts a Split (the layers of an nn.Sequential) or a SplitAt (its points move "
                       f"among a transformer's blocks); these stages are {type(stages).__name__}: declare them with "
                       f"rpcmp.Split(...) or rpcmp.SplitAt(...), or drop rebalance")
    if points is not None and (not points or len({p.rpartition(".")[0] for p in points}) != 1):
        raise JobError(f"Job.rebalance moves the points of a SplitAt among the children of one module (SplitAt('h.2', "
                       f"'h.4')); got SplitAt{tuple(points)}{' (pipe_split() markers cannot move)' if not points else ''}: "
                       f"name points of one module, or drop rebalance")
