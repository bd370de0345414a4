"""The owner side of a stage: build it, run micro-batches in order, forward the result
(the master's side of the wire is :mod:`rpcmp.master.inbox`).

[Note: why activations skip the master]
The master sends micro-batch m to stage 0 only. Each stage runs it and calls the next
stage's owner itself (``rpc_async`` from inside :func:`forward`); the last stage
hands its output to the master (:func:`rpcmp.master.inbox.deliver`), which computes the loss. All of
this happens inside the master's distributed-autograd context, which RPC carries
along, so ``dist_autograd.backward`` sends each gradient straight back along the
same hops: stage to stage, never via the master. ``forward`` is an
``async_execution`` function: it returns the downstream future, so the RPC thread is
free at once, errors travel back to the master, and stage k works on micro-batch
m + 1 while stage k + 1 works on m (GPipe fill and drain). The master does not wait for
those answers to come back down the chain: a micro-batch is done when its output
arrives (:func:`rpcmp.master.inbox.send`), which saves a one-way trip per stage
(figures: benchmarks/PERFORMANCE.md, design measurements).

Micro-batches are numbered by the master (``seq``); a stage runs them in that order (:class:`InOrder`).

[Note: one compute thread per stage]
The RPC handler thread owns the distributed-autograd context (it is thread-local), so
it receives the input and sends the output; the module itself runs on the stage's one
compute thread. Autograd numbers graph nodes with a per-thread counter and the
backward engine runs the highest numbers first; with one thread per stage, micro-batch
m + 1's nodes all outnumber m's, so backward finishes one micro-batch at a time and
sends its gradient upstream at once. Run from whichever RPC thread was free, the
micro-batches' nodes interleave, the engine works on all of them together, and the
upstream stage sits idle until the last one is done (about twice the backward time,
figures: benchmarks/PERFORMANCE.md, design measurements). A micro-batch with nothing of
its step to interleave with (the step's only one, ``alone``, or a forward without gradient)
runs on the RPC thread that received it, on a CPU stage: the two hand-offs to the compute
thread and back cost about 0.15 ms a hop (benchmarks/PERFORMANCE.md, per hop). A GPU stage
keeps its compute thread (the streams it runs on stay as they are).

Activation checkpointing (``Job(recompute=True)``): see [Note: recompute] in
:mod:`rpcmp.owner.recompute`.
"""
from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as rpc

from .admission import InOrder
from .reach import detach_sent, reach
from ..errors import StageError, StepCancelled
from ..core.failure import Failure
from ..core.hparams import apply_fields, read_fields
from ..core.microbatch import check_tensors, map_tensors, tensors, to_device
from ..core.wire import from_wire, to_wire
from ..plan.graphs import described
from ..plan.partition import StageSpec, build_empty, build_stage, has_batch_state
from ..plan.writes import stamps, unknown_writes
from .recompute import Recomputed, make_recomputable
from ..plan.placement import MASTER, Place, check_device
from .reduce import StepMerge, StepReduce
from . import stepping
from ..core.served import current

# The RPC endpoints the master calls (rpcmp.master.pipeline, rpcmp.master.executor, rpcmp.master.inbox); each finds
# the stage it acts on in this process's rpcmp.core.served.Served.
__all__ = ["StageHost", "build", "forward", "post", "skip", "resync", "count_reduce",
           "set_fields", "get_fields", "set_training", "set_trace", "stats", "release", "named_params"]


