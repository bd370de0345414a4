"""A lost owner replaced in place: ``Job(spares=K, snapshot_every=N)``.

[Note: recovery from a lost owner]
Every N steps, after the optimizer step, each owner snapshots its stages and ships each copy
to a buddy (see [Note: snapshots and their buddies] in :mod:`rpcmp.owner.snapshot`); the master
keeps only what is its own at that step: the data position, the scheduler's state and the fp16
loss scale. When a step fails because an owner died (or hung and was fenced by the watchdog,
see :mod:`rpcmp.core.health`), the master asks every process whether it answers; with exactly
one lost owner, a spare and a snapshot, it

1. rebuilds the lost process's stages on the first spare (the same ``build`` as at start) and
   routes every owner to it;
2. rolls every stage back to the step of the snapshot the lost stage's buddy holds: the
   rebuilt stages from the buddy's copy (one the lost owner shipped and then died before
   saying so counts), the others from their own (parameters, buffers,
   optimizer state and fields, generators), and makes a new DistributedOptimizer over the
   pipeline as it now is (as :mod:`rpcmp.master.move` does);
3. hands the trainer the data position of that step, so the steps since are trained again
   on the same batches: the run ends with the model an uninterrupted run ends with.

The first snapshot is taken at the start, before the first step. An owner lost before its copy of it
reached the buddy (in the first step, or stopped while it copied) leaves no copy of its stages; but at
the start of a run not resumed they hold what a build from the job's seed makes, so the spare builds
them from the seed (as when an owner is lost while the stages build: rpcmp/master/building.py), the
others roll back to their own copies of the start, and the spare then snapshots its stages for its buddy.
At the start of a resumed run they hold the checkpoint it resumed from, the run's last
(``RunStatus.checkpoint``): they are rebuilt from it, as without snapshots; so too when an owner is lost
while the stages read it (:func:`read_resumed`).

The copies the lost process kept for its neighbours are sent again, to their new buddy, once the
first step after the recovery has ended, not beside it: for the demo Unet that is the encoder
with its Adam state, 250 MB, which made the replayed step a sixth slower on two cores. A second
owner lost within that first step ends the run if it is one of those neighbours (no other
process holds its copy yet).

A spare lost while it takes over (its build or its copy fails, and it no longer answers) is
one more lost process: the next spare does 1. to 3. again, the survivors rolling back to
the same state again; a spare already routed to is then the lost owner.

Everything happens in the processes that are up: no process restarts, and nothing is read from
disk but a checkpoint (without snapshots, or as a resumed run starts). Without a spare, with a
second lost owner, or with neither a snapshot nor a checkpoint of the run that holds the lost
stages, the step's error stands and the run ends as it always did (exit 1, naming the
checkpoint to resume from).
A lost master ends the run: the spares wait for a master, they cannot become one.
"""
from __future__ import annotations

import sys
import time
from typing import Any

import torch.distributed.rpc as rpc

from ..core.futures import wait_all
from ..core.health import loss_cause, reason, unresponsive
from ..core.checkpoint import CheckpointError, load_checkpoint
from ..core.served import current
from ..owner import snapshot
from ..owner import state as stage_state
from ..plan.placement import MASTER, Place
from .move import build_on, install, new_optimizer, route

__all__ = ["Snapshots", "RolledBack", "read_resumed", "cannot_replace", "rebuild_on_spare", "install_rebuilt"]

SEED = "seed"  # the lost stages are rebuilt from the job's seed (see Snapshots._whole_snapshot)


class RolledBack(Exception):
    """A lost owner was replaced in place and every stage rolled back: the trainer goes on from
    ``position`` = (step, epoch, next batch) and says ``line``. With ``stood`` (a loss), nothing rolled
    back: the failed step had been taken by a live copy (see [Note: a step some copies took] in
    :mod:`rpcmp.master.livecopy`), and that is its loss."""

    def __init__(self, position: tuple[int, int, int], line: str, stood: float | None = None):
        super().__init__(line)
        self.position, self.line, self.stood = position, line, stood


