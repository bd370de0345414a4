"""The training loop on the master: data, steps, progress, held-out metric."""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..core.checkpoint import (CheckpointError, check_model_keys, latest_checkpoint, model_fingerprint,
                         new_run_id, save_checkpoint)
from ..core import health
from ..core.served import current
from ..errors import JobError
from ..plan.traced import SplitAt
from ..data import datasets
from .engine import RolledBack, make_engine
from .stop import StopRequest
from .timeline import write_chrome_trace

__all__ = ["fit", "building_stages"]


def fit(job, world_size: int, console: Console | None = None, engine=None) -> dict[str, Any]:
    """Train ``job``; in pipeline mode on the master, in DDP mode on every rank."""
    train_set, heldout = datasets(job)
    engine = engine or _built(job, world_size, train_set, console or Console())
    console = console or Console(quiet=not engine.is_main)
    per_epoch = engine.steps_per_epoch(len(train_set))
    if per_epoch == 0:
        raise JobError(f"the training set has {len(train_set)} samples, fewer than one step of "
                       f"{job.batch_size} x {job.accumulate} (batch_size x accumulate)")
    console.print(engine.describe())
    engine.status.checkpoint_dir = job.checkpoint_dir  # for the message that names a lost process
    with health.explained(engine.explain), StopRequest(engine.is_main and engine.mode == "pipeline") as stop:
        return _train(job, engine, console, train_set, heldout, per_epoch, stop)


def _built(job, world_size: int, train_set, console: Console):
    """The engine; in pipeline mode (on the master), said while its stages are built (:func:`building_stages`)."""
    if job.mode != "pipeline":
        return make_engine(job, world_size, train_set)
    current().status.checkpoint_dir = job.checkpoint_dir  # a process lost while the stages build: see fit
    with building_stages(job, console):
        return make_engine(job, world_size, train_set)


@contextlib.contextmanager
def building_stages(job, console: Console):
    """A line before the stages are built and one with how long that took (training and ``rpcmp predict``): a traced
    split (SplitAt) traces the model on the master first, seconds for a small model and minutes for a large one, with
    nothing else to show meanwhile."""
    traced = isinstance(job.stages, SplitAt)
    console.print(f"building the stages{' (tracing the model with torch.export)' if traced else ''} ...")
    start = time.perf_counter()
    yield
    console.print(f"stages built in {time.perf_counter() - start:.1f} s")


