"""A pipeline's stages built at its start, on their owners, each from the job's seed.

[Note: an owner lost while the stages build]
Building is the longest part of a run's start (tracing a model, drawing every initial value: minutes for
a large model or on a busy node), and an owner can be lost in it as in any step: killed, out of memory,
or stopped and fenced by the watchdog (:mod:`rpcmp.core.health`). With a spare free (``Job(spares=K)``),
the lost owner's stages are built on the spare instead: a build draws a stage's initial values from the
job's seed, whichever process runs it, so the spare holds what the lost owner would have held and the
run trains the model an undisturbed run trains. The owners whose builds went through keep them and
learn the new route, as after a recovery (:func:`rpcmp.master.move.route`); of a replicated pipeline, the
copies of those stages then average in a group of their own (:meth:`rpcmp.master.replicas.Replicated.regroup`).
There is no snapshot to roll back to yet and nothing to roll back: no step has run. Without a spare, with
more owners lost than spares free, or when an owner's build itself failed (a :class:`~rpcmp.errors.StageError`),
the run ends as before, naming what was lost. A process lost before it joined the RPC world ends the run at
its launch: the world cannot form without it.
"""
from __future__ import annotations

import sys
import threading
import time

import torch.distributed.rpc as rpc

from ..core import health
from ..core.futures import raise_failures, wait_all
from ..core.served import current
from ..errors import StageError
from ..owner import stage
from ..plan.placement import Place, process_name
from ..plan.topology import stage_world
from .move import route, warm
from .recovery import cannot_replace

__all__ = ["build_stages"]

_TAKING = threading.Lock()  # the copies of a replicated pipeline build at once, each on a thread: one spare each


def _build(pipe, k: int):
    """The call that builds stage ``k`` of ``pipe`` on the process its place names."""
    job, places = pipe.job, pipe.places
    nxt = places[k + 1].process if k + 1 < len(places) else None
    # A build may trace the model and draw every initial value of its stage: minutes for a large one or on a
    # busy node, so not the per-call timeout (a GPT-2 traced by five processes beside a test suite took 60 s).
    # A lost owner still fails it at once (its connection closes).
    return rpc.rpc_async(places[k].process, stage.build, args=(pipe.pid, pipe.specs[k], places[k], nxt, job.call_timeout,
                                                               {**pipe.build_options, "owners": list(pipe.owners)}),
                         timeout=max(job.call_timeout, 900.0))


def build_stages(pipe, world_size: int, spares: list[str] | None) -> list:
    """What each stage's build returned, in stage order; an owner lost meanwhile replaced by one of ``spares`` (the
    caller's list: what is taken leaves it; see [Note: an owner lost while the stages build])."""
    futs = [_build(pipe, k) for k in range(len(pipe.specs))]
    # a spare traces while the owners build: taking over a stage early in the run costs a build, not a trace too
    warm([process_name(r) for r in range(stage_world(pipe.job, world_size), world_size)], pipe.specs[0])
    said: list[tuple[str, float]] = []  # what each replacement did (and when it began), said once every stage is built
    while True:
        # A worker lost while building is named; a stage that failed to build says so itself.
        with health.explained(lambda exc: exc if isinstance(exc, StageError) else pipe.explain(exc)):
            try:
                built = raise_failures(wait_all(futs))
            except StageError:
                raise
            except Exception:  # noqa: BLE001 - a transport error: an owner lost, replaced when a spare is free
                start = time.perf_counter()
                with _TAKING:
                    line = _replace_lost(pipe, futs, spares if spares is not None else [])
                if line is None:
                    raise
                said.append((line, start))
                continue
        if said:
            route(pipe, pipe.owners)  # the owners built before learn where the rebuilt stages are
            for line, start in said:
                print(f"{line}; {time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
        return built


def _replace_lost(pipe, futs: list, spares: list[str]) -> str | None:
    """Build the stages of the owners that no longer answer on free spares (``futs`` changes in place: a new build
    for each of those stages), and say so; None, and nothing changed, where that cannot be done."""
    lost = health.unresponsive(sorted(set(pipe.owners) | set(spares)), timeout=3.0)
    free = [s for s in spares if s not in lost]
    gone = sorted({o for o in lost if o in pipe.owners})
    if not gone or len(gone) > len(free):
        if gone and spares:  # the spares the job asked for cannot take over: say why, then the loss is the error
            why = (cannot_replace(gone, free, [s for s in spares if s in lost]) if len(gone) == 1
                   else f"{len(gone)} owners are lost, spares free: {len(free)}")
            print(f"rpcmp: {', '.join(gone)} was lost while the stages were built and is not replaced: {why}",
                  file=sys.stderr, flush=True)
        return None
    spares[:] = free
    took = {g: spares.pop(0) for g in gone}
    current().lost.update(gone)
    again = [k for k, o in enumerate(pipe.owners) if o in took]
    for k in again:
        pipe.places[k] = Place(took[pipe.owners[k]], pipe.places[k].device)  # the same device on the spare
    pipe.owners = [p.process for p in pipe.places]
    pipe.label_stages()
    for k in again:
        futs[k] = _build(pipe, k)  # a spare lost in turn fails this build: the next one is tried
    names = ", ".join(f"{k} ({pipe.specs[k].name})" for k in again)
    return (f"rpcmp: {', '.join(gone)} was lost while the stages were built; stage {names} built on "
            f"{', '.join(took[g] for g in gone)} (a spare) instead, from the job's seed")
