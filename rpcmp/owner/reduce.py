"""One stage's gradients of one training step on its owner: summed over the step's micro-batches
as each backward leaves the stage (:class:`StepMerge`) and, with ``Job(replicas=R)``, averaged with
the stage's copies, the average started while the backward is still running on earlier stages
(:class:`StepReduce`).

[Note: a pipeline's merges where its gradients are made]
A step of M micro-batches runs each in its own distributed-autograd context (see [Note: one
context per micro-batch] in rpcmp/master/pipeline.py) and adds micro-batch i's gradients into
the first one's, in micro-batch order. The master used to ask every owner for each of those
M - 1 merges, by RPC, once micro-batch i's whole backward had returned: by then the owner's
gradients of i (a stage's size: 16 MiB for the bench MLP's) had left its cache, and each merge
was a message each way and a pass over them on an RPC thread while the next backward ran.
Now the owner learns the step's micro-batches when it begins (:func:`rpcmp.owner.grads.begin_merge`)
and merges each one on the autograd engine's thread as soon as its backward has left the stage
(the callback below), on gradients just made; the master says only that the last one is done,
which returns any merge's error, and keeps saying it of every micro-batch to an owner whose
stage may not learn it itself (below). The order and the sums are the same: bit-equal runs.
The master releases micro-batch i's context when its backward has returned there and i - 1's
merge is done; a stage whose callback ran before an earlier micro-batch's keeps that context's
gradients (:attr:`StepMerge.held`) until its turn. Single pipelines and replicas now merge alike.
Its effect on step time is small on one machine (figures: benchmarks/PERFORMANCE.md). Adding each
large parameter's gradient the moment the engine has made it (a hook on its accumulator, as
``.grad`` accumulates) was tried and was slower: the add then delays the gradient's send upstream.

[Note: the average overlaps the backward]
A stage's gradients of a step are final when the step's last micro-batch has left the
stage in the backward: from then on the stage can average them with its copies while the
stages before it still compute. The owner learns that moment itself: the stage's forward
hooks its output, and when the output's gradient arrives, the hook queues a callback on
the autograd engine (``queue_callback``), which runs when this process's part of that
context's backward is over, with every parameter's gradient already in the context. Each
such callback adds the micro-batch's gradients into the first micro-batch's context, in
micro-batch order (the master's order for plain pipelines, so the sums add up alike), and
the last one starts the ``all_reduce`` (``async_op``: the engine thread goes on at once).
The master still says, after each micro-batch's whole backward, that it is done
(:meth:`StepReduce.left` with its context ids): a stage whose callback does not run is
merged then, only later. That is a stage whose output's gradient reaches a graph task the
engine has already finished on that process: one on the master other than the last (the
master's own backward started the context there), or the upstream one of two stages on one
process. The callback never runs early: the engine runs a graph task's callbacks when
nothing of it is in flight, and the hooked node is counted from before the hook fires. A stage that
receives gradients in several messages (a traced stage that posts skip values) is not
hooked at all, since its first message need not be its last; it too is merged when the
master says so.

One flat buffer per stage holds the gradients and, at its end, a 1 for every parameter
that has one; after the ``all_reduce`` those counts say which parameters got a gradient
in every copy (averaged), in none (left alone), or in some only, which every copy then
refuses alike instead of leaving a peer inside a collective. Every stage of every copy
takes part in exactly one ``all_reduce`` per step, also when the step fails
(:meth:`StepReduce.settle` joins with zeros), so the next step's collectives pair up.

[Note: one copy's statistics]
Each copy's BatchNorm moves its running statistics on its own share of the batch, so the
copies' statistics drift apart while their parameters stay equal; a copy rebuilt from another
after a loss (see :mod:`rpcmp.master.livecopy`) then held the other's statistics, not its
own, and the model was not an uninterrupted run's. The same flat buffer carries them: copy 0
puts in its running statistics, the others zeros, and every copy takes the sum, copy 0's, as
DDP broadcasts rank 0's buffers (``broadcast_buffers=True``). Copy 0's statistics are exactly
what they were before (the model a run saves is unchanged), and the copies are identical after
every step, statistics included. Any other buffer the model's forward writes (a running mean of
its own, found when the stages are planned: rpcmp.plan.writes) travels the same way.
"""
from __future__ import annotations

import threading
import time
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd

from ..errors import StageError
from ..core.microbatch import tensors

__all__ = ["StepMerge", "StepReduce", "param_grads", "drop_beside"]


# [Note: a parameter the first micro-batch did not reach]
# The optimizer reads a step's gradients from the first micro-batch's context, into which the others'
# are added. A parameter that micro-batch 0 did not reach and a later one did (a mixture of experts
# whose router gave an expert no token of micro-batch 0, a branch only some inputs take) has no entry
# there, and a context takes no new entry from Python. Its sum is kept beside the context instead
# (``_BESIDE``, by the first context's id, in micro-batch order as every merge): everything that reads
# the step's gradients on the owner reads them through :func:`param_grads` (the clipping norm, the fp16
# unscale, a shared parameter's sum, the replicas' average) and so does the optimizer step
# (:func:`rpcmp.owner.stepping.local_step`), which lets them go. A parameter no micro-batch reached has no
# gradient, and the optimizer leaves it alone, as the unsplit model's does.
_BESIDE: dict[int, dict[torch.Tensor, torch.Tensor]] = {}