def _train(job, engine, console: Console, train_set, heldout, per_epoch: int, stop: StopRequest) -> dict[str, Any]:
    total = per_epoch * job.epochs if job.max_steps is None else min(job.max_steps, per_epoch * job.epochs)
    step, epoch, first_batch, run = _start(job, engine, console)
    run = _this_run(run, engine)
    engine.after_step(step, (epoch, first_batch), first=True)  # with spares: a snapshot to recover from
    before = engine.evaluate(heldout) if heldout is not None and job.metric else None
    if before is not None:
        console.print(f"held-out {job.metric_name} before training: [bold]{before:.4f}[/]")
    losses, samples, saved, after, start = [], 0, None, None, time.perf_counter()
    log = MetricsLog(job.metrics_file if engine.is_main else None)
    tracer = Tracer(engine, job, first=step + 2 if total - step > 1 else step + 1, last=min(total, step + 4))
    with Progress(*_progress_columns(), console=console, transient=False, disable=not engine.is_main) as progress:
        while (step < total and stop.signum is None) or (job.checkpoint_dir and saved != step) or (
                before is not None and after is None and stop.signum is None):
            if step >= total or stop.signum is not None:  # the last checkpoint, the metric (a rollback trains again)
                saved, after, step, epoch, first_batch = _last(job, engine, run, progress, losses, heldout, saved, step,
                                                               epoch, first_batch)
                continue
            engine.train()
            groups, steps = engine.epoch_loader(train_set, epoch, first_batch)
            task = progress.add_task("train", total=min(steps, first_batch + total - step), completed=first_batch,
                                     epoch=epoch + 1, loss=float("nan"), rate=0.0)  # a bar per epoch
            position, rolled = (epoch + 1, 0), False
            for k, group in enumerate(groups, start=first_batch):
                engine.status.step = step + 1
                step_start = time.perf_counter()
                tracer.before(step + 1)
                try:
                    loss, n = engine.status.stepping(engine.train_step, group)  # see [Note: a stalled step]
                except RolledBack as back:  # a lost owner was replaced: see rpcmp/master/recovery.py
                    (step, position), rolled = _rolled_back(back, progress, task, losses, step), True
                    break
                tracer.after(step + 1)
                losses.append(loss)
                step += 1
                samples += n
                log.write(kind="step", step=step, epoch=epoch + 1, loss=loss, samples=n,
                          step_s=time.perf_counter() - step_start, **engine.step_metrics())
                progress.update(task, advance=1, epoch=epoch + 1, loss=loss,
                                rate=samples / (time.perf_counter() - start))
                position = (epoch, k + 1) if k + 1 < steps else (epoch + 1, 0)
                if note := engine.after_step(step, position):  # a re-cut (Job.rebalance) says what it did
                    progress.console.print(note, soft_wrap=True)
                if job.checkpoint_dir and job.checkpoint_every and step % job.checkpoint_every == 0:
                    saved, step, *position = _save_or_roll_back(job, engine, run, progress, task, losses, step, *position)
                    if rolled := saved is None:  # an owner lost while it wrote its part: train again from where it says
                        break
                if step >= total or stop.signum is not None:  # see [Note: stopping a run]
                    break
            wanted = position[0] > epoch and step < total and before is not None and stop.signum is None
            back = None if rolled else _epoch_end(job, engine, progress, log, heldout if wanted else None, epoch, step,
                                                  samples / (time.perf_counter() - start))
            if back is not None:  # an owner lost in the evaluation, replaced from an older snapshot: train again
                (step, position), rolled = _rolled_back(back, progress, task, losses, step), True
            epoch, first_batch = position
            if not rolled and job.checkpoint_dir and not job.checkpoint_every and saved != step:
                saved, step, epoch, first_batch = _save_or_roll_back(job, engine, run, progress, task, losses, step, epoch,
                                                                     first_batch)
    return _finish(job, engine, console, log, tracer, before, after, losses, samples, step, time.perf_counter() - start,
                   stop.name)


def _this_run(run: str | None, engine) -> str:
    """The run this one continues, or a new one (a run prunes only its own checkpoints: rpcmp/core/checkpoint.py)."""
    run = run or new_run_id()
    served = current()
    if served.keep_run is not None and engine.is_main:
        served.keep_run(run)  # a restarted attempt continues this run: see [Note: a restart resumes by itself]
    return run


def _epoch_end(job, engine, progress, log, heldout, epoch: int, step: int, rate: float) -> RolledBack | None:
    """An epoch's end: the held-out metric (where ``heldout`` is given) and the epoch's record; or the RolledBack
    of a recovery in the evaluation that went back to an older snapshot (see the engine's ``evaluate``)."""
    try:
        metric = engine.evaluate(heldout, between_epochs=True) if heldout is not None else None
    except RolledBack as back:
        return back
    if metric is not None:
        progress.console.print(f"epoch {epoch + 1}: held-out {job.metric_name} {metric:.4f}")
    log.write(kind="epoch", step=step, epoch=epoch + 1, samples_per_s=rate, heldout_metric=metric,
              **engine.epoch_metrics())
    return None


def _rolled_back(back, progress, task, losses: list, step: int) -> tuple[int, tuple[int, int]]:
    """After a recovery: say it, drop the losses of the steps to train again; where to go on from."""
    progress.console.print(back.line, soft_wrap=True)
    if task is not None:
        progress.remove_task(task)
    del losses[len(losses) - (step - back.position[0]):]
    return back.position[0], back.position[1:]


