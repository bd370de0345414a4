"""The owner's side of in-memory snapshots (``Job(spares=K, snapshot_every=N)``): each owner
copies its stages after an optimizer step, keeps the copy, and ships it to a buddy process;
after a loss, every stage rolls back to its own copy and the lost one is rebuilt on a spare
from its buddy's (the master's side: :mod:`rpcmp.master.recovery`).

[Note: snapshots and their buddies]
A snapshot of a stage is what moving it takes (:func:`rpcmp.owner.move.export_stage`:
parameters, every buffer, optimizer state by name and its fields, the process's
generators), copied so that later steps leave it alone. The copy is made on an RPC thread of
the owner while the master is between steps (the master waits for it before the next step,
so no optimizer step can change a tensor half copied); it then travels to the stage's
buddy, the owner of the next stage that is another process (the ring closes at the first),
while training goes on. An owner starts a shipment only when its previous one has arrived,
and drops its own copy of a step only when the master says that every buddy holds that step's
successor or a later one (:func:`forget`): an owner's take of step c waits for its own shipment
of b, so once every owner's take of c has returned, each buddy holds b or c, and a, the step
before b, can go. Each owner knows only its own shipments: dropping a on its own once its b
arrived left it without the step that the buddy of a slower neighbour still held (the
neighbour's b on its way when it was lost), and that loss could not be recovered. So whatever
step the buddy of a lost stage holds, every other stage holds its own copy of the same step.
A buddy keeps the latest copy of each neighbour's stage; the one a recovery chose stays until
the spare has read it, should the lost owner's last shipment land in between (:func:`held`).
Memory: an owner holds its stages three times more while a snapshot is copied (its own copies
of the last two steps and the new one) and twice more otherwise, plus the neighbour's copy it
keeps, on the CPU; the master holds none of it, and no process holds the whole model.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed.rpc as rpc

from ..core.health import reason
from ..core.served import current
from . import stepping
from .move import export_stage, fill_stage

__all__ = ["take", "forget", "reship", "keep", "held", "own_steps", "fetch", "restore"]

# the own copies an owner keeps at most, a bound for when the master cannot say what may go (a snapshot that
# failed on an owner): the last two and the one being made
MOST = 3


def take(pid: int, step: int, optims: dict, buddies: dict[int, str], landed: bool = False) -> str | None:
    """Snapshot every stage of pipeline ``pid`` here after step ``step`` and ship each to its buddy.
    ``optims``: this process's local optimizer (by process name, as the master knows them); ``landed``: return
    once every buddy holds its copy (a re-cut's: [Note: a re-cut and its snapshot] in rpcmp/master/recut.py),
    or why one could not take it (a value: an error raised here would be printed here too)."""
    served = current()
    me = served.me
    previous = served.shipping.pop(pid, None)
    if previous is not None:  # one shipment at a time: see [Note: snapshots and their buddies]
        try:
            previous.wait()
        except Exception:  # noqa: BLE001 - its buddy was lost: the recovery sent this stage's copy to the new one
            pass
    futs = []
    for i, host in enumerate(served.hosts_of(pid)):
        index = host.spec.index
        data = export_stage(pid, index, optims.get(me), rng=i == 0, copy=True)
        own = served.snapshots.setdefault((pid, index), {})
        own[step] = data
        for old in sorted(own)[:-MOST]:  # what the master let go went at its forget
            del own[old]
        futs.append(rpc.rpc_async(buddies[index], keep, args=(pid, index, step, data)))
    if futs and landed:
        for fut, host in zip(futs, served.hosts_of(pid)):
            try:
                fut.wait()
            except Exception as exc:  # noqa: BLE001 - said to the master, which undoes the re-cut
                return f"{buddies[host.spec.index]} did not take its copy ({reason(exc)})"
    elif futs:
        served.shipping[pid] = torch.futures.collect_all(futs)
    return None


def forget(pid: int, below: int) -> None:
    """Drop this process's own snapshots of pipeline ``pid`` older than step ``below``: every buddy holds that
    step or a later one (see [Note: snapshots and their buddies])."""
    for (p, _), own in current().snapshots.items():
        for old in [s for s in own if p == pid and s < below]:
            del own[old]


def reship(pid: int, index: int, step: int, buddy: str) -> None:
    """Send this stage's own snapshot of ``step`` to a new buddy (its old one was lost), in the background."""
    served = current()
    fut = rpc.rpc_async(buddy, keep, args=(pid, index, step, served.snapshots[(pid, index)][step]))
    previous = served.shipping.get(pid)
    served.shipping[pid] = fut if previous is None else torch.futures.collect_all([previous, fut])


def keep(pid: int, index: int, step: int, data: dict[str, Any]) -> None:
    """A buddy keeps the latest snapshot of a neighbour's stage, replacing the one before unless a recovery is
    reading that one (:func:`held`)."""
    served = current()
    copies = served.buddy_snapshots.setdefault((pid, index), {})
    copies.pop(step, None)
    copies[step] = data  # the latest last
    for old in [s for s in copies if s not in (step, served.buddy_pins.get((pid, index)))]:
        del copies[old]


def held(pid: int, index: int) -> int | None:
    """The step of the latest snapshot of stage ``index`` that this buddy holds, or None. A recovery asks, then
    rolls every stage back to that step: the copy stays here until the spare has taken it, should a later one
    land meanwhile (the lost owner's last shipment, on its way when it died)."""
    served = current()
    copies = served.buddy_snapshots.get((pid, index))
    if not copies:
        return None
    step = served.buddy_pins[(pid, index)] = next(reversed(copies))
    return step


def own_steps(pid: int) -> list[int]:
    """The steps of which every stage of pipeline ``pid`` here holds its own snapshot."""
    served = current()
    owns = [set(served.snapshots.get((pid, h.spec.index), ())) for h in served.hosts_of(pid)]
    return sorted(set.intersection(*owns)) if owns else []


def restore(pid: int, index: int, step: int, rebuilt: bool = False, optim_rref=None) -> None:
    """Give stage ``index`` here its values of step ``step`` from the snapshot this process holds: its own (a
    stage that was not lost rolls back) or, for a stage ``rebuilt`` here, the buddy's copy :func:`fetch`
    brought, counters included. ``optim_rref``: this process's local optimizer, which keeps the stage (a
    rollback): its state is written back into it at once."""
    host = current().host(pid, index)
    if not rebuilt:  # a step the failed one armed here is not taken after this (rpcmp/owner/stepping.py)
        stepping.cancel(pid)
    fill_stage(host, current().snapshots[(pid, index)][step], f"restoring stage {index} ({host.spec.name}) to step "
               f"{step}", counters=rebuilt, copy=True, optim_rref=optim_rref, rollback=True)


def fetch(pid: int, index: int, step: int, buddy: str, timeout: float) -> None:
    """On a spare, while it builds stage ``index``: take the buddy's copy of step ``step``, which is this process's
    own from now on (for :func:`restore`, and for the next loss)."""
    current().snapshots[(pid, index)] = {step: rpc.rpc_sync(buddy, _give, args=(pid, index, step), timeout=timeout)}


def _give(pid: int, index: int, step: int) -> dict[str, Any]:
    served = current()
    copies = served.buddy_snapshots.get((pid, index), {})
    if step not in copies:
        held_here = " and ".join(map(str, copies)) or "none"
        raise RuntimeError(f"the snapshot of stage {index} held here is of step {held_here}, not {step}")
    data = copies[step]
    if served.buddy_pins.get((pid, index)) == step:  # read: the latest alone is kept from now on
        del served.buddy_pins[(pid, index)]
        for old in list(copies)[:-1]:
            del copies[old]
    return data
