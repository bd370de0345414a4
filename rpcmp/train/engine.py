"""What the trainer drives: one explicit protocol, :class:`Engine`, and its pipeline-mode
implementation (DDP mode's is :class:`rpcmp.train.ddp.DDPEngine`). The trainer (:mod:`rpcmp.train.trainer`)
decides when to step, evaluate, save and resume; an engine does each in its mode."""
from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
import torch.distributed.rpc as rpc
from rich.console import Console
from rich.table import Table

from ..core.checkpoint import latest_checkpoint, load_checkpoint
from ..data import data_loader, epoch_batches, step_groups
from ..core.health import reason, unless_lost, watch
from ..core.microbatch import batch_size, gather
from ..master.pipeline import Pipeline
from ..master.livecopy import LiveCopies
from ..master.recovery import RolledBack, Snapshots, read_resumed
from ..owner import move as owner_move
from ..plan.placement import process_name
from ..plan.writes import detached_note, whole_batch_note
from ..master.move import warm
from ..master.recut import Rebalancer
from ..master.replicas import pipeline_for
from ..job import check_movable
from ..errors import JobError, PartitionError, WorkerLostError
from ..plan.topology import Topology
from ..core.served import RunStatus, current

__all__ = ["Engine", "PipelineEngine", "make_engine", "evaluate", "RolledBack"]


class Engine(Protocol):
    """Everything the trainer asks of a mode; nothing else is reached for."""

    mode: str  # "pipeline" | "ddp": written into checkpoints
    is_main: bool  # the process that prints, logs and writes the index
    loss_scale: float | None  # fp16 loss scaling (None without), checkpointed
    scheduler: Any
    status: RunStatus  # what the run is doing, for failure messages (the trainer sets step and checkpoint)

    def steps_per_epoch(self, n: int) -> int: ...
    def epoch_loader(self, dataset, epoch: int, first_batch: int): ...
    def train_step(self, group: list) -> tuple[float, int]: ...  # raises RolledBack after a recovery
    def after_step(self, step: int, position: tuple[int, int], first: bool = False) -> str | None: ...
    def evaluate(self, dataset, between_epochs: bool = False) -> float: ...  # between_epochs: may raise RolledBack
    def train(self) -> None: ...
    def state_meta(self) -> dict[str, torch.Tensor]: ...
    def write_state(self, directory: str, step: int, keep_last: int, run: str) -> dict: ...
    def load_state(self, ckpt: dict) -> str | None: ...  # a line when an owner lost meanwhile was replaced
    def step_metrics(self) -> dict: ...
    def epoch_metrics(self) -> dict: ...
    def rng_state(self) -> Any: ...
    def load_rng_state(self, state) -> bool: ...
    def scheduler_state(self) -> dict: ...
    def load_scheduler_state(self, state) -> None: ...
    def saving(self, step: int): ...
    def resume_checkpoint(self, directory: str, run: str | None = None) -> dict | None: ...
    def remove_incomplete(self, directory: str) -> list[tuple[str, int]]: ...
    def describe(self) -> str: ...
    def explain(self, exc: BaseException) -> BaseException: ...
    def summary(self, console: Console) -> None: ...


def make_engine(job, world_size: int, train_set=None) -> Engine:
    if job.mode == "ddp":
        from .ddp import DDPEngine
        return DDPEngine(job)
    return PipelineEngine(pipeline_for(job, world_size), job, Topology.for_run(job, world_size))


