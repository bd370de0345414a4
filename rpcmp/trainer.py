"""The training loop on the master: data, steps, progress, held-out metric."""
from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from torch.utils.data import DataLoader

from .checkpoint import CheckpointError, check_model_keys, latest_checkpoint, load_checkpoint, save_checkpoint
from . import health
from .errors import JobError
from .microbatch import batch_size
from .pipeline import Pipeline

__all__ = ["fit", "evaluate", "sample_batch", "epoch_batches"]


def fit(job, world_size: int, console: Console | None = None, pipeline: Pipeline | None = None) -> dict[str, Any]:
    """Train ``job`` on the stages of this RPC world; return losses and metrics."""
    console = console or Console()
    train_set, heldout = _datasets(job)
    per_epoch = len(train_set) // job.batch_size
    if per_epoch == 0:
        raise JobError(f"the training set has {len(train_set)} samples, fewer than one batch of {job.batch_size}")
    pipe = pipeline or Pipeline(job, world_size, sample=sample_batch(job) if _needs_sample(job) else None)
    _show_plan(console, pipe)
    total = per_epoch * job.epochs if job.max_steps is None else min(job.max_steps, per_epoch * job.epochs)
    step, epoch, first_batch = _resume(job, pipe, console) if job.resume else (0, 0, 0)
    before = evaluate(pipe, heldout, job) if heldout is not None and job.metric else None
    if before is not None:
        console.print(f"held-out {job.metric_name} before training: [bold]{before:.4f}[/]")
    losses, samples, saved, start = [], 0, None, time.perf_counter()
    columns = (TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[rate]:.1f} samples/s"),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=total, completed=step, epoch=epoch + 1, loss=float("nan"), rate=0.0)
        while step < total:
            pipe.train()
            batches = epoch_batches(len(train_set), job.batch_size, job.seed, epoch)
            loader = DataLoader(train_set, batch_sampler=batches[first_batch:])
            for k, (x, y) in enumerate(loader, start=first_batch):
                health.status["step"] = step + 1
                try:
                    loss = pipe.train_step(x, y).item()
                except Exception as exc:
                    raise health.explain(exc, {p.process for p in pipe.places}) from exc
                losses.append(loss)
                step += 1
                samples += batch_size(x)
                progress.update(task, advance=1, epoch=epoch + 1, loss=loss,
                                rate=samples / (time.perf_counter() - start))
                position = (epoch, k + 1) if k + 1 < len(batches) else (epoch + 1, 0)
                if job.checkpoint_dir and job.checkpoint_every and step % job.checkpoint_every == 0:
                    saved = _save(job, pipe, step, *position)
                if step >= total:
                    break
            epoch, first_batch = position
            if job.checkpoint_dir and not job.checkpoint_every and saved != step:
                saved = _save(job, pipe, step, epoch, first_batch)
    if job.checkpoint_dir and saved != step:
        _save(job, pipe, step, epoch, first_batch)
    elapsed = time.perf_counter() - start
    after = evaluate(pipe, heldout, job) if before is not None else None
    _show_summary(console, job, pipe, losses, elapsed, samples, before, after)
    return {"losses": losses, "metric_before": before, "metric_after": after,
            "samples_per_s": samples / elapsed if elapsed else 0.0, "steps": step}


def epoch_batches(n: int, size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: a permutation fixed by (seed, epoch), incomplete batch dropped.

    Fixed so that a resumed run reads exactly the batches the interrupted one would have.
    """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
    return [order[i * size:(i + 1) * size] for i in range(n // size)]


def _save(job, pipe: Pipeline, step: int, epoch: int, next_batch: int) -> int:
    cls, _ = job.optimizer
    health.status["checkpoint"] = save_checkpoint(job.checkpoint_dir, {
        "mode": "pipeline", "model": pipe.state_dict(),
        "optimizer": {"class": cls.__name__, "state": pipe.optimizer_state()},
        "step": step, "epoch": epoch, "next_batch": next_batch, "seed": job.seed,
    }, step, job.keep_last)
    return step


def _resume(job, pipe: Pipeline, console: Console) -> tuple[int, int, int]:
    if not job.checkpoint_dir:
        raise JobError("resume needs a checkpoint directory: pass --checkpoint-dir DIR (or Job.checkpoint_dir)")
    if latest_checkpoint(job.checkpoint_dir) is None:
        console.print(f"no checkpoint in {job.checkpoint_dir} yet: starting from step 0")
        return 0, 0, 0
    ckpt = load_checkpoint(job.checkpoint_dir)
    check_model_keys(ckpt, pipe.state_dict(), "this job's model")
    cls, _ = job.optimizer
    if ckpt["optimizer"]["class"] != cls.__name__:
        raise CheckpointError(f"checkpoint {ckpt['path']} holds {ckpt['optimizer']['class']} state but the job uses "
                              f"{cls.__name__}: use the same optimizer, or start without --resume")
    pipe.load_state_dict(ckpt["model"])
    pipe.load_optimizer_state(ckpt["optimizer"]["state"])
    console.print(f"resumed from {ckpt['path']} (step {ckpt['step']}, written in {ckpt['mode']} mode)")
    return ckpt["step"], ckpt["epoch"], ckpt["next_batch"]


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