def param_grads(params, ctx_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """Context ``ctx_id``'s gradients of ``params`` (a set or dict of parameters; not of inputs that needed
    one while tracing), and those kept beside it; the tensors themselves, so adding into them changes what the
    optimizer reads."""
    got = {p: g for p, g in dist_autograd.get_gradients(ctx_id).items() if p in params}
    got.update((p, g) for p, g in _BESIDE.get(ctx_id, {}).items() if p in params)
    return got


def drop_beside(ctx_id: int, params=None) -> None:
    """Let go of the gradients kept beside context ``ctx_id`` (of ``params`` only, where given)."""
    beside = _BESIDE.get(ctx_id)
    for p in params if beside is not None and params is not None else ():
        beside.pop(p, None)
    if params is None or not beside:
        _BESIDE.pop(ctx_id, None)


class StepMerge:
    """One stage's gradients of one step on its owner, summed over the step's micro-batches into the
    first one's context as each backward leaves the stage, in micro-batch order (see [Note: the
    average overlaps the backward] and [Note: a pipeline's merges where its gradients are made])."""

    def __init__(self, params: dict[str, torch.Tensor], where: str, first_seq: int, count: int, hook: bool,
                 step: Callable[[int], None] | None = None):
        self.names, self.params = list(params), list(params.values())
        # this process's optimizer step on a context's gradients, taken once the last micro-batch's backward has
        # left the stage and been merged (see [Note: a step steps where its gradients are made] in
        # rpcmp/owner/stepping.py); None: the master asks for it after the backward
        self.step, self.stepped = step, False
        self.worded = False  # the master's word merged a micro-batch whose backward had not left (see _all_merged)
        self._mine = set(self.params)
        self._base: dict | None = None  # the first context's gradients, read once
        self.where = where
        self.first, self.count, self.hook = first_seq, count, hook
        self.contexts: dict[int, int] = {}  # micro-batch -> its distributed-autograd context
        self.held: dict[int, dict] = {}  # micro-batch -> its gradients, taken when its backward left, merged in turn
        self.done: set[int] = set()  # micro-batches whose backward has left this stage
        self.empty: set[int] = set()  # micro-batches whose output took no gradient: none of theirs to merge
        self.next = 0  # the next micro-batch to merge into the first's context
        self.error: Exception | None = None
        self.closed = False
        self._lock = threading.Lock()

    # -- the stage's forward ------------------------------------------------------------------
    def watch(self, seq: int, output) -> None:
        """Micro-batch ``seq``'s forward (with grad) on this stage: note its context, and hook its
        output so that the end of this process's part of its backward is known."""
        i = seq - self.first
        if not 0 <= i < self.count:
            return
        needing = [t for t in tensors(output) if t.requires_grad]
        if not needing:
            self.empty.add(i)  # sent on without a gradient (rpcmp.owner.reach): its backward never comes here
        if not self.hook:
            return
        self.contexts[i] = dist_autograd._current_context()._context_id()
        for t in needing:
            t.register_hook(partial(self._arrived, i))

    def _arrived(self, i: int, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(partial(self.left, i, None, True))

    # -- micro-batches done, from the backward or from the master ---------------------------
    def left(self, upto: int, contexts: list[int] | None = None, by_backward: bool = False) -> None:
        """Micro-batch ``upto`` (and, when the master says so with their ``contexts``, every one
        before it) has left this stage: merge what can be merged; all merged: :meth:`_all_merged`."""
        with self._lock:
            if self.closed:
                return
            if contexts is None:
                self.done.add(upto)
                if upto > self.next and self.error is None:  # its context may be released before its turn
                    self.held[upto] = self._grads(upto)
            else:
                self.contexts.update((i, c) for i, c in enumerate(contexts) if i not in self.contexts)
                self.worded = self.worded or any(i not in self.done for i in range(upto + 1))
                self.done.update(range(upto + 1))
            while self.next < self.count and self.next in self.done:
                if self.next and self.error is None:
                    self._merge(self.next)
                self.held.pop(self.next, None)
                self.next += 1
            if self.next == self.count:
                self._all_merged(by_backward)

    def _all_merged(self, by_backward: bool) -> None:
        self.closed = True
        # Only when every micro-batch's backward left the stage: one the master's word merged may have had none (its
        # output took no gradient, or Job.nonfinite left its backward out), and the master decides that step.
        step, self.step = self.step, None  # nor kept after: it holds the local optimizer
        if by_backward and not self.worded and step is not None and self.error is None:
            step(self.contexts[0])  # an error raises on the engine's thread: the backward fails with it
            self.stepped = True

    def _grads(self, i: int) -> dict[torch.Tensor, torch.Tensor]:
        if i in self.held:
            return self.held[i]
        if i and i in self.empty:
            return {}
        if i:
            try:
                return param_grads(self._mine, self.contexts[i])
            except RuntimeError as exc:
                if "Could not find autograd context" not in str(exc):
                    raise
                raise StageError(f"{self.where}: micro-batch {i}'s output needed a gradient but its backward never "
                                 f"reached this stage, and its context is gone: its gradients here cannot be merged. "
                                 f"Job(microbatches=1) runs such a model without merges") from None
        if self._base is None:  # merges add into these tensors: no parameter joins them later
            self._base = {} if 0 in self.empty else param_grads(self._mine, self.contexts[0])
        return self._base

    def _merge(self, i: int) -> None:
        try:
            base, more = self._grads(0), self._grads(i)
            for param, grad in more.items():
                if param in base:
                    base[param].add_(grad)
                else:  # see [Note: a parameter the first micro-batch did not reach]
                    base[param] = _BESIDE.setdefault(self.contexts[0], {})[param] = grad
        except Exception as exc:  # noqa: BLE001 - reported by the master's last word on the step
            self.error = exc


class StepReduce(StepMerge):
    """One stage's gradients of one step on its owner, merged and then averaged with the stage's
    copies (see [Note: the average overlaps the backward])."""

    def __init__(self, params: dict[str, torch.Tensor], where: str, group, copies: int,
                 first_seq: int, count: int, hook: bool, stats: list[torch.Tensor] = ()):
        super().__init__(params, where, first_seq, count, hook)
        self.stats = list(stats)  # running statistics: every copy takes copy 0's (see [Note: one copy's statistics])
        self.group, self.copies = group, copies
        self.flat = self.work = None
        self.copy0 = True  # this copy is copy 0 of the stage (known when the all_reduce starts)
        self.early = False  # the all_reduce was started by the backward, not by the master
        self.times = [0.0, 0.0, 0.0]  # when the all_reduce started, when the master asked for it, when it ended

    def _all_merged(self, by_backward: bool) -> None:
        if self.work is None:
            self._start(zeros=self.error is not None)
            self.early = by_backward

    def _start(self, zeros: bool) -> None:
        grads = {} if zeros else self._grads(0)
        parts = [grads[p].reshape(-1) if p in grads else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                 for p in self.params]
        dtype = parts[0].dtype if parts else torch.float32
        self.copy0 = (self.group.rank() if self.group is not None else dist.get_rank()) == 0
        first = not zeros and self.copy0
        stats = [b.detach().reshape(-1).to(dtype) if first else torch.zeros(b.numel(), dtype=dtype, device=b.device)
                 for b in self.stats]
        had = torch.tensor([p in grads for p in self.params], dtype=dtype,
                           device=parts[0].device if parts else None)
        self.flat = torch.cat([*parts, *stats, had])
        self.times[0] = time.perf_counter()
        self.work = dist.all_reduce(self.flat, group=self.group, async_op=True)

    # -- the end of the step ---------------------------------------------------------------------
    def average(self, base_ctx: int) -> None:
        """Wait for the average and write it into the first context's gradients (the master's
        call once every copy's backward is done)."""
        self.left(self.count - 1, [base_ctx])
        with self._lock:
            self.closed = True
        self.times[1] = time.perf_counter()
        self.work.wait()
        self.times[2] = time.perf_counter()
        if self.error is not None:
            raise self.error
        flat, n = self.flat, len(self.params)
        counts = flat[flat.numel() - n:]
        some = [name for name, c in zip(self.names, counts.tolist()) if 0 < c < self.copies]
        if some:
            raise StageError(f"{self.where}: parameters {some[:3]} got a gradient this step in some copies of the "
                             f"stage but not in all, so the copies cannot average them; replicas need every "
                             f"parameter used alike in every copy")
        grads, offset = self._grads(0), 0
        for p in self.params:
            if p in grads:
                grads[p].copy_(flat[offset:offset + p.numel()].view_as(p)).div_(self.copies)
            offset += p.numel()
        with torch.no_grad():
            for b in self.stats:  # copy 0's, summed with the others' zeros (copy 0 keeps its own, not rounded)
                if not self.copy0:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()

    @property
    def seconds(self) -> tuple[float, float]:
        """(the all_reduce's time from its start to its end, the part of it the master waited for)."""
        start, asked, end = self.times
        return (end - start, max(0.0, end - max(start, asked))) if end else (0.0, 0.0)

    def settle(self, wait: bool) -> None:
        """A failed step: take part in the step's all_reduce if this stage has not (with zeros),
        and end the step here; ``wait`` for the collective to finish."""
        with self._lock:
            if self.work is None:
                self._start(zeros=True)
            self.closed = True
        if wait:
            try:
                self.work.wait()
            except RuntimeError:  # a copy's owner is gone (gloo: connection reset): the step failed already
                pass
