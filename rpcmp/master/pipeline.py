"""The master side: a model cut into stages that live on other processes.

Runs inside an initialised RPC world (see :mod:`rpcmp.launch.runtime`)::

    pipe = Pipeline(job, world_size=3)       # builds each stage on its owner
    loss = pipe.train_step(x, y)             # M micro-batches, dist autograd, optimizer step
    out = pipe.predict(x)                    # no autograd anywhere
    state = pipe.state_dict()                # keys of the unsplit model

See [Note: why activations skip the master] in :mod:`rpcmp.owner.stage`.

[Note: one context per micro-batch]
(Each schedule's plan is data in :mod:`rpcmp.plan.schedule`; :mod:`rpcmp.master.executor` runs it.)
With ``schedule="overlap"`` (the default) every micro-batch gets its own
distributed-autograd context, driven by its own thread on the master: its loss and
``dist_autograd.backward`` start the moment its output arrives, while later
micro-batches are still in the forward pass (1F1B-style overlap of forward and backward
across stages). All M forwards are issued at once, so activation memory is that of
GPipe. ``schedule="1f1b"`` bounds it as 1F1B does: micro-batch i enters the pipeline
only when micro-batch i - S has left every stage (its backward and gradient merge are
done), so at most S micro-batches hold activations on any stage: less memory for a
little more step time. Holding instead stage k's forward of micro-batch i
until its own backward of i - (S - k) has passed, a strict 1F1B order on every stage,
was slower: the last stage then alternates forward and backward and every latency
between them lies on the critical path. Each context's backward is an independent graph task on every stage, so
gradients flow upstream one micro-batch at a time. Within one shared context the
autograd engine orders nodes by per-thread sequence numbers and runs the nodes that
received activations over RPC last, so every stage finished all M backward passes before
sending any gradient upstream, and the drain ran serially.
As soon as micro-batch i's backward has left a stage (and i - 1's is merged, so that the sums
always add up in the same order), its owner adds its gradients into the first context's, and
once the master's backward of i is done the context is released: an owner holds two copies of its
gradients at a time, not M, and the merges overlap the remaining backward passes (see [Note: a
pipeline's merges where its gradients are made] in :mod:`rpcmp.owner.reduce`). The DistributedOptimizer steps with the
first context. The loss of micro-batch i is weighted by its share of the batch,
which is exact for losses that are means over samples (checked on the first step, see
:func:`rpcmp.master.executor.check_mean_loss`). ``schedule="gpipe"`` computes the loss once on the gathered
output: exact for any loss (a batch-level Dice), with less overlap; each backward starts
from its part of that loss's gradient and is merged as above (one context shared by the M
summed them in the order they reached each owner: another rounding each run). Figures: benchmarks/PERFORMANCE.md.

[Note: BatchNorm and micro-batches]
A BatchNorm layer in training mode normalises with the statistics of the batch it sees;
split into M micro-batches it would see M smaller ones, and outputs, gradients and
running statistics would depend on M. ``Job(batchnorm="batch")`` (the default) keeps the
whole-batch result exactly: a model with BatchNorm runs each training batch as one
micro-batch. There is no cheaper exact way: every sample's output of a BatchNorm layer
depends on every sample's input to it, and its backward on every sample's gradient, so
no micro-batch can pass the layer, either way, before all have reached it, and a stage
holding one cannot overlap with its neighbours. ``batchnorm="micro"`` pipelines the M
micro-batches as GPipe does: each is normalised with its own statistics and updates the
running statistics (M updates per batch). Committing whole-batch running statistics
once per batch instead (torchgpipe's deferred batch norm) was measured and dropped: the
whole-batch variance is not the micro-batch variance the layers were trained with, and
the held-out Dice collapsed (figures: benchmarks/PERFORMANCE.md, design measurements).
"""
from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.nn import RemoteModule