class Snapshots:
    """The master's side of ``Job(snapshot_every=N)`` for one pipeline, and its recovery."""

    def __init__(self, pipe, every: int, spares: list[str]):
        self.pipe, self.every, self.spares = pipe, every, spares  # the engine's list: a drain takes from it too
        self.taking: list = []  # the owners copying their stages: waited for before the next step
        self.kept: dict[int, dict[str, Any]] = {}  # step -> the master's own state at that step
        self.reships: list[tuple] = []  # (owner, stage, step, new buddy): a lost buddy's copies, sent again
        self.last: tuple | None = None  # (pipeline id, step, owners) of the last snapshot
        self.floor: int | None = None  # what the owners may drop below once the copies being taken are made
        self.forgetting: list = []  # the owners dropping their copies below a step every buddy holds
        self.notes: list[str] = []  # a snapshot an owner that still answers could not take: for the log (settle)
        self._said: set[str] = set()

    def buddies(self, owners: list[str]) -> dict[int, str] | None:
        """Stage -> the process that keeps its snapshot: the owner of the next stage that is another
        process, round the ring; None when every stage is on one process (nobody else to keep it)."""
        out = {}
        for k, owner in enumerate(owners):
            ring = [owners[(k + d) % len(owners)] for d in range(1, len(owners))]
            out[k] = next((o for o in ring if o != owner), None)
        return None if None in out.values() else out

    def after_step(self, step: int, position: tuple[int, int]) -> None:
        """Snapshot after ``step`` if it is due (and at step 0, so that a loss before the first is covered);
        otherwise, after the first step since a recovery, send the lost process's copies again."""
        if self.every and step % self.every == 0:
            self.snap(step, position)
        reships, self.reships = self.reships, []  # the demo Unet's encoder with Adam: 250 MB, which would slow
        try:  # the first step after a recovery by a sixth
            wait_all([rpc.rpc_async(owner, snapshot.reship, args=(self.pipe.pid, k, held, buddy))
                      for owner, k, held, buddy in reships])
        except Exception:  # noqa: BLE001 - an owner is gone: the next step fails and recovers from what is held
            pass

    def snap(self, step: int, position: tuple[int, int], landed: bool = False) -> None:
        """Snapshot every stage after ``step``, unless this very pipeline is snapshotted at this step already.
        ``landed``: return once every buddy holds its copy, raising where an owner was lost (a re-cut's: see
        [Note: a re-cut and its snapshot] in rpcmp/master/recut.py); else the copies travel beside the next step."""
        pipe = self.pipe
        if not self.every or self.last == (pipe.pid, step, tuple(pipe.owners)):
            return
        self.settle()
        self.reships = []  # this snapshot goes to the new buddies
        buddies = self.buddies(pipe.owners)
        if buddies is None or pipe.optimizer is None:
            return
        optims = {r.owner().name: r for r in pipe.optimizer.remote_optimizers}
        # once every owner has made its copy of this step, its shipment of the one before has landed: below that
        # one, nothing is held by a buddy that every owner does not hold too ([Note: snapshots and their buddies])
        before = self.last[1] if self.last and self.last[0] == pipe.pid and self.last[1] < step else None
        try:
            taking = [(o, step, rpc.rpc_async(o, snapshot.take, args=(pipe.pid, step, {o: optims[o]} if o in optims
                                                                     else {}, buddies, landed)))
                      for o in sorted(set(pipe.owners))]
        except Exception:  # noqa: BLE001 - an owner is gone: the next step fails and recovers from the snapshot before
            if landed:
                raise
            return
        if landed:
            failed = [why for why in wait_all([fut for _, _, fut in taking]) if why]
            if failed:
                raise RuntimeError(f"the snapshot of step {step} is not whole: {failed[0]}")
            self._forget(step, [o for o, _, _ in taking])  # every buddy holds this one
        else:
            self.taking, self.floor = taking, before
        self.last = (pipe.pid, step, tuple(pipe.owners))
        self.kept[step] = {"position": (step, *position), "loss_scale": pipe.loss_scale,
                           "scheduler": pipe.scheduler_state() if pipe.scheduler is not None else None}
        for old in sorted(self.kept)[:-snapshot.MOST]:  # as the owners keep theirs where no forget comes
            del self.kept[old]

    def settle(self) -> None:
        """Wait until the owners have copied their stages (before any optimizer step may change them). A copy
        that failed is not a snapshot lost: its owner may have shipped it and died before answering; a recovery
        asks the buddies and the survivors what they hold (:meth:`_whole_snapshot`). A copy that failed on an
        owner that still answers is said, once per reason: a loss is then recovered from an earlier snapshot."""
        taking, self.taking = self.taking, []
        whole = bool(taking)
        for owner, step, fut in taking:
            try:
                fut.wait()
            except Exception as exc:  # noqa: BLE001 - a lost owner shows at the next step, which recovers from what is held
                whole, why = False, reason(exc)
                if why not in self._said and not unresponsive([owner], timeout=3.0):
                    self._said.add(why)
                    self.notes.append(f"warning: {owner} could not take the snapshot of step {step} ({why}); a lost "
                                      f"owner is recovered from an earlier snapshot, or ends the run without one")
        if whole and self.floor is not None:  # else the owners keep what they have (at most snapshot.MOST each)
            self._forget(self.floor, [owner for owner, _, _ in taking])
        self.floor = None

    def _forget(self, below: int, owners: list[str]) -> None:
        """The owners drop their own copies of the steps before ``below``, and the master its part of them."""
        try:
            wait_all(self.forgetting)  # one at a time, so that a later one never arrives first
        except Exception:  # noqa: BLE001 - an owner is gone: what it kept is the recovery's concern, not this
            pass
        self.forgetting = [rpc.rpc_async(o, snapshot.forget, args=(self.pipe.pid, below)) for o in owners]
        for old in [s for s in self.kept if s < below]:
            del self.kept[old]

    def recover(self, error: BaseException, position: tuple | None = None, in_step: bool = True,
                redo: str = "", first: tuple[float, str] | None = None) -> RolledBack:
        """Replace the owner whose loss failed a step (or a checkpoint save, an evaluation: not ``in_step``), or
        re-raise ``error`` (see [Note: recovery from a lost owner]); the run goes on from the snapshot's position
        either way, which the line says (``redo``, what runs again, is for a live copy's line). A spare lost while
        it takes over is replaced by the next (``first``: when the first try began, and the owner it replaced)."""
        start, pipe = first[0] if first else time.perf_counter(), self.pipe
        lost = unresponsive(sorted(set(pipe.owners) | set(self.spares)), timeout=3.0)
        silent = [s for s in self.spares if s in lost]
        self.spares[:] = [s for s in self.spares if s not in lost]
        owners_lost = sorted({o for o in lost if o in pipe.owners})
        gone = owners_lost[0] if owners_lost else None
        stages = [k for k, o in enumerate(pipe.owners) if o == gone]
        buddies = self.buddies(pipe.owners) if self.every else None
        step, held = (self._whole_snapshot(buddies, gone, stages) if buddies and len(owners_lost) == 1 and self.spares
                      else (None, ""))
        ckpt = self._checkpoint() if step is None and len(owners_lost) == 1 and self.spares else None
        why = self._cannot(owners_lost, step, ckpt, held, silent)
        if why:
            if owners_lost:  # a stage's own error, a NaN loss: not a loss of a process, nothing to say here
                print(f"rpcmp: not recovered in place: {why}; the run ends", file=sys.stderr, flush=True)
            raise error
        spare = self.spares.pop(0)
        current().lost.add(gone)
        self.taking, self.floor = [], None  # copies on the lost process never finish; the others' are done by now
        try:
            if ckpt is None:
                position, source = self._from_snapshot(gone, spare, stages, step, buddies, seeded=held == SEED)
            else:
                position, source = self._from_checkpoint(gone, spare, stages, ckpt)
        except Exception as exc:  # noqa: BLE001 - the spare's own loss is recovered from as the owner's was
            if not spare_lost(spare, gone, pipe.owners, exc):
                raise
            return self.recover(error, position, in_step, redo, first=first or (start, gone))
        names = ", ".join(f"{k} ({pipe.specs[k].name})" for k in stages)
        who = first[1] if first else gone
        return RolledBack(position, f"recovered: {who} was lost ({loss_cause(error, who)}); stage {names} rebuilt on "
                                   f"{spare} from "
                                   f"{source}; every stage rolled back to step {position[0]}; "
                                   f"{time.perf_counter() - start:.2f} s")

    def _whole_snapshot(self, buddies: dict[int, str], gone: str, stages: list[int]) -> tuple[int | None, str]:
        """The step of the snapshot the buddies of the lost ``stages`` hold, if every surviving owner holds its
        own copy of that step too (each keeps what a buddy may still hold) and the master its part; else None, and
        what each held (for the line that says the run cannot go on). Of the start's snapshot (step 0 of a run
        not resumed), a lost stage whose copy never reached its buddy is what a build from the job's seed makes:
        its held text is then ``SEED``."""
        pid = self.pipe.pid
        survivors = sorted(set(self.pipe.owners) - {gone})
        try:
            held = {k: rpc.rpc_sync(buddies[k], snapshot.held, args=(pid, k), timeout=10) for k in stages}
            owned = wait_all([rpc.rpc_async(o, snapshot.own_steps, args=(pid,), timeout=10) for o in survivors])
        except Exception as exc:  # noqa: BLE001 - a process that does not answer holds nothing we can use
            return None, f"asking what the others hold failed: {reason(exc)}"
        steps = set(held.values())
        step = steps.pop() if len(steps) == 1 else None
        if step is not None and step in self.kept and all(step in s for s in owned):
            return step, ""
        if all(s is None for s in held.values()) and 0 in self.kept and all(0 in s for s in owned):  # resumed: not 0
            return 0, SEED
        copies = [f"{buddies[k]} holds " + (f"stage {k}'s copy of step {s}" if s is not None else f"no copy of stage {k}")
                  for k, s in held.items()]
        return None, "; ".join(copies + [f"{o} its own of steps {s}" for o, s in zip(survivors, owned)]
                               + [f"the master its part of steps {sorted(self.kept)}"])

    def _checkpoint(self) -> dict | None:
        """The run's last checkpoint, whole in the master's folder (a folder the nodes share), or None."""
        path = current().status.checkpoint
        try:
            return load_checkpoint(path) if path else None
        except CheckpointError:  # a part only its node has: a folder that is not shared
            return None

    def _from_snapshot(self, gone: str, spare: str, stages: list[int], step: int, buddies: dict,
                       seeded: bool = False) -> tuple[tuple, str]:
        """Source b: the lost stages from their buddies' copies (``seeded``: built from the job's seed, as at the
        start), the others from their own; the same step."""
        pipe = self.pipe
        old_optims = {r.owner().name: r for r in pipe.optimizer.remote_optimizers if r.owner().name != gone}
        rolling = [rpc.rpc_async(o, snapshot.restore, args=(pipe.pid, k, step, False, old_optims.get(o)))
                   for k, o in enumerate(pipe.owners) if k not in stages]  # while the spare builds
        rolling += [rpc.rpc_async(spare, snapshot.fetch, args=(pipe.pid, k, step, buddies[k], pipe.job.call_timeout))
                    for k in stages if not seeded]  # the buddies' copies travel to the spare while it builds
        try:
            built = rebuild_on_spare(pipe, gone, spare, stages, empty=not seeded)
        except Exception:
            wait_all(rolling)  # the survivors' rollbacks end before another spare is tried
            raise
        wait_all(rolling)
        if not seeded:
            wait_all([rpc.rpc_async(spare, snapshot.restore, args=(pipe.pid, k, step, True)) for k in stages])
        install_rebuilt(pipe, built, old_optims, spare)
        self.last = (pipe.pid, step, tuple(pipe.owners))  # the snapshot the next one follows
        kept = self.kept[step]
        if kept["scheduler"] is not None:
            pipe.load_scheduler_state(kept["scheduler"])
        if kept["loss_scale"]:
            pipe.loss_scale = kept["loss_scale"]
        # The stages whose copies the lost process kept send theirs (of the same step) to their new buddy, the
        # spare, so that a next loss is covered as well (the spare's own copies came with its stages): once the
        # first step after this one has ended (see after_step), not beside it.
        after = self.buddies(pipe.owners)
        pending = {k for _, k, _, _ in self.reships} | {k for k in range(len(pipe.owners)) if buddies[k] == gone}
        self.reships = [(pipe.owners[k], k, step, after[k]) for k in sorted(pending) if k not in built]
        if seeded:  # the spare's own copy of the start, which its buddy keeps too, as the lost owner's would be
            optims = {r.owner().name: r for r in pipe.optimizer.remote_optimizers}
            why = rpc.rpc_sync(spare, snapshot.take, args=(pipe.pid, step, {spare: optims[spare]} if spare in optims
                                                           else {}, after, True))
            if why:  # said with the next step's log, as a snapshot an owner could not take (settle)
                self.notes.append(f"warning: {spare} could not snapshot the stages it rebuilt ({why}); a next loss of "
                                  f"it before the next snapshot ends the run")
            return kept["position"], f"the job's seed (its copy of the start had not reached {buddies[stages[0]]})"
        return kept["position"], f"the snapshot of step {step} kept by {', '.join(sorted({buddies[k] for k in stages}))}"

    def _from_checkpoint(self, gone: str, spare: str, stages: list[int], ckpt: dict) -> tuple[tuple, str]:
        """Source c: every stage from the run's last checkpoint (each owner reads its own keys), the spare's
        generators from what the lost process had then; the data position of the checkpoint."""
        pipe = self.pipe
        old_optims = {r.owner().name: r for r in pipe.optimizer.remote_optimizers if r.owner().name != gone}
        built = rebuild_on_spare(pipe, gone, spare, stages, empty=False)  # non-persistent buffers come from the build
        install_rebuilt(pipe, built, old_optims, spare)
        pipe.load_files(ckpt["files"])
        saved = (ckpt.get("rng") or {}).get("processes", {})
        wait_all([rpc.rpc_async(p, stage_state.set_rng_state, args=(saved[gone if p == spare else p],))
                  for p in sorted(set(pipe.owners) | {MASTER}) if (gone if p == spare else p) in saved])
        if ckpt.get("scheduler") and pipe.scheduler is not None:
            pipe.load_scheduler_state(ckpt["scheduler"])
        if ckpt.get("loss_scale") and pipe.loss_scale:
            pipe.loss_scale = ckpt["loss_scale"]
        if self.every:
            self.kept.clear()  # the snapshots are of other steps now
            self.last = None
            self.snap(ckpt["step"], (ckpt["epoch"], ckpt["next_batch"]))
        return (ckpt["step"], ckpt["epoch"], ckpt["next_batch"]), f"the checkpoint of step {ckpt['step']} ({ckpt['path']})"

    def _cannot(self, owners_lost: list[str], step: int | None, ckpt: dict | None, held: str = "",
                silent: list[str] = ()) -> str | None:
        why = cannot_replace(owners_lost, self.spares, silent)
        if why is None and step is None and ckpt is None:
            return ("no snapshot holds the lost stages (--snapshot-every N)" + (f" ({held})" if held else "")
                    + " and no checkpoint of this run is whole in the master's folder (--checkpoint-dir on a folder "
                    "every node shares)")
        return why