def _progress_columns() -> tuple:
    return (TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[rate]:.1f} samples/s"),
            TimeRemainingColumn())


def _finish(job, engine, console: Console, log, tracer, before, after, losses: list, samples: int, step: int,
            elapsed: float, stopped: str | None) -> dict[str, Any]:
    """The end of a run: the timeline, the held-out metric, the last metrics record and the summary."""
    tracer.finish(console)
    log.write(kind="end", step=step, metric_before=before, metric_after=after,
              seconds=elapsed, samples_per_s=samples / elapsed if elapsed else 0.0, stopped=stopped)
    log.close()
    engine.summary(console)
    if losses:
        console.print(f"steps {len(losses)}  loss {losses[0]:.4f} -> {losses[-1]:.4f}  "
                      f"{samples / elapsed:.1f} samples/s  {elapsed:.1f}s")
    if after is not None:
        console.print(f"held-out {job.metric_name}: [bold]{before:.4f} -> {after:.4f}[/]")
    if stopped is not None:
        console.print(f"stopped by {stopped} after step {step}: " + (
            f"checkpoint in {job.checkpoint_dir}, continue with --resume" if job.checkpoint_dir
            else "no --checkpoint-dir, so the trained steps are not saved"), soft_wrap=True)
    return {"losses": losses, "metric_before": before, "metric_after": after,
            "samples_per_s": samples / elapsed if elapsed else 0.0, "steps": step, "stopped": stopped}


class Tracer:
    """Traces steps ``first..last`` of a pipeline run into ``Job.trace_file`` (see :mod:`rpcmp.train.timeline`)."""

    def __init__(self, engine, job, first: int, last: int):
        self.on = bool(job.trace_file) and engine.mode == "pipeline"
        self.engine, self.job, self.first, self.last, self.steps = engine, job, first, last, []
        if self.on:  # its folder, now: as the metrics' (a path that cannot be written fails before training)
            _folder_for(job.trace_file, "--trace")

    def before(self, step: int) -> None:
        if self.on and step == self.first:  # again after a rollback to before it: the replayed steps are traced
            self.steps = []
            self.engine.start_trace()
        if self.on and self.first <= step <= self.last:
            self._seq0 = self.engine.next_seq

    def after(self, step: int) -> None:
        if self.on and self.first <= step <= self.last:
            self.steps.append({"step": step, "seqs": list(range(self._seq0, self.engine.next_seq))})
            if step == self.last:
                events = self.engine.stop_trace()
                for st in self.steps:
                    st["events"] = events

    def finish(self, console: Console) -> None:
        if not (self.on and self.steps and "events" in self.steps[-1]):
            return
        if self.steps[-1]["events"] is None:
            console.print(f"trace not written to {self.job.trace_file}: an owner was lost as the traced steps ended, "
                          f"with its slices (its stage went on on a spare)", soft_wrap=True)
            return
        try:
            summary = write_chrome_trace(self.job.trace_file, self.steps, self.engine.stage_names(),
                                         len(self.steps[0]["seqs"]))
        except OSError as exc:  # the folder went away, the disk filled: the run itself is not lost for it
            console.print(f"warning: trace not written to {self.job.trace_file}: {exc}", soft_wrap=True)
            return
        hidden = "" if summary["overlap"] is None else f"; transfers overlapped by compute {summary['overlap']:.0%}"
        console.print(f"trace of steps {summary['steps']} written to {self.job.trace_file}: bubble "
                      f"{summary['bubble']:.3f} measured, {summary['ideal_bubble']:.3f} ideal (S-1)/(M+S-1){hidden}",
                      soft_wrap=True)  # one line: the file's path whole