from ..core import health
from . import inbox, move, recut, tied
from ..owner import grads, stage
from ..errors import JobError, StageError
from ..data import needs_sample, sample_batch
from .building import build_stages
from .executor import run_step
from .sync import LocalMerge
from ..core.futures import call_each, wait_all
from ..core.groups import Grouped, plan_groups
from ..core.hparams import StageFields
from ..plan.schedule import SCHEDULES
from ..core.microbatch import batch_size, gather, map_tensors, scatter
from ..plan.partition import StageSpec, cached_meta, plan_stages
from ..plan.placement import Place, resolve_placement
from ..plan.topology import stage_world
from ..core.policy import GradientPolicy, NonFinite
from ..core.served import RunStatus, current
from ..plan.lengths import check_sizes
from .state import PipelineState

__all__ = ["Pipeline"]


class Pipeline(PipelineState):
    """A model split into stages, each owned by the process its placement names."""

    def __init__(self, job, world_size: int, *, microbatches: int | None = None,
                 optimizer: tuple | None = None, schedule: str | None = None, sample: Any = None,
                 status: RunStatus | None = None, places: list[Place] | None = None, sync=None,
                 specs: list[StageSpec] | None = None, spares: list[str] | None = None):
        self.job = job
        self.microbatches = microbatches or job.microbatches
        self.schedule = schedule or job.schedule
        if self.schedule not in SCHEDULES:
            raise JobError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        self.specs: list[StageSpec] = specs or self.plan(job, sample)
        self.groups = plan_groups(job, cached_meta(job), optimizer) if job.param_groups is not None else None
        holding = stage_world(job, world_size)
        self.places: list[Place] = list(places or resolve_placement(job.placement, len(self.specs), holding,
                                                                    world_size - holding))
        # how gradients come together before the step: one pipeline's merge, or one copy's share of
        # the replicas' average (rpcmp/master/sync.py; [Note: replicas of a pipeline])
        self.sync = sync or LocalMerge()
        self.owners = [p.process for p in self.places]
        served = current()
        self.pid, self._seq = served.next_pipeline_id(), 0
        self.status = status or served.status  # what failure messages say the run was doing
        self.label_stages()
        options = {k: getattr(job, k) for k in ("precision", "device_maps", "recompute", "wire")}
        options["owners"], options["deliver"] = list(self.owners), inbox.deliver
        self.build_options = options  # what a stage built later is built with (rpcmp.master.move)
        built = build_stages(self, world_size, spares)  # a lost owner's stages on a spare: see rpcmp/master/building.py
        self.stage_rrefs = [refs for refs, _, _ in built]  # each stage's parameters, for the DistributedOptimizer
        self.param_rrefs = [r for refs in self.stage_rrefs for r in refs]
        # Each stage as PyTorch's RPC API knows it (forward_async, remote_parameters, get_module_rref); the
        # pipeline's own hot path runs the same module on its owner, stage to stage, without these handles.
        self.stages: list[RemoteModule] = [RemoteModule.init_from_module_rref(str(place), module)
                                           for (_, _, module), place in zip(built, self.places)]
        if job.init_from:
            self.init_from(job.init_from)
        # See [Note: BatchNorm and micro-batches].
        self.whole_batch_bn = job.batchnorm == "batch" and any(bn for _, bn, _ in built)
        cls, kwargs = optimizer or job.optimizer
        local = Grouped(cls, self.groups) if self.groups is not None else cls  # see [Note: parameter groups]
        self.optimizer_spec = (local, kwargs)  # what a local optimizer built later is built with (rpcmp.master.move)
        self.optimizer = move.distributed_optimizer(local, self.param_rrefs, **kwargs) if self.param_rrefs else None
        move.register_optimizers(self)
        self.param_owners = sorted({r.owner().name for r in self.param_rrefs})
        self.nonfinite = NonFinite(job.nonfinite)
        self.gradients = GradientPolicy(job.precision == "fp16", job.clip_grad_norm)
        # see [Note: schedulers in pipeline mode]
        self.fields = StageFields((cls, kwargs), job.scheduler, self._write_fields, self.groups)
        self.loss_checked = False  # see executor.check_mean_loss
        self._threads = ThreadPoolExecutor(max(1, self.microbatches * job.accumulate), thread_name_prefix="rpcmp-micro")

    @staticmethod
    def plan(job, sample: Any = None) -> list[StageSpec]:
        """The stages of ``job`` (traced, or profiled on ``sample`` for ``Split(by="time")``)."""
        if sample is None and needs_sample(job):
            sample = sample_batch(job)  # Split(by="time") profiles the layers on the job's first batch
        return plan_stages(job, sample)

    # -- running micro-batches ------------------------------------------------
    def forward(self, x: Any, grad: bool, chunks: int | None = None) -> Any:
        """Run ``x`` through every stage as M micro-batches; return the gathered output.

        With ``grad=True`` this must run inside a ``dist_autograd.context()``.
        """
        check_sizes(self.specs[0].sizes, x)  # see [Note: any sequence length]
        health.watch(self.owners, self.pid)  # an evaluation's too: see [Note: a death seen at once]
        parts = scatter(x, chunks or self.microbatches)
        first, seqs = self.places[0].process, self.next_seqs(len(parts))
        try:
            outs = wait_all([inbox.send(self.pid, s, first, p, grad, self.owners, len(parts) == 1) for s, p in zip(seqs, parts)])
        except Exception:
            inbox.abandon(self.pid, seqs)
            self.resync()
            raise
        return gather([self.to_fp32(out) for out in outs])

    def to_fp32(self, out: Any) -> Any:
        if self.job.precision == "fp32":
            return out
        return map_tensors(out, lambda t: t.float() if t.is_floating_point() else t)  # the loss is computed in fp32

    def train_step(self, x: Any, y: Any, chunks: int | None = None) -> torch.Tensor:
        """One optimizer step on batch ``(x, y)`` in ``chunks`` micro-batches; returns the loss.

        ``chunks`` defaults to M, or to 1 for a model with BatchNorm under ``Job(batchnorm="batch")``.
        The schedule's plan (:mod:`rpcmp.plan.schedule`) says how; :mod:`rpcmp.master.executor` runs it.
        """
        health.watch(self.owners, self.pid)  # owners new since the last step too: see [Note: a death seen at once]
        return run_step(self, self.schedule, x, y, chunks or self.batch_chunks)

    def micro_threads(self, count: int) -> ThreadPoolExecutor:
        """The master's micro-batch threads: every micro-batch of a step must run at once (a barrier)."""
        if count > self._threads._max_workers:
            self._threads.shutdown(wait=False)
            self._threads = ThreadPoolExecutor(count, thread_name_prefix="rpcmp-micro")
        return self._threads

    def backward(self, ctx: int, loss: torch.Tensor) -> None:
        """``dist_autograd.backward``, with a failure on another process named by its stages."""
        try:
            dist_autograd.backward(ctx, [self._scaled(loss)])
        except RuntimeError as exc:
            node, text = None, str(exc)  # passed on by later stages, it arrives nested: the innermost node failed
            while (found := re.match(r"Error on Node (\d+): (.*)", text, re.S)) is not None:
                node, text = found.group(1), found.group(2)
            if node is None:
                raise
            names = {rpc.get_worker_info(o).id: o for o in set(self.owners)}
            owner = names.get(int(node), f"rank {node}")
            held = ", ".join(f"stage {s.index} ({s.name})" for s in self.held().get(owner, []))
            raise StageError(f"the backward pass failed on {owner} ({held or 'no stage'}): {text}") from None

    @property
    def batch_chunks(self) -> int:
        """Micro-batches per training batch: M, or 1 for whole-batch BatchNorm."""
        return 1 if self.whole_batch_bn else self.microbatches

    @property
    def predicts_whole(self) -> bool:
        """Whether a batch is predicted as one micro-batch: the model's samples meet (see [Note: samples that meet in
        the model] in rpcmp/plan/writes.py) and Job.batchnorm keeps whole batches."""
        return bool(self.specs[0].mixes) and self.job.batchnorm == "batch"

    @property
    def steps_in_backward(self) -> bool:
        """Whether owners may take the optimizer step in the backward (see [Note: a step steps where its gradients
        are made] in rpcmp/owner/stepping.py)."""
        return (self.optimizer is not None and type(self.sync) is LocalMerge and not self.gradients.needs_norm
                and not tied.shared_groups(self.specs))

    def allows_update(self, loss: torch.Tensor) -> bool:
        """``Job.nonfinite`` on the step's loss: False (skip) or raise for a NaN or infinite one."""
        return self.nonfinite.allows(loss)

    def apply_step(self, ctx_id: int, loss: torch.Tensor, stepped: tuple[str, ...] = ()) -> None:
        """The optimizer step of context ``ctx_id`` after the step's backward, as the policy allows
        (non-finite loss, fp16 overflow); with replicas, on gradients averaged over the copies. ``stepped``: the
        owners that took it in the backward, the loss allowed before it (:attr:`steps_in_backward`)."""
        if self.optimizer is None:
            return
        if not stepped:
            loss = self.sync.before_step(self, ctx_id, loss)
            if loss is None or not self.allows_update(loss):
                return
            tied.sum_shared(self, ctx_id)  # see [Note: a parameter shared by stages]
            if not self._unscale_and_clip(ctx_id):
                return
        self.optimizer.step(ctx_id, stepped)
        self.nonfinite.updated = True
        self._schedule_lr()

    def settle_reduce(self, wait: bool) -> None:
        """After a failed step of a copy: its stages take part in the step's all_reduce all the same."""
        if self.optimizer is not None:
            self.sync.settle(self, wait)

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.gradients.scaled(loss)

    def _unscale_and_clip(self, ctx_id: int) -> bool:
        """Apply :class:`~rpcmp.core.policy.GradientPolicy` to the context's gradients on every owner;
        False: skip this step (an fp16 overflow)."""
        if not self.gradients.needs_norm:
            return True
        skip = tied.norm_skips(self.specs, self.owners)  # a shared parameter counts once
        sq = call_each(self.param_owners, grads.grad_sq_norm, lambda o: (self.pid, ctx_id, skip.get(o, ())))
        coef = self.gradients.coefficient(math.sqrt(sum(sq)))
        if coef is None:
            return False
        if coef != 1.0:
            call_each(self.param_owners, grads.scale_grads, (self.pid, ctx_id, coef))
        return True

    # -- policy state the trainer reads and checkpoints ------------------------------------
    @property
    def loss_scale(self) -> float | None:
        return self.gradients.scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.gradients.scale = value

    @property
    def overflow_steps(self) -> int:
        return self.gradients.overflow_steps

    @property
    def last_grad_norm(self) -> float | None:
        return self.gradients.last_norm

    @property
    def scheduler(self):
        return self.fields.scheduler

    def _schedule_lr(self) -> None:
        self.fields.step()

    def scheduler_state(self) -> dict:
        return self.fields.state()

    def load_scheduler_state(self, state: dict) -> None:
        self.fields.load_state(state)

    def _write_fields(self, changed: dict[int, dict[str, Any]]) -> None:
        wait_all([rpc.rpc_async(r.owner(), stage.set_fields, args=(r, changed)) for r in self._remote_optimizers])

    def set_hparams(self, fields: dict) -> None:
        """Set optimizer fields (``lr``, ``momentum``, ``betas``, ...) on every stage's optimizer: one dict for
        every parameter group, or one per group index (``{1: {"lr": 0.0}}``)."""
        self.fields.set(fields)

    @property
    def lr(self) -> float | None:
        """The learning rate the stages' optimizers use next."""
        return self.fields.lr

    def hparams(self) -> list[dict[int, dict[str, Any]]]:
        """The fields each owner's optimizer will use at its next step, by parameter group (for checks and logs)."""
        return wait_all([rpc.rpc_async(r.owner(), stage.get_fields, args=(r,)) for r in self._remote_optimizers])

    def learning_rates(self) -> list[float]:
        """The learning rate each owner's optimizer will use next (in the first parameter group it holds)."""
        return [f[min(f)]["lr"] for f in self.hparams()]

    @property
    def skipped_steps(self) -> int:
        """Steps whose update ``Job(nonfinite="skip")`` skipped."""
        return self.nonfinite.skipped

    def next_seqs(self, count: int) -> list[int]:
        seqs = list(range(self._seq, self._seq + count))
        self._seq += count
        return seqs

    @torch.no_grad()
    def predict(self, x: Any) -> Any:
        """Forward without autograd on any stage (call :meth:`eval` first for inference); whole, where the model's
        samples meet (see [Note: samples that meet in the model] in rpcmp/plan/writes.py)."""
        return self.forward(x, grad=False, chunks=1 if self.predicts_whole else min(self.microbatches, batch_size(x)))

    # -- mode, tracing, lifetime (the state across owners: rpcmp.master.state) ----------
    def train(self, mode: bool = True) -> "Pipeline":
        self._each(stage.set_training, mode)
        return self

    def eval(self) -> "Pipeline":
        return self.train(False)

    def explain(self, exc: BaseException) -> BaseException:
        """``exc`` as a :class:`~rpcmp.errors.WorkerLostError` naming the owner that stopped
        answering, if one did (see :func:`rpcmp.core.health.explain`)."""
        return health.explain(exc, set(self.owners), self.status)

    @property
    def rows(self) -> list[tuple[int, StageSpec, Place]]:
        """(replica, stage, place) of every stage, for the run's summary (one replica here)."""
        return [(0, s, p) for s, p in zip(self.specs, self.places)]

    def held(self) -> dict[str, list[StageSpec]]:
        """The stages each process owns, in order."""
        held: dict[str, list[StageSpec]] = {}
        for spec, owner in zip(self.specs, self.owners):
            held.setdefault(owner, []).append(spec)
        return held

    @property
    def next_seq(self) -> int:
        """The sequence number the next micro-batch will take (the timeline maps steps to them)."""
        return self._seq

    def start_trace(self) -> None:
        self._each(stage.set_trace, True)

    def stop_trace(self) -> dict[int, list]:
        """Stop tracing; return each stage's (kind, seq, start, end) slices."""
        return dict(enumerate(self._each(stage.set_trace, False)))

    def stats(self) -> list[dict[str, float]]:
        return self._each(stage.stats)

    def move_stage(self, index: int, target: str, replica: int = 0) -> float:
        """Move stage ``index`` to ``target`` (``"worker4/cpu"``) between steps (rpcmp.master.move; ``replica``: 0, the one copy); seconds."""
        return move.move_stage(self, index, target, replica=replica)

    def recut(self, cut, before_commit=None) -> float:
        """Re-cut a ``Split`` pipeline into a balance (``[3, 3, 2]``), a ``SplitAt`` one at other points, between two
        steps (rpcmp.master.recut, which says what ``before_commit`` is for); seconds."""
        return recut.recut(self, cut, before_commit=before_commit)

    def close(self) -> None:
        """Drop the stages on their owners (the processes stay up)."""
        owners = set(self.owners)
        wait_all([rpc.rpc_async(o, stage.release, args=(self.pid,)) for o in owners])
        self.optimizer = None
        self.param_rrefs, self.stages = [], []
        self._threads.shutdown(wait=False)

    def _each(self, fn, *args) -> list:
        return wait_all([rpc.rpc_async(p.process, fn, args=(self.pid, i) + args)
                         for i, p in enumerate(self.places)])

    def resync(self) -> None:
        try:
            self._each(stage.resync, self._seq)
        except Exception:  # the original error is the one worth reporting
            pass