@dataclass
class StageHost:
    pid: int
    spec: StageSpec
    place: Place
    module: torch.nn.Module
    device: torch.device
    next_process: str | None  # owner of the next stage; None: this is the last stage
    # Job(device_maps=True): the processes this stage's device has a TensorPipe map to, set when the RPC world
    # started. A stage moved or rebuilt since (a move, a re-cut, a spare) may send on to a process outside them:
    # that hop goes through host memory, as TensorPipe refuses a CUDA tensor to a process with no map.
    keep_on_device: frozenset[str]
    timeout: float
    autocast: torch.dtype | None = None  # Job.precision bf16 / fp16: the stage runs under autocast
    wire: str = "fp32"  # Job.wire: the format activations and their gradients cross between stages in (core.wire)
    recompute: bool = False  # see [Note: recompute]
    lock: threading.RLock = field(default_factory=threading.RLock)  # forward vs recomputation
    owners: list = field(default_factory=list)  # process of every stage: where posts go
    mail_in: tuple = ()  # values this stage reads from stages before the previous one (traced stages)
    posts: bool = False  # whether it sends values straight to later stages (see [Note: skip values go ...])
    gate: InOrder = field(default=None)  # micro-batches in the master's order
    deliver: Any = None  # the master's endpoint for the last stage's output (rpcmp.master.inbox.deliver)
    reduce: StepMerge | None = None  # this step's gradients, M > 1 (see [Note: the average overlaps ...] in .reduce)
    reduced: list = field(default_factory=lambda: [0, 0.0, 0.0])  # averages the backward started, seconds, waited
    compute_s: float = 0.0
    runs: int = 0
    bytes_in: int = 0  # activations received (their gradients go back the same size)
    bytes_out: int = 0  # activations sent on
    born: float = field(default_factory=time.perf_counter)
    cpu_born: float = field(default_factory=lambda: _cpu_seconds())
    compute: ThreadPoolExecutor = field(default=None)
    events: list | None = None  # (kind, seq, start, end) wall-clock slices while tracing, else None
    _bwd_start: dict = field(default_factory=dict)  # seq -> when its backward reached this stage
    moved_optimizer: tuple | None = None  # a stage just moved here: its optimizer state and fields (rpcmp.owner.move)
    unchecked: int = 2  # training forwards of several micro-batches before the one that is checked (_checked_forward)
    cut: bool | None = None  # whether a received input is not in the output's backward (see [Note: an input the ...])
    cut_chain: bool = False  # nothing of what the stage before sent is in it: that stage sends detached (.reach)
    send_detached: bool = False  # the next stage said that it takes no gradient of this stage's output (.reach)
    detached_values: tuple[int, ...] = ()  # nor of these of its tensors (by position): sent detached (rpcmp.plan.unreached)
    detached_posts: tuple = ()  # (reader, name) of the values it posts that their reader takes no gradient of (same)

    def __post_init__(self):
        threads = torch.get_num_threads()
        self.compute = ThreadPoolExecutor(1, thread_name_prefix=f"rpcmp-stage{self.spec.index}",
                                          initializer=torch.set_num_threads, initargs=(threads,))
        self.gate = InOrder(f"stage {self.spec.index} ({self.spec.name}) on {self.place.process}", self.timeout,
                            self.mail_in)

    def run(self, seq: int, x: Any, grad: bool, alone: bool = False) -> Any:
        mail = self.gate.enter(seq)
        x = (x, mail) if self.mail_in else x
        try:
            # See [Note: one compute thread per stage].
            if (alone or not grad) and self.device.type == "cpu":
                return self._compute(x, grad, seq)
            return self.compute.submit(self._compute, x, grad, seq).result()
        finally:
            self.gate.leave(seq)

    def _precision(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _compute(self, x: Any, grad: bool, seq: int) -> Any:
        start, wall = time.perf_counter(), time.time()
        self.bytes_in += sum(t.nbytes for t in tensors(x))
        x = to_device(x, self.device, non_blocking=True)
        if self.events is not None and grad:
            x = self._trace_backward_end(x, seq)
        with torch.set_grad_enabled(grad), self._precision():
            x = from_wire(x, self.wire) if self.spec.index else x  # stage 0's input is the master's batch
            with self.lock:
                if self.recompute and grad:
                    y = Recomputed.run(self.module, self.lock, self.device, x)
                elif grad and self.unchecked and self.reduce is not None:
                    y = self._checked_forward(x)
                else:
                    y = self.module(x)
        check_tensors(y, f"the output of stage {self.spec.index} ({self.spec.name})")
        if grad:
            y = reach(self, x, y)
        posts = None
        if self.posts:
            y, posts = y
            if self.device.type != "cpu":  # posts go as CPU tensors: device maps cover neighbours only
                posts = to_device(posts, torch.device("cpu"))
        y, posts = detach_sent(self, y, posts)  # see [Note: an input the backward never reaches]
        if self.device.type != "cpu" and self.next_process not in self.keep_on_device:
            y = to_device(y, torch.device("cpu"))
        if self.wire != "fp32":  # to later stages (the master's loss takes float32)
            with torch.set_grad_enabled(grad):
                y, posts = (to_wire(y, self.wire) if self.next_process else y), to_wire(posts, self.wire)
        self.compute_s += time.perf_counter() - start
        self.runs += 1
        self.bytes_out += sum(t.nbytes for t in tensors(y))
        if self.events is not None:
            self.events.append(("F", seq, wall, time.time()))
            if grad:
                out = next((t for t in tensors(y) if t.requires_grad), None)
                if out is not None:
                    out.register_hook(lambda g: self._backward_started(seq))
        if posts is not None:
            self.bytes_out += sum(t.nbytes for t in tensors(posts))
            return y, posts
        return y

    def _checked_forward(self, x: Any) -> Any:
        """The stage's second training forward of a micro-batch (a cache built on the first call is no write): say
        so when it writes a buffer the plan did not find (rpcmp.plan.writes finds them on the meta device, where a
        forward that reads values cannot run): the run writes it once per micro-batch, where the unsplit model does
        once a batch."""
        self.unchecked -= 1
        if self.unchecked:
            return self.module(x)
        before = stamps(self.module)
        y = self.module(x)
        new = unknown_writes(self.module, before, {n[len(self.spec.prefix):] for n in self.spec.writes})
        if new and current().job.batchnorm == "batch":
            print(f"rpcmp: warning: stage {self.spec.index} ({self.spec.name}) on {self.place.process}: its training "
                  f"forward writes {', '.join(new[:3])}{' and more' if len(new) > 3 else ''} on each micro-batch, "
                  f"where the unsplit model writes once a batch, so this run trains another model (the plan did not "
                  f"find it: the forward could not run on the meta device, or had no batch to run on). "
                  f"Job(microbatches=1) trains as the unsplit model; Job(batchnorm='micro') says per micro-batch is "
                  f"meant", file=sys.stderr, flush=True)
        return y

    # -- tracing (``--trace FILE``): a slice per micro-batch forward and backward ------------
    def _backward_started(self, seq: int) -> None:
        self._bwd_start[seq] = time.time()

    def _trace_backward_end(self, x: Any, seq: int) -> Any:
        """Hook the input's gradient: it is computed last in this stage's backward. A first
        stage's input needs no gradient, so while tracing it gets one (a little extra work)."""
        def done(grad):
            self.events.append(("B", seq, self._bwd_start.pop(seq, time.time()), time.time()))
        floats = [t for t in tensors(x) if t.is_floating_point()]
        hooked = next((t for t in floats if t.requires_grad), None)
        if hooked is None and floats:
            first = floats[0]
            hooked = first.detach().requires_grad_()
            x = map_tensors(x, lambda t: hooked if t is first else t)
        if hooked is not None:
            hooked.register_hook(done)
        return x


def build(pid: int, spec: StageSpec, place: Place, next_process: str | None, timeout: float, options: dict):
    """Build stage ``spec`` here; return RRefs of its parameters for the DistributedOptimizer,
    whether it has BatchNorm layers and an RRef of the module (the master's ``RemoteModule``
    handle), or a :class:`Failure` (see [Note: failures travel as values]). ``options``: the
    master's Job settings that shape a stage (the job file imported here may have been
    overridden on the master)."""
    try:
        device = check_device(place)
        # Builds of two stages on one process run on two RPC threads: each seeds the global RNG and
        # draws its initial weights from it, so they must not interleave.
        served = current()
        # A build while training (move, re-cut, spare) seeds to build; the generators other stages here draw from stay.
        keep = torch.random.fork_rng([device.index or 0] if device.type == "cuda" else []) if options.get("empty") else contextlib.nullcontext()
        with served.build_lock, keep:
            module = build_empty(served.job, spec, device) if options.get("empty") else None
            if module is None:
                module = build_stage(served.job, spec, device=device).to(device)
    except Exception as exc:  # noqa: BLE001 - reported on the master
        return Failure.of(f"building stage {spec.index} ({spec.name}) on {place} failed: {type(exc).__name__}: {exc}", exc)
    keep = frozenset(peer for peer, m in served.device_maps.items() if str(device) in m and peer != MASTER
                     ) if options["device_maps"] else frozenset()
    bn = has_batch_state(module, spec)
    if options["recompute"]:
        make_recomputable(module)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(options["precision"])
    route = module.forward if spec.kind == "traced" else None  # see [Note: skip values go straight to their consumer]
    served.hosts[(pid, spec.index)] = StageHost(pid, spec, place, module, device, next_process, keep, timeout,
                                                autocast, wire=options.get("wire", "fp32"),
                                                recompute=bool(options["recompute"]), owners=list(options["owners"]),
                                                deliver=options["deliver"],
                                                mail_in=tuple(route.mail_in) if route else (),
                                                posts=bool(route.posts) if route else False,
                                                send_detached=spec.detached, detached_values=spec.detached_values,
                                                detached_posts=spec.detached_posts)
    return [rpc.RRef(p) for p in module.parameters() if p.requires_grad], bn, rpc.RRef(module)


def _done(value: Any) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


@rpc.functions.async_execution
def forward(pid: int, index: int, seq: int, x: Any, grad: bool, alone: bool = False, steps: tuple | None = None,
            sent: float | None = None) -> torch.futures.Future:
    """Run micro-batch ``seq`` through stage ``index`` and hand it on. ``alone``: the only micro-batch of its step
    (see [Note: one compute thread per stage]). ``steps``: the owners that will step in its backward so far (see
    rpcmp/owner/stepping.py); None: none is asked to. ``sent``: while tracing, when the stage before started
    sending it (its transfer is a slice of the timeline: rpcmp.train.timeline)."""
    served = current()
    host = served.host(pid, index)
    if sent is not None and host.events is not None:
        host.events.append(("T", seq, sent, time.time()))
    try:
        y = host.run(seq, x, grad, alone)
    except Exception as exc:  # noqa: BLE001 - see [Note: failures travel as values]
        if type(exc) in (StageError, StepCancelled):  # from the gate (a timeout, a failed step): the message says it all
            return _done(Failure(str(exc), kind=type(exc).__name__))
        return _done(Failure.of(f"stage {index} ({host.spec.name}) on {host.place} failed on micro-batch {seq}: "
                                f"{described(host.spec, exc)}", exc))
    if grad and host.reduce is not None:
        host.reduce.watch(seq, y)
    if grad and steps is not None and stepping.arm(pid, y):
        steps = (*steps, served.me)
    posted = []
    if host.posts:  # see [Note: skip values go straight to their consumer] in rpcmp/plan/traced.py
        y, posts = y
        posted = [rpc.rpc_async(host.owners[j], post, args=(pid, j, seq, values)) for j, values in posts.items()]
    if host.next_process is not None:
        traced = (time.time(),) if host.events is not None else ()
        nxt = rpc.rpc_async(served.worker(host.next_process), forward,
                            args=(pid, index + 1, seq, y, grad, alone, steps, *traced))
    elif host.place.process == MASTER:  # the last stage runs on the master: no hop to deliver
        host.deliver(pid, seq, y, steps)
        nxt = _done(None)
    else:
        nxt = rpc.rpc_async(served.worker(MASTER), host.deliver, args=(pid, seq, y, steps))
    if not posted:
        return nxt
    return torch.futures.collect_all([nxt, *posted]).then(lambda done: [f.wait() for f in done.wait()][0])


def post(pid: int, index: int, seq: int, values: dict) -> None:
    """Values of micro-batch ``seq`` that an earlier stage sends straight to stage ``index``."""
    host = current().hosts.get((pid, index))
    if host is not None:
        host.gate.receive(seq, values)


def count_reduce(host: StageHost) -> None:
    """Let the last step's gradients go, adding its average (``Job(replicas=R)``) to the stage's figures."""
    step = host.reduce
    if isinstance(step, StepReduce) and step.closed:
        took, waited = step.seconds
        host.reduced = [host.reduced[0] + step.early, host.reduced[1] + took, host.reduced[2] + waited]
    if step is not None and step.closed:
        host.reduce = None


def set_fields(optim_rref, fields: dict) -> None:
    apply_fields(optim_rref.local_value().optim, fields)


def get_fields(optim_rref) -> dict:
    return read_fields(optim_rref.local_value().optim)


def set_training(pid: int, index: int, mode: bool) -> None:
    current().host(pid, index).module.train(mode)


def resync(pid: int, index: int, next_seq: int) -> None:
    current().host(pid, index).gate.reset(next_seq)


def skip(pid: int, index: int, seq: int) -> None:
    host = current().hosts.get((pid, index))
    if host is not None:
        host.gate.skip(seq)


def running_stats(module: torch.nn.Module, spec: StageSpec | None = None) -> list[torch.Tensor]:
    """The running statistics of the norm layers in ``module`` (BatchNorm, InstanceNorm with
    ``track_running_stats``) and the buffers the model's forward writes (``spec.writes``, by the unsplit
    model's names): what each copy of a replicated stage moves on its own share."""
    stats = [b for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)
             for b in (m.running_mean, m.running_var) if b is not None]
    own = dict(module.named_buffers()) if spec is not None else {}
    written = [own[n[len(spec.prefix):]] for n in (spec.writes if spec is not None else ())
               if n.startswith(spec.prefix) and n[len(spec.prefix):] in own]
    return stats + [b for b in written if all(b is not s for s in stats)]