def _folder_for(path: str, option: str) -> None:
    """Make the folder of the file ``path`` that ``option`` names, or say why it cannot be made."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as exc:
        raise JobError(f"{option} {path}: its folder cannot be made ({exc.strerror}: {exc.filename}); give a path "
                       f"in a folder this process can write") from None


class MetricsLog:
    """JSON lines, one object per step, epoch and run end (``Job.metrics_file`` / ``--metrics``)."""

    def __init__(self, path: str | None):
        self.file = None
        if path:
            _folder_for(path, "--metrics")
            self.file = open(path, "a")

    def write(self, **record) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"time": time.time(), **record}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _last(job, engine, run: str, progress, losses: list, heldout, saved: int | None, step: int, epoch: int,
          next_batch: int) -> tuple[int | None, float | None, int, int, int]:
    """After the last step, its checkpoint (where one is due), then the held-out metric: (the step saved, the metric
    or None, step, epoch, next batch). Either may roll every stage back to an older snapshot (an owner lost as it
    wrote its part, or in the evaluation as its snapshot landed: rpcmp/master/recovery.py); the run then trains
    those steps again. A checkpoint written before the evaluation's rollback stands: the steps trained again
    end where it is."""
    if job.checkpoint_dir and saved != step:
        saved, step, epoch, next_batch = _save_or_roll_back(job, engine, run, progress, None, losses, step, epoch,
                                                            next_batch)
        return saved, None, step, epoch, next_batch
    try:
        return saved, engine.evaluate(heldout, between_epochs=True), step, epoch, next_batch
    except RolledBack as back:
        step, (epoch, next_batch) = _rolled_back(back, progress, None, losses, step)
        return saved, None, step, epoch, next_batch


def _save_or_roll_back(job, engine, run: str, progress, task, losses: list, step: int, epoch: int,
                       next_batch: int) -> tuple[int | None, int, int, int]:
    """A checkpoint between epochs or at the end: (the step saved, step, epoch, next batch); an owner lost while
    it wrote its part was replaced and every stage rolled back (rpcmp/master/recovery.py): (None, where to go on)."""
    try:
        return _save(job, engine, run, step, epoch, next_batch), step, epoch, next_batch
    except RolledBack as back:
        step, (epoch, next_batch) = _rolled_back(back, progress, task, losses, step)
        return None, step, epoch, next_batch


def _save(job, engine, run: str, step: int, epoch: int, next_batch: int) -> int:
    # DDP: every rank holds the same state; rank 0 writes it while the others wait (see DDPEngine.saving)
    with engine.saving(step) as writer:
        rng = engine.rng_state()  # DDP: a collective, so every rank takes part
        if writer:
            _write(job, engine, run, step, epoch, next_batch, rng)
    return step


def _write(job, engine, run: str, step: int, epoch: int, next_batch: int, rng) -> None:
    cls, _ = job.optimizer
    state = engine.write_state(job.checkpoint_dir, step, job.keep_last, run)  # the model and optimizer state
    state["optimizer"]["class"] = cls.__name__
    engine.status.checkpoint = save_checkpoint(job.checkpoint_dir, {
        "mode": engine.mode, "fingerprint": model_fingerprint(engine.state_meta()), **state,
        "scheduler": engine.scheduler_state() if engine.scheduler is not None else None,
        "step": step, "epoch": epoch, "next_batch": next_batch, "seed": job.seed,
        "rng": rng, "loss_scale": engine.loss_scale,
    }, step, job.keep_last, run)


def _start(job, engine, console: Console) -> tuple[int, int, int, str | None]:
    """Where training starts: (step, epoch, next batch, run it continues). A restarted attempt under
    torchrun resumes the earlier attempt's run by itself (see [Note: a restart resumes by itself] in
    rpcmp/launch/runtime.py); files an interrupted save left are removed first."""
    served = current()
    if served.attempt:
        why = f"attempt {served.attempt + 1} of this job (torchrun restarted it)"
        if not job.checkpoint_dir:
            console.print(f"{why}: no --checkpoint-dir, so training starts again from step 0")
        elif served.previous_run is None and not job.resume:
            console.print(f"{why}: the attempt before trained no step, so training starts from step 0")
        else:
            console.print(f"{why}: continuing run {served.previous_run or '(the latest)'} from {job.checkpoint_dir}")
    if job.checkpoint_dir:
        removed = engine.remove_incomplete(job.checkpoint_dir)
        if removed:
            console.print(f"removed {len(removed)} files ({sum(b for _, b in removed) / 2**20:.1f} MiB) that an "
                          f"interrupted save left in {job.checkpoint_dir}: " + ", ".join(n for n, _ in removed[:4])
                          + (", ..." if len(removed) > 4 else ""))
    resume = job.resume or (served.previous_run is not None and job.checkpoint_dir)
    if not resume and job.checkpoint_dir and (latest := latest_checkpoint(job.checkpoint_dir)):  # a forgotten --resume?
        console.print(f"{job.checkpoint_dir} holds another run's checkpoints (the latest: {os.path.basename(latest)}): "
                      f"this run starts from step 0 as a new run and keeps its own beside them (--resume continues the "
                      f"latest)")
    return _resume(job, engine, console, served.previous_run) if resume else (0, 0, 0, None)


def _resume(job, pipe, console: Console, run: str | None = None) -> tuple[int, int, int, str | None]:
    """Load the checkpoint written last in the folder (of run ``run``, if given); return (step, epoch,
    next batch, run it continues)."""
    if not job.checkpoint_dir:
        raise JobError("resume needs a checkpoint directory: pass --checkpoint-dir DIR (or Job.checkpoint_dir)")
    ckpt = pipe.resume_checkpoint(job.checkpoint_dir, run)  # DDP: rank 0's, on every rank
    if ckpt is None:
        console.print(f"no checkpoint {f'of run {run} ' if run else ''}in {job.checkpoint_dir} yet: starting from step 0")
        return 0, 0, 0, run
    model = pipe.state_meta()  # keys, shapes and dtypes only: see [Note: a checkpoint nobody holds whole]
    check_model_keys(ckpt, model, "this job's model")
    if ckpt.get("fingerprint") not in (None, model_fingerprint(model)):
        raise CheckpointError(f"checkpoint {ckpt['path']} is from another model than this job's (its keys, shapes or "
                              f"dtypes differ): point --checkpoint-dir at this job's checkpoints, or start without --resume")
    cls, _ = job.optimizer
    if ckpt["optimizer"]["class"] != cls.__name__:
        raise CheckpointError(f"checkpoint {ckpt['path']} holds {ckpt['optimizer']['class']} state but the job uses "
                              f"{cls.__name__}: use the same optimizer, or start without --resume")
    # first: an owner lost while the stages read the checkpoint gives its spare the generators it had
    rng = pipe.load_rng_state(ckpt.get("rng")) if ckpt["mode"] == pipe.mode else False
    pipe.status.checkpoint = ckpt["path"]  # what a lost owner's stages are rebuilt from until a snapshot holds them
    recovered = pipe.load_state(ckpt)  # a line: an owner lost while it read its part was replaced (spares)
    if recovered:
        console.print(recovered, soft_wrap=True)
    if pipe.scheduler is not None and ckpt.get("scheduler"):
        pipe.load_scheduler_state(ckpt["scheduler"])
    if ckpt.get("loss_scale") and pipe.loss_scale:
        pipe.loss_scale = ckpt["loss_scale"]
    run = ckpt.get("run")
    console.print(f"resumed run {run or '(unnamed)'} at step {ckpt['step']} from {ckpt['path']} (written in {ckpt['mode']} mode)"
                  + ("" if rng else "; random number generators start afresh (saved in the other mode, or with other stages "
                                    "or ranks on each process), so dropout draws other masks than an uninterrupted run would"))
    return ckpt["step"], ckpt["epoch"], ckpt["next_batch"], run