class PipelineEngine:
    """What the trainer drives in pipeline mode: a :class:`Pipeline` and the batch order."""

    mode = "pipeline"
    is_main = True

    def __init__(self, pipe: Pipeline, job, topology: Topology | None = None):
        self.pipe, self.job = pipe, job
        self.replicated = topology is not None and topology.replicated
        self.status = pipe.status
        held = {place.process for _, _, place in pipe.rows}  # a spare may have taken a lost owner's stages in the build
        self.spares = [s for s in topology.spares if s not in held and s not in current().lost] if topology else []  # rank order
        every = job.snapshot_every if job.snapshot_every is not None else 10
        # Spares take over a lost owner's stage, rebuilt from a snapshot (see [Note: recovery from a lost owner]).
        self.snapshots = Snapshots(pipe, every, self.spares) if self.spares and not self.replicated else None
        # With replicas, from the live copy instead (see [Note: recovery from a live copy]).
        self.live = LiveCopies(pipe, self.spares) if self.spares and self.replicated else None
        self.at = (0, 0, 0)  # (step, epoch, batch) of the next step: where a live-copy recovery goes on from
        self.said: list[str] = []  # a recovery after which the failed step stood, until after_step says it
        self.recut_hook = self._landed_snapshot if self.snapshots is not None else None  # [Note: a re-cut and its snapshot]
        self.rebalancer = Rebalancer(pipe, before_commit=self.recut_hook) if job.rebalance else None
        self.oneoff = None  # `rpcmp rebalance`: (its Rebalancer, request number, nonce) until it has decided

    def steps_per_epoch(self, n: int) -> int:
        return n // self.job.batch_size // self.job.accumulate

    def epoch_loader(self, dataset, epoch: int, first_batch: int):
        batches = epoch_batches(len(dataset), self.job.batch_size, self.job.seed, epoch)
        return step_groups(dataset, batches, first_batch, self.job.accumulate, self.job.collate)

    def train_step(self, group: list) -> tuple[float, int]:
        # Accumulating k batches is one step over their concatenation in k x M micro-batches:
        # the same gradient, as each micro-batch's loss is weighted by its share of all samples.
        x, y = group[0] if len(group) == 1 else gather(group)
        recovery = self.snapshots or self.live
        if recovery is None:
            loss = self.pipe.train_step(x, y, chunks=self.pipe.batch_chunks * len(group))
            return loss.item(), batch_size(x)
        try:
            recovery.settle()  # the owners' copies of the last snapshot are made: the step may change them
            loss = self.pipe.train_step(x, y, chunks=self.pipe.batch_chunks * len(group))
        except Exception as exc:  # noqa: BLE001 - recovered, or re-raised as it was
            back = recovery.recover(exc, self.at)  # a RolledBack, or exc itself
            if back.stood is None:
                raise back from exc
            self.said.append(back.line)  # the step stood: after_step says how
            return back.stood, batch_size(x)
        return loss.item(), batch_size(x)

    def after_step(self, step: int, position: tuple[int, int], first: bool = False) -> str | None:
        """Between two steps: re-cut when it pays (Job.rebalance), drain the ranks `rpcmp drain` asked for,
        and snapshot the stages when it is due (spares), at the first step and after the stages changed
        place. Returns what changed, for the log, or None."""
        self.at = (step, *position)
        notes = [self.rebalancer.after_step(step)] if self.rebalancer is not None and not first else []
        notes, self.said = self.said + notes, []
        control = current().control
        if control is not None and not first:
            notes += [self._drain(control, number, rank, nonce) if action == "drain" else self._measure(control, number, nonce)
                      for number, action, rank, nonce in control.pending()]
            notes.append(self._once(control, step))
        notes = [n for n in notes if n]
        if notes and self.rebalancer is not None:
            self.rebalancer.since = None  # stages changed place: measure afresh
        if notes:  # a re-cut: each spare traces the cut it would build now (the pipeline's build had it trace the first)
            warm(self.spares, self.pipe.specs[0])
        if self.snapshots is not None:
            self.snapshots.snap(step, position) if first or notes else self.snapshots.after_step(step, position)
            notes, self.snapshots.notes = notes + self.snapshots.notes, []
        return "\n".join(notes + self._spares_lost()) or None

    def _landed_snapshot(self) -> None:
        """A snapshot of the stages where they are now, landed on every buddy (a re-cut's, a drain's, an evaluation's)."""
        self.snapshots.snap(self.at[0], self.at[1:], landed=True)

    def _spares_lost(self) -> list[str]:
        """The spares whose connection closed since the last step leave the list (see [Note: a death seen at once]);
        the others are watched from now on."""
        served = current()
        gone = [s for s in self.spares if s in served.lost]
        self.spares[:] = [s for s in self.spares if s not in gone]
        watch(self.spares, None)
        if not gone:
            return []
        left = (f"spares left: {', '.join(self.spares)}" if self.spares else
                "no spare is left: a lost owner now ends the run (resume from the last checkpoint)")
        return [f"spare {', '.join(gone)} lost (its connection closed); {left}"]

    def _measure(self, control, number: int, nonce: str) -> str | None:
        """``rpcmp rebalance``: measure once from the next step on and re-cut if it pays (answered by :meth:`_once`)."""
        try:
            check_movable(self.job.stages)
            self.oneoff = (Rebalancer(self.pipe, warmup=0, before_commit=self.recut_hook), number, nonce)
        except (JobError, PartitionError) as exc:
            control.answer(number, nonce, False, f"not re-cut: {exc}")
        return None

    def _once(self, control, step: int) -> str | None:
        if self.oneoff is None:
            return None
        rebalancer, number, nonce = self.oneoff
        note = rebalancer.after_step(step)
        if rebalancer.decided is not None:
            control.answer(number, nonce, True, rebalancer.decided)
            self.oneoff = None
        return note

    def _drain(self, control, number: int, rank: int, nonce: str) -> str:
        """Move every stage of ``rank`` to a spare and let the process go (see [Note: draining a rank])."""
        name = process_name(rank)
        copies = self.pipe.pipes if self.replicated else [self.pipe]
        r = next((i for i, p in enumerate(copies) if name in p.owners), 0)
        pipe = copies[r]
        held = [k for k, o in enumerate(pipe.owners) if o == name]
        why = None
        if rank == 0:
            why = "the master cannot be drained"
        elif name not in self.spares and not held:
            why = f"{name} is not a process of this job (or has left it)"
        elif held and not self.spares:
            why = "no spare process is free to take its stages (--spares)"
        if why is not None:
            control.answer(number, nonce, False, f"{name} not drained: {why}")
            return f"drain of {name} refused: {why}"
        if name in self.spares:
            self.spares.remove(name)
            text = f"drained {name}: a spare, it held no stage; it leaves the run"
        else:
            spare = self.spares.pop(0)
            try:
                took = sum(self.pipe.move_stage(k, f"{spare}/{pipe.places[k].device}", replica=r) for k in held)
            except WorkerLostError as exc:  # the spare, lost while it took a stage: the job goes on without it
                current().lost.add(spare)
                control.answer(number, nonce, False, f"{name} not drained: {exc}")
                return f"drain of {name} failed: {exc}"
            what = f"replica {r} stage" if self.replicated else "stage"
            text = (f"drained {name}: {what} {', '.join(str(k) for k in held)} moved to {spare} in {took:.2f} s; "
                    f"{name} leaves the run{self._landed_or_why()}")
        current().lost.add(name)
        rpc.rpc_sync(name, owner_move.leave_soon, args=(0,))
        control.answer(number, nonce, True, text)
        return text

    def _landed_or_why(self) -> str:
        """:meth:`_landed_snapshot`: a drain's before the drained rank leaves (see [Note: draining a rank]), an
        evaluation's before it starts; what to add to a drain's line when it could not land."""
        if self.snapshots is None or not self.spares:  # no spare left: no loss can be replaced, nothing to cover
            return ""
        try:
            self._landed_snapshot()
        except Exception as exc:  # noqa: BLE001 - said; the next call to the lost owner fails and recovers
            return f" (the snapshot after the move did not land: {reason(exc)})"
        return ""

    def evaluate(self, dataset, between_epochs: bool = False) -> float:
        """The held-out metric. With spares, an owner lost during the evaluation is replaced as in a step; an
        evaluation changes nothing of the model, so from a live copy, or from a snapshot of this very step (taken
        and landed first when the last one is older), no step is lost and the evaluation runs again. Where the
        stages went back to an older one (an owner lost as this one landed): ``between_epochs`` (or after the last
        step), raise the RolledBack (the trainer trains those steps again); else the run ends with the error."""
        recovery = self.snapshots or self.live
        if recovery is None:
            return evaluate(self.pipe, dataset, self.job)
        if self.snapshots is not None and self.at[0] not in self.snapshots.kept:
            self._landed_or_why()
        recovery.settle()
        try:
            return evaluate(self.pipe, dataset, self.job)
        except Exception as exc:  # noqa: BLE001 - recovered, or re-raised as it was
            back = recovery.recover(exc, self.at, in_step=False, redo="the held-out evaluation runs again")
            if back.position[0] != self.at[0]:  # from an older snapshot or checkpoint: steps to train again
                if between_epochs:
                    raise back from None
                raise exc from None
            print(back.line, flush=True)
            return evaluate(self.pipe, dataset, self.job)

    def train(self) -> None:
        self._between_steps(self.pipe.train, None)

    def _between_steps(self, call, default):
        """``call()`` to every owner between two steps, or ``default`` where it fails and a spare can take over:
        the next step or checkpoint meets the same lost owner and replaces it (see [Note: recovery from a lost
        owner]); without spares the error stands, as the trainer reports it."""
        if self.snapshots is None and self.live is None:
            return call()  # the trainer's report pings the owners itself
        got, gone = unless_lost(call, [place.process for _, _, place in self.pipe.rows], default)
        current().lost.update(gone)  # its end is no failure of the run, and it takes no part in a graceful shutdown
        return got

    def state_meta(self) -> dict:
        return self.pipe.state_meta()

    def write_state(self, directory: str, step: int, keep_last: int, run: str) -> dict:
        """The owners write the parts; the index names them (see [Note: a checkpoint nobody holds whole])."""
        return {"parts": self.pipe.save_stage_files(directory, step, keep_last, run), "optimizer": {}}

    def load_state(self, ckpt: dict) -> str | None:  # each owner reads its own keys; spares: a lost one is replaced
        return read_resumed(self.pipe, self.snapshots or self.live, ckpt)

    @property
    def scheduler(self):
        return self.pipe.scheduler

    def step_metrics(self) -> dict:
        return {"lr": self.pipe.lr, "grad_norm": self.pipe.last_grad_norm}

    def epoch_metrics(self) -> dict:
        stats = self._between_steps(self.pipe.stats, None)
        if stats is None:  # an owner was lost at the epoch's end: no figures for this epoch
            return {"stages": None}
        return {"stages": [{"stage": s.index, "name": s.name, "owner": str(p), "replica": r, "forward_s": st["compute_s"],
                            "micro_batches": st["runs"], "peak_rss_mib": st["peak_rss_mib"], "wall_s": st["wall_s"],
                            "process_cpu_s": st["process_cpu_s"], "mib_in": st["mib_in"], "mib_out": st["mib_out"]}
                           for (r, s, p), st in zip(self.pipe.rows, stats)]}

    def rng_state(self):
        return self.pipe.rng_state()

    def load_rng_state(self, state) -> bool:
        return self.pipe.load_rng_state(state)

    @property
    def loss_scale(self) -> float | None:
        return self.pipe.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.pipe.loss_scale = value

    def scheduler_state(self) -> dict:
        return self.pipe.scheduler_state()

    def load_scheduler_state(self, state) -> None:
        self.pipe.load_scheduler_state(state)

    @contextlib.contextmanager
    def saving(self, step: int):
        """The master writes every checkpoint. An owner lost while it writes its part is recovered as in a
        step (with spares), and the parts the others wrote of this unfinished checkpoint are removed."""
        recovery = self.snapshots or self.live
        try:
            yield True
        except Exception as exc:  # noqa: BLE001 - recovered, or re-raised as it was
            if recovery is None:
                raise
            back = recovery.recover(exc, self.at, in_step=False)
            if self.job.checkpoint_dir:
                self.remove_incomplete(self.job.checkpoint_dir)
            raise back from exc

    def resume_checkpoint(self, directory: str, run: str | None = None) -> dict | None:
        path = latest_checkpoint(directory, run)
        return load_checkpoint(path) if path else None

    def remove_incomplete(self, directory: str) -> list[tuple[str, int]]:
        return self.pipe.remove_incomplete(directory)

    def describe(self) -> str:
        pipe = self.pipe
        text = ("stages: " + "  ".join(f"{s.index}:{s.name}@{p}" for s, p in zip(pipe.specs, pipe.places))
                + (f"   x {self.job.replicas} replicas: " + "  ".join(
                    f"{s.index}@" + ",".join(str(row[s.index]) for row in pipe.grid) for s in pipe.specs)
                   if self.replicated else "")
                + f"   micro-batches: {pipe.batch_chunks}, schedule {pipe.schedule}, precision {self.job.precision}")
        if self.snapshots is not None:
            source = (f"the snapshot its neighbour keeps (every {self.snapshots.every} steps)" if self.snapshots.every
                      else "the run's last checkpoint (no snapshots: --snapshot-every 0)")
            text += (f"\nspares: {', '.join(self.snapshots.spares)}: one takes over the stages of a lost owner, rebuilt "
                     f"from {source}")
        if self.live is not None:
            text += (f"\nspares: {', '.join(self.live.spares)}: one takes over the stages of a lost owner, rebuilt from "
                     f"the live copy in another replica (no step lost)")
        if pipe.whole_batch_bn and pipe.microbatches > 1:
            text += "\n" + whole_batch_note(pipe.specs[0].writes, pipe.microbatches, pipe.specs[0].mixes)
        return text + "".join("\n" + detached_note(s) for s in pipe.specs if s.detached or s.detached_values or s.detached_posts)

    def explain(self, exc: BaseException) -> BaseException:
        return self.pipe.explain(exc)

    # -- the timeline (rpcmp.train.trainer.Tracer; pipeline mode only) -----------------------
    def start_trace(self) -> None:
        self._between_steps(self.pipe.start_trace, None)

    def stop_trace(self) -> dict[int, list] | None:
        """Each stage's trace slices; None when an owner was lost at the traced steps' end (with spares)."""
        return self._between_steps(self.pipe.stop_trace, None)

    @property
    def next_seq(self) -> int:
        return self.pipe.next_seq

    def stage_names(self) -> list[str]:
        return [s.name for s in self.pipe.specs]

    def summary(self, console: Console) -> None:
        table = Table(title="rpcmp run: stages", show_header=True,
                      caption="busy: the owner process's CPU time over the stage's lifetime (1 thread: 100% = never "
                              "waiting); MiB in/out: activations received/sent, gradients travel back the same")
        grid = self.replicated
        cols = ("replica",) * grid + ("stage", "owner", "micro-batches", "forward s", "busy", "MiB in", "MiB out",
                                      "peak RSS MiB")
        for col in cols:
            table.add_column(col, justify="left" if col in ("stage", "owner") else "right")
        stats = self._between_steps(self.pipe.stats, None)
        if stats is None:
            console.print("rpcmp run: no stage figures (an owner was lost after the last step)")
            return
        for (replica, spec, place), st in zip(self.pipe.rows, stats):
            busy = st["process_cpu_s"] / max(st["wall_s"], 1e-9) / max(torch.get_num_threads(), 1)
            table.add_row(*(str(replica),) * grid, f"{spec.index} {spec.name}", str(place), str(int(st["runs"])),
                          f"{st['compute_s']:.2f}", f"{busy:.0%}", f"{st['mib_in']:.1f}", f"{st['mib_out']:.1f}",
                          f"{st['peak_rss_mib']:.0f}")
        console.print(table)


@torch.no_grad()
def evaluate(pipe: Pipeline, dataset, job) -> float:
    """Mean of ``job.metric`` over ``dataset`` (weighted by batch size), stages in eval mode."""
    pipe.eval()
    total, count = 0.0, 0
    for x, y in data_loader(dataset, batch_size=job.batch_size, collate_fn=job.collate):
        n = batch_size(x)
        total += float(job.metric(pipe.predict(x), y)) * n
        count += n
    pipe.train()
    return total / max(count, 1)