def read_resumed(pipe, recovery, ckpt: dict) -> str | None:
    """A resumed run's stages read checkpoint ``ckpt``, each owner its own keys. An owner lost meanwhile is replaced
    by ``recovery`` (:class:`Snapshots`: from ``ckpt``, every stage reading it again; a replicated pipeline's
    :class:`~rpcmp.master.livecopy.LiveCopies`: from a copy that read it), the generators of its process too: the
    line that says so; without one (no spares), the error stands."""
    try:
        pipe.load_files(ckpt["files"])
    except Exception as exc:  # noqa: BLE001 - recovered, or re-raised as it was
        if recovery is None:
            raise
        position = (ckpt["step"], ckpt["epoch"], ckpt["next_batch"])
        return recovery.recover(exc, position, in_step=False, redo="the checkpoint read as the run resumed").line
    return None


def cannot_replace(owners_lost: list[str], spares: list[str], silent: list[str] = ()) -> str | None:
    """Why the lost owners cannot be replaced in place, or None: exactly one is lost and a spare is free.
    ``silent``: the spares that did not answer when the loss was looked at (killed, stopped or hung)."""
    if not owners_lost:
        return "no owner of a stage is lost"
    if len(owners_lost) > 1:
        return f"{len(owners_lost)} owners are lost ({', '.join(owners_lost)}); a spare replaces one"
    if spares:
        return None
    if silent:
        return (f"no spare process is left: the spare {', '.join(silent)} did not answer either (killed, stopped or "
                f"hung; look at its log or node)")
    return "no spare process is left (--spares)"


