"""What every job-running command takes (``run``, ``predict``, ``plan``, ``python -m rpcmp.master``):
the Job overrides as options, and how an rpcmp error is said and which exit code it gives."""
from __future__ import annotations

import functools
import sys

import click
from rich.console import Console
from rich.markup import escape

from ..errors import RpcmpError
from ..launch.env import set_options

__all__ = ["job_options", "report", "exit_code"]


def job_options(fn):
    """Settings that override the job file's, shared by ``rpcmp run`` and ``python -m rpcmp.master``."""
    options = [
        click.option("--microbatches", "-m", type=int, help="Micro-batches per batch (Job.microbatches)."),
        click.option("--batch-size", type=int, help="Samples per optimizer step (Job.batch_size)."),
        click.option("--epochs", type=int, help="Passes over the training set (Job.epochs)."),
        click.option("--max-steps", type=int, help="Stop after this many optimizer steps (Job.max_steps)."),
        click.option("--threads", type=int, help="Intra-op threads per process (default: cores / processes)."),
        click.option("--transport", type=click.Choice(["uv", "shm"]), help="TensorPipe transport (default uv)."),
        click.option("--mode", type=click.Choice(["pipeline", "ddp"]), help="Stages over processes, or DDP."),
        click.option("--replicas", type=int, help="Pipeline mode: copies of the pipeline, data parallel (Job.replicas)."),
        click.option("--accumulate", type=int, help="Batches per optimizer step (gradient accumulation)."),
        click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), help="Autocast dtype (fp16 adds loss scaling)."),
        click.option("--wire", type=click.Choice(["fp32", "bf16", "fp16", "int8"]), help="Activations and gradients between stages (Job.wire)."),
        click.option("--sync-batchnorm", is_flag=True, default=None, help="DDP mode: SyncBatchNorm."),
        click.option("--batchnorm", type=click.Choice(["batch", "micro"]),
                     help="BatchNorm statistics of the whole batch (exact) or of each micro-batch (pipelined)."),
        click.option("--recompute", is_flag=True, default=None,
                     help="Activation checkpointing per stage: less memory, one more forward per micro-batch."),
        click.option("--schedule", type=click.Choice(["overlap", "1f1b", "gpipe"]), help="Micro-batch schedule."),
        click.option("--trace", "trace_file", type=click.Path(dir_okay=False),
                     help="Pipeline mode: write a Chrome-trace timeline of steps 2-4 here."),
        click.option("--metrics", "metrics_file", type=click.Path(dir_okay=False), help="Write JSON-lines metrics here."),
        click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="Write checkpoints here."),
        click.option("--checkpoint-every", type=int, help="Steps between checkpoints (0: every epoch)."),
        click.option("--resume", is_flag=True, default=None, help="Continue from the latest checkpoint."),
        click.option("--init-from", type=click.Path(dir_okay=False),
                     help="Initial values from a state_dict file; each owner reads its own keys (Job.init_from)."),
        click.option("--rebalance", is_flag=True, default=None,
                     help="Pipeline mode, Split or SplitAt stages: re-cut while training when the stages' measured work is uneven."),
        click.option("--spares", type=int, help="Pipeline mode: the last K processes hold no stage and take over a lost one."),
        click.option("--snapshot-every", type=int,
                     help="With --spares: steps between in-memory snapshots a lost stage is rebuilt from."),
        click.option("--hang-timeout", type=float, help="Seconds a silent worker may take before the job ends."),
        click.option("--stall-timeout", type=float, help="Seconds a step may go with no process working before the job ends (default: warn)."),
        click.option("--rpc-timeout", type=float, help="Seconds a call between processes may take (default 1800; 60 with --spares)."),
        click.option("--iface", envvar="RPCMP_IFACE", help="Network interface for RPC and gloo (env RPCMP_IFACE)."),
        click.option("--connect-timeout", type=float, envvar="RPCMP_CONNECT_TIMEOUT",
                     help="Seconds a worker waits for the master to be reachable (default 60)."),
        click.option("--debug", is_flag=True, help="On a stage's failure, print every frame (RPC and rpcmp too)."),
    ]
    for option in reversed(options):
        fn = option(fn)

    @functools.wraps(fn)
    def wrapper(**kw):
        keys = ("microbatches", "batch_size", "epochs", "max_steps", "threads", "transport", "schedule", "mode", "replicas",
                "rebalance", "spares", "snapshot_every", "accumulate", "precision", "wire", "sync_batchnorm", "batchnorm",
                "recompute", "checkpoint_dir", "checkpoint_every", "resume", "init_from", "hang_timeout", "stall_timeout", "rpc_timeout",
                "metrics_file", "trace_file")
        set_options(iface=kw.pop("iface", None), connect_timeout=kw.pop("connect_timeout", None))
        kw["overrides"] = {k: v for k in keys if (v := kw.pop(k, None)) is not None} or None
        debug = kw.pop("debug", False)
        try:
            return fn(**kw)
        except RpcmpError as exc:
            report(exc, debug)
            sys.exit(exit_code(exc))
    return wrapper


def report(exc: RpcmpError, debug: bool = False) -> None:
    """The one error report: ``error: Type: message`` on one line, then for a stage's failure its
    own traceback (the user's frames; every frame with ``--debug``) and the training step."""
    console = Console(stderr=True)
    console.print(f"[bold red]error:[/] {type(exc).__name__}: {escape(str(exc))}", highlight=False, soft_wrap=True)
    trace = getattr(exc, "full_traceback" if debug else "details", "")
    if trace:
        console.print(escape(trace.rstrip("\n")), highlight=False, soft_wrap=True, style="dim")
    if getattr(exc, "step", None):
        console.print(f"(during training step {exc.step})", highlight=False, style="dim")


def exit_code(exc: RpcmpError) -> int:
    """2 for a mistake in the input (a ValueError: the job, the declaration, a checkpoint of another
    model), 1 for a run that failed (a stage, a lost worker, a checkpoint that could not be written)."""
    return 2 if isinstance(exc, ValueError) else 1
