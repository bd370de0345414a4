"""One optimizer step of any :class:`rpcmp.plan.schedule.Plan`, on the master.

Every micro-batch is driven from its own thread in its own distributed-autograd context
(:class:`_MicroBatches`): it enters when the plan says; with a loss per micro-batch its loss
and backward start as soon as its output arrives, with the loss on the gathered batch (gpipe)
once every output has arrived; its gradients are added into the first context's in the plan's
merge order. See [Note: one context per micro-batch] in :mod:`rpcmp.master.pipeline` for why.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Protocol

import torch
import torch.distributed.autograd as dist_autograd

from . import inbox
from ..core.microbatch import batch_size, gather, has_tensors, map_tensors, scatter, tensors
from ..plan.schedule import Loss, Plan, make_plan
from ..plan.lengths import check_sizes
from ..errors import JobError, StepCancelled, WorkerLostError
from ..job import loss_of

__all__ = ["run_step", "check_mean_loss", "Steppable"]


class Steppable(Protocol):
    """What one step asks of a pipeline (:class:`rpcmp.master.pipeline.Pipeline`); nothing else is reached for."""

    pid: int
    job: Any
    specs: list
    places: list
    owners: list[str]
    optimizer: Any  # None: no optimizer step (evaluation-only pipelines)
    sync: Any  # rpcmp.master.sync.LocalMerge or ReplicaReduce
    loss_checked: bool
    schedule: str

    def micro_threads(self, count: int) -> Any: ...  # a thread pool for per-micro-batch drivers
    def next_seqs(self, count: int) -> list[int]: ...
    def backward(self, ctx: int, loss: torch.Tensor) -> None: ...
    def to_fp32(self, out: Any) -> Any: ...
    def allows_update(self, loss: torch.Tensor) -> bool: ...
    def apply_step(self, ctx_id: int, loss: torch.Tensor, stepped: tuple[str, ...] = ()) -> None: ...
    @property
    def steps_in_backward(self) -> bool: ...
    def resync(self) -> None: ...


def run_step(pipe: Steppable, schedule: str, x: Any, y: Any, chunks: int) -> torch.Tensor:
    """One optimizer step of ``pipe`` on batch ``(x, y)`` in ``chunks`` micro-batches; the loss."""
    check_sizes(pipe.specs[0].sizes, x)  # see [Note: any sequence length]
    plan = make_plan(schedule, chunks, len(pipe.specs))  # scatter refuses a batch of fewer than ``chunks`` samples
    return _MicroBatches(pipe, plan, x, y).run()


def check_mean_loss(pipe, outs: list, ys: list, weights: list[float], y: Any, total: torch.Tensor) -> None:
    """Once per pipeline: warn if ``Job.loss`` is not a mean over samples (a batch-level Dice, a sum, a mean
    over tokens that padding leaves out: ``ignore_index``), so that the micro-batches' losses, each weighted
    by its share of the batch, do not add up to the whole batch's: the per-micro-batch schedules then train
    on another loss than the unsplit model. The identity is tried on the outputs with noise of ``k`` times
    their size added to micro-batch ``k``'s as well: at initialisation every token's loss is about the same, and a wrong
    weighting hides below any tolerance (a GPT-2 with padded batches: 8e-6 of its loss); the identity of a
    mean holds for any outputs. Costs 2 (M + 1) loss evaluations, on the first step with a finite loss.
    ``weights``: each micro-batch's share of the batch."""
    if _holds_a_loss(outs):
        pipe.loss_checked = True
        warnings.warn(
            f"the model's output holds a 0-dimensional tensor (a loss the model computes itself, as a Hugging Face "
            f"model given labels does), so rpcmp cannot check that Job.loss is a mean over samples. "
            f"schedule={pipe.schedule!r} weighs each micro-batch's loss by its share of the samples: the unsplit "
            f"model's loss when it is a mean over samples, another one when it is not (a mean over tokens that "
            f"ignores padding). To be exact for any loss, leave the labels out of the model's input, pass them as y, "
            f"compute the loss in Job.loss from the outputs (out.logits) and use Job(schedule='gpipe')",
            RuntimeWarning, stacklevel=5)
        return
    spread = [map_tensors(o, lambda t, k=k: _spread(t, k)) for k, o in enumerate(outs)]
    found = None
    for tried in (outs, spread):
        try:
            with torch.no_grad():
                whole = pipe.job.loss(gather(tried), y).detach().float()
                parts = total if tried is outs else sum(pipe.job.loss(o, t).detach().float() * w
                                                        for o, t, w in zip(tried, ys, weights))
        except Exception:  # noqa: BLE001 - outputs that do not concatenate (0-dim ones), a loss for inputs in a range
            continue
        if not (torch.isfinite(whole).all() and torch.isfinite(parts).all()):
            if tried is outs:
                return  # a later step checks
            continue
        if whole.shape == parts.shape and not torch.allclose(parts.float(), whole, rtol=1e-4, atol=1e-6):
            found = (whole, parts)
            break
    pipe.loss_checked = True
    if found is not None:
        warnings.warn(
            f"Job.loss is not a mean over samples: on the whole batch it is {found[0].sum().item():.6g}, but the "
            f"{len(outs)} micro-batches' losses, each weighted by its share of the batch, add up to "
            f"{found[1].sum().item():.6g}{'' if found[1] is total else ' (on outputs made to differ by micro-batch)'}. "
            f"schedule={pipe.schedule!r} computes the loss per micro-batch, so it trains on another loss than the "
            f"unsplit model (a mean over tokens that ignores padding weighs each micro-batch by its own token count); "
            f"Job(schedule='gpipe') computes it once on the whole batch", RuntimeWarning, stacklevel=5)