def cancel(pid: int, seqs: list[int]) -> None:
    """The step of micro-batches ``seqs`` failed: this process's stages of pipeline ``pid`` do not start them."""
    for host in current().hosts_of(pid):
        host.gate.cancel(seqs)


def named_params(pid: int) -> dict[torch.Tensor, str]:
    return {p: host.spec.prefix + n for host in current().hosts_of(pid) for n, p in host.module.named_parameters()}


def set_trace(pid: int, index: int, on: bool) -> list:
    """Start (on) or stop tracing this stage; stopping returns the recorded slices."""
    host = current().host(pid, index)
    events, host.events = host.events or [], [] if on else None
    return events


def stats(pid: int, index: int) -> dict[str, float]:
    host = current().host(pid, index)
    return {"compute_s": host.compute_s, "runs": host.runs, "pid": os.getpid(),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "wall_s": time.perf_counter() - host.born, "process_cpu_s": _cpu_seconds() - host.cpu_born,
            "mib_in": host.bytes_in / 2**20, "mib_out": host.bytes_out / 2**20,
            **_reduce_stats(host)}


def _reduce_stats(host: StageHost) -> dict:
    """With replicas: steps whose average the backward started, the averages' seconds and the part waited for."""
    count_reduce(host)
    early, took, waited = host.reduced
    return {"reduced_early": early, "reduce_s": took, "reduce_wait_s": waited}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def release(pid: int) -> None:
    served = current()
    for key in [k for k in served.hosts if k[0] == pid]:
        served.hosts.pop(key).compute.shutdown(wait=False)
    for kept in (served.snapshots, served.buddy_snapshots, served.buddy_pins):  # rpcmp/owner/snapshot.py
        for key in [k for k in kept if k[0] == pid]:
            del kept[key]