def spare_lost(spare: str, gone: str, owners, exc: BaseException) -> bool:
    """Whether ``exc``, raised while ``spare`` took over the stages of ``gone``, is the loss of the spare alone (it
    no longer answers, every other of ``owners`` does): the run says so, and the next spare takes over. Each try
    rolls the survivors back to the same state again, and a spare that had been routed to is an owner lost like
    any other. An owner lost meanwhile is named, and the error stands."""
    silent = unresponsive(sorted({spare, *owners} - {gone}), timeout=3.0)
    if silent == [spare]:
        current().lost.add(spare)
        print(f"rpcmp: {spare}, the spare taking over from {gone}, was lost during the recovery ({reason(exc)}); "
              f"the next spare takes over, if one is left", file=sys.stderr, flush=True)
        return True
    if silent:
        print(f"rpcmp: not recovered in place: {', '.join(p for p in silent if p != spare)} lost too, while {spare} "
              f"took over from {gone}; the run ends", file=sys.stderr, flush=True)
    return False


def rebuild_on_spare(pipe, gone: str, spare: str, stages: list[int], empty: bool) -> dict:
    """Build the lost ``stages`` of ``pipe`` on ``spare`` and route every owner to it; what the builds
    returned (for :func:`install_rebuilt`, once the stages hold their values)."""
    owners = [spare if o == gone else o for o in pipe.owners]
    places = {k: Place(spare, pipe.places[k].device) for k in stages}  # the same device on the spare
    built = {k: build_on(pipe, k, places[k], owners, empty=empty) for k in stages}
    for k in stages:
        pipe.places[k], pipe.owners[k] = places[k], spare
    route(pipe, owners)
    pipe.resync()  # every gate waits for the pipeline's next micro-batch
    return built


def install_rebuilt(pipe, built: dict, old_optims: dict, spare: str) -> None:
    """The master's handles of the rebuilt stages, and the optimizer: a new local one on the spare only."""
    for k, b in built.items():
        install(pipe, k, pipe.places[k], b)
    new_optimizer(pipe, old_optims, {spare})
