"""The training loop on the master: data, steps, progress, held-out metric."""
from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from torch.utils.data import DataLoader

from .errors import JobError
from .microbatch import batch_size
from .pipeline import Pipeline

__all__ = ["fit", "evaluate", "sample_batch"]


def fit(job, world_size: int, console: Console | None = None, pipeline: Pipeline | None = None) -> dict[str, Any]:
    """Train ``job`` on the stages of this RPC world; return losses and metrics."""
    console = console or Console()
    train_set, heldout = _datasets(job)
    loader = DataLoader(train_set, batch_size=job.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(job.seed))
    if len(loader) == 0:
        raise JobError(f"the training set has {len(train_set)} samples, fewer than one batch of {job.batch_size}")
    pipe = pipeline or Pipeline(job, world_size, sample=sample_batch(job) if _needs_sample(job) else None)
    _show_plan(console, pipe)
    total = len(loader) * job.epochs if job.max_steps is None else min(job.max_steps, len(loader) * job.epochs)
    before = evaluate(pipe, heldout, job) if heldout is not None and job.metric else None
    if before is not None:
        console.print(f"held-out {job.metric_name} before training: [bold]{before:.4f}[/]")
    losses, step, samples, start = [], 0, 0, time.perf_counter()
    columns = (TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[rate]:.1f} samples/s"),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=total, epoch=1, loss=float("nan"), rate=0.0)
        for epoch in range(job.epochs):
            pipe.train()
            for x, y in loader:
                if step >= total:
                    break
                loss = pipe.train_step(x, y).item()
                losses.append(loss)
                step += 1
                samples += batch_size(x)
                rate = samples / (time.perf_counter() - start)
                progress.update(task, advance=1, epoch=epoch + 1, loss=loss, rate=rate)
    elapsed = time.perf_counter() - start
    after = evaluate(pipe, heldout, job) if before is not None else None
    _show_summary(console, job, pipe, losses, elapsed, samples, before, after)
    return {"losses": losses, "metric_before": before, "metric_after": after,
            "samples_per_s": samples / elapsed, "steps": step}


def sample_batch(job) -> Any:
    """The first training batch's input, for balancing by time; None when the job has no data."""
    if not _needs_sample(job) or job.data is None:
        return None
    x = next(iter(DataLoader(_datasets(job)[0], batch_size=job.batch_size)))[0]
    return x


def _needs_sample(job) -> bool:
    return getattr(job.stages, "by", None) == "time" and getattr(job.stages, "parts", None) is not None


@torch.no_grad()
def evaluate(pipe: Pipeline, dataset, job) -> float:
    """Mean of ``job.metric`` over ``dataset`` (weighted by batch size), stages in eval mode."""
    pipe.eval()
    total, count = 0.0, 0
    for x, y in DataLoader(dataset, batch_size=job.batch_size):
        n = batch_size(x)
        total += float(job.metric(pipe.predict(x), y)) * n
        count += n
    pipe.train()
    return total / max(count, 1)


def _datasets(job):
    if job.data is None or job.loss is None:
        raise JobError("training needs Job(data=<callable returning (train, heldout)>, loss=<callable>)")
    got = job.data()
    if not (isinstance(got, tuple) and len(got) == 2):
        raise JobError(f"Job.data() must return (train_dataset, heldout_dataset_or_None), got {type(got).__name__}")
    return got


def _show_plan(console: Console, pipe: Pipeline) -> None:
    console.print("[bold]stages:[/] " + "  ".join(
        f"{s.index}:{s.name}@{p}" for s, p in zip(pipe.specs, pipe.places))
        + f"   micro-batches: {pipe.microbatches}")


def _show_summary(console, job, pipe, losses, elapsed, samples, before, after) -> None:
    table = Table(title="rpcmp run", show_header=True)
    table.add_column("stage")
    table.add_column("owner")
    table.add_column("compute s", justify="right")
    table.add_column("micro-batches", justify="right")
    for spec, place, st in zip(pipe.specs, pipe.places, pipe.stats()):
        table.add_row(f"{spec.index} {spec.name}", str(place), f"{st['compute_s']:.2f}", str(int(st["runs"])))
    console.print(table)
    if losses:
        console.print(f"steps {len(losses)}  loss {losses[0]:.4f} -> {losses[-1]:.4f}  "
                      f"{samples / elapsed:.1f} samples/s  {elapsed:.1f}s")
    if after is not None:
        console.print(f"held-out {job.metric_name}: [bold]{before:.4f} -> {after:.4f}[/]")