def _holds_a_loss(outs: list) -> bool:
    """Whether the micro-batches' outputs hold a 0-dimensional tensor: a loss the model computes itself (a Hugging
    Face model given labels), with no batch dimension to gather or weigh."""
    return any(t.dim() == 0 for o in outs for t in tensors(o))


def _spread(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` plus noise of ``k`` times its size, from a generator of its own (the process's stay as they were)."""
    if not k or not t.is_floating_point():
        return t
    noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(k)).to(t.device, t.dtype)
    return t + k * (1 + t.abs().mean()) * noise


class _MicroBatches:
    """A step of a plan with one distributed-autograd context per micro-batch."""

    def __init__(self, pipe, plan: Plan, x: Any, y: Any):
        m = plan.microbatches
        self.pipe, self.plan, self.xs, self.y, self.n = pipe, plan, scatter(x, m), y, batch_size(x)
        self.ys = scatter(y, m) if has_tensors(y) else [y] * m
        self.seqs = pipe.next_seqs(m)
        self.ctx_ids, self.losses, self.errors = [0] * m, [None] * m, []
        self.lock = threading.Lock()
        # made in _threaded (a step of one micro-batch runs on the calling thread: _alone)
        self.backward_done = self.stepped = self.merged = None
        self.gathered = plan.loss is Loss.GATHERED
        # The owners take the optimizer step in the backward, where the pipeline lets them (see [Note: a step steps
        # where its gradients are made] in rpcmp/owner/stepping.py): the master asks them in the forward message
        # (M = 1) or as the step begins (sync.begin). in_backward: the owners that take it there (M = 1: their names
        # come with the output; M > 1: with the last merge); the master asks the others after the backward.
        self.asks = not self.gathered and pipe.steps_in_backward
        self.in_backward: tuple[str, ...] = ()
        self.checks_first = False  # an owner may step in the backward: each loss is allowed before its backward
        self.skips_update = False  # Job.nonfinite skips this step's update, decided before a backward
        self.unrun: set[int] = set()  # micro-batches whose backward that decision left out
        # kept once for check_mean_loss (a loss per micro-batch), or for the loss on the gathered batch
        self.outs = [None] * m if self.gathered or (m > 1 and not pipe.loss_checked) else None
        self.roots: list = [None] * m  # gathered: what micro-batch i's backward starts from (see _gathered_loss)
        self.all_out = threading.Barrier(m, action=self._gathered_loss) if self.gathered else None
        order = [0] + [i for i, _ in plan.merges]
        self.before = {i: order[k - 1] for k, i in enumerate(order) if k}  # merged after this one's merge
        self.into = dict(plan.merges)

    def run(self) -> torch.Tensor:
        pipe = self.pipe
        if pipe.optimizer is not None:
            pipe.sync.begin(pipe, self.seqs[0], len(self.xs), steps=self.asks and len(self.xs) > 1)
            self.checks_first = len(self.xs) > 1 and bool(pipe.sync.arming)
        if len(self.xs) == 1:
            self._alone()
        else:
            self._threaded()
        if self.errors:
            inbox.abandon(pipe.pid, self.seqs)
            pipe.resync()
            # the first micro-batch's failure, whichever thread saw one first; not one the failure cancelled; a lost
            # owner before what its loss made others fail with (a neighbour's backward: "EPIPE: broken pipe")
            real = [e for e in self.errors if not isinstance(e[1], StepCancelled)] or self.errors
            raise min([e for e in real if isinstance(e[1], WorkerLostError)] or real, key=lambda e: e[0])[1]
        total = self._total()
        if self.outs is not None and not self.gathered:
            check_mean_loss(pipe, self.outs, self.ys, [batch_size(x) / self.n for x in self.xs], self.y, total)
        return total

    def _alone(self) -> None:
        """One micro-batch: on this thread, with no thread, barrier or event to hand it over (each costs
        tens of microseconds, per step)."""
        with dist_autograd.context() as ctx:
            self.ctx_ids[0] = ctx
            try:
                self._forward_backward(0, ctx)
            except BaseException as exc:  # noqa: BLE001 - re-raised by run(), as a micro-batch thread's is
                self.errors.append((0, exc))
                return
            if not self.skips_update:
                self.pipe.apply_step(ctx, self._total(), self.in_backward)

    def _threaded(self) -> None:
        """Each micro-batch on a thread of its own, entering when the plan says; this thread takes the
        optimizer step once every backward is done, while the first context still holds the sum."""
        pipe, m = self.pipe, len(self.xs)
        self.backward_done, self.stepped = threading.Barrier(m + 1), threading.Event()
        self.merged = [threading.Event() for _ in range(m)]
        futs = [pipe.micro_threads(m).submit(self._micro, i) for i in range(m)]
        try:
            try:
                self.backward_done.wait()
            except threading.BrokenBarrierError:
                return  # a micro-batch failed: run() raises its error
            # Not under the except above: a copy whose meeting with the others broke (Job(replicas=R): another
            # copy failed) did not take the step, and must not return as if it had.
            if not self.skips_update:
                pipe.apply_step(self.ctx_ids[0], self._total(), self.in_backward)
        finally:
            self.stepped.set()
            for f in futs:
                f.result()

    def _total(self) -> torch.Tensor:
        one = self.gathered or len(self.losses) == 1  # a sum of one is that one, exactly
        return self.losses[0] if one else torch.stack(self.losses).sum()

    def _micro(self, i: int) -> None:
        try:
            if self.plan.admit_after[i] is not None:  # 1f1b: at most S micro-batches in flight
                self.merged[self.plan.admit_after[i]].wait()
                if self.errors:
                    return  # the step failed meanwhile: this one is not started
            with dist_autograd.context() as ctx:
                self.ctx_ids[i] = ctx
                self._forward_backward(i, ctx)
                self._merge(i)
                if i == 0:
                    self.backward_done.wait()
                    self.stepped.wait()  # the first context holds the sum until the optimizer has read it
            if i > 0:
                self.backward_done.wait()
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised by run()
            self._failed(i, exc)

    def _failed(self, i: int, exc: BaseException) -> None:
        """Micro-batch ``i`` failed: so does the step. The first failure lets every waiting thread go and
        has the owners drop the micro-batches that have not started (a lost owner's step winds down sooner)."""
        with self.lock:
            first = not self.errors
            self.errors.append((i, exc))
        if first:
            inbox.cancel(self.pipe.pid, [s for k, s in enumerate(self.seqs) if k != i], self.pipe.owners)
        self.backward_done.abort()
        if self.all_out is not None:
            self.all_out.abort()
        for event in self.merged:
            event.set()

    def _forward_backward(self, i: int, ctx: int) -> None:
        pipe = self.pipe
        early = self.asks and len(self.xs) == 1  # M > 1: the owners were asked as the step began
        out = inbox.send(pipe.pid, self.seqs[i], pipe.places[0].process, self.xs[i], True, pipe.owners,
                         len(self.xs) == 1, early).wait()
        if early:
            out, self.in_backward = out
            self.checks_first = bool(self.in_backward)
        out = pipe.to_fp32(out)
        if self.gathered:
            self.outs[i] = out
            self.all_out.wait()  # the last output to arrive computes the loss: _gathered_loss
            if self.roots[i] is not None:  # None: the loss does not depend on this micro-batch's output
                pipe.backward(ctx, self.roots[i])
            return
        loss, share = loss_of(pipe.job, out, self.ys[i]), batch_size(self.xs[i]) / self.n
        if share != 1.0:  # a step of one micro-batch: the loss as it is (x 1.0 is exact, but a node more each way)
            loss = loss * share
        if self.outs is not None:
            self.outs[i] = map_tensors(out, torch.Tensor.detach)
        self.losses[i] = loss.detach()
        if self.checks_first and not self._allows(loss):  # decided before the owners step in the backward
            self.unrun.add(i)  # no backward, no update
            return
        pipe.backward(ctx, loss)

    def _allows(self, loss: torch.Tensor) -> bool:
        """Job.nonfinite on a micro-batch's loss, before its backward: once per step (a first non-finite loss
        skips the update, or raises)."""
        with self.lock:
            if self.skips_update:
                return False
            self.skips_update = not self.pipe.allows_update(loss)
            return not self.skips_update

    def _gathered_loss(self) -> None:
        """gpipe: the loss of the gathered batch, exact for any loss (a batch-level Dice, a sum), and
        what each micro-batch's backward starts from: ``sum(out_i * g_i)`` with ``g_i`` the loss's
        gradient for output i, whose gradient for ``out_i`` is ``g_i`` exactly (1 * g_i). So each
        micro-batch's backward runs in its own context and the merges add the gradients up in the
        plan's order: the same numbers every run (in one shared context the M gradients were summed
        in the order the backward passes happened to reach each owner)."""
        leaves = [map_tensors(o, lambda t: t.detach().requires_grad_(t.is_floating_point())) for o in self.outs]
        if _holds_a_loss(leaves):
            raise JobError(
                "schedule='gpipe' computes the loss once on the micro-batches' outputs gathered, but the model's "
                "output holds a 0-dimensional tensor (a loss the model computes itself, as a Hugging Face model given "
                "labels does): it has no batch dimension to gather. Leave the labels out of the model's input, pass "
                "them as y and compute the loss in Job.loss from the outputs (out.logits), or use "
                "schedule='overlap' (the loss per micro-batch, weighted by its share of the samples)")
        loss = loss_of(self.pipe.job, gather(leaves), self.y)
        pairs = [[(o, d) for o, d in zip(tensors(out), tensors(leaf)) if d.requires_grad]
                 for out, leaf in zip(self.outs, leaves)]
        grads = iter(torch.autograd.grad(loss, [d for row in pairs for _, d in row], allow_unused=True))
        for i, row in enumerate(pairs):
            terms = [(o * g).sum() for o, g in ((o, next(grads)) for o, _ in row) if g is not None]
            self.roots[i] = torch.stack(terms).sum() if terms else None
        self.losses[0], self.outs = loss.detach(), None

    def _merge(self, i: int) -> None:
        """Add this context's gradients into the plan's target context, in the plan's order (so the
        sums always add up alike), and let the context go."""
        pipe = self.pipe
        if i in self.into:
            self.merged[self.before[i]].wait()
            if pipe.optimizer is not None and not self.errors:
                # roots None: its output does not reach the loss; unrun: Job.nonfinite left its backward out
                ran = (not self.gathered or self.roots[i] is not None) and i not in self.unrun
                stepped = pipe.sync.merge(pipe, self.ctx_ids, i, self.into[i], ran)
                if stepped:
                    self.in_backward = tuple(sorted({*self.in_backward, *stepped}))
        self.merged[i].set()
