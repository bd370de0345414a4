"""The owner's state endpoints in one process (rpcmp/owner/move.py, rpcmp/owner/snapshot.py): a
stage's export is everything a new owner needs, a snapshot is a copy later steps leave alone, a
stage rolls back to its own copy or to its buddy's, and a stage of another shape is refused by
name. The stages live on the master of the one-process RPC world (tests/unit/conftest.py)."""
import dataclasses

import pytest
import torch

import rpcmp
from helpers import batches
from rpcmp.core.served import current, serve
from rpcmp.errors import StageError
from rpcmp.master.recovery import Snapshots
from rpcmp.owner import move, snapshot


@pytest.fixture
def pipe(world):
    serve(world)
    job = dataclasses.replace(world, optimizer=(torch.optim.Adam, {"lr": 0.01}))
    pipe = rpcmp.Pipeline(job, world_size=1)
    yield pipe
    pipe.close()


def _step(pipe, n=1):
    for x, y in batches(n):
        pipe.train_step(x, y)


def _optims(pipe):
    return {r.owner().name: r for r in pipe.optimizer.remote_optimizers}


def test_a_snapshot_is_a_copy_that_later_steps_leave_alone_and_its_owner_drops_what_the_master_lets_go(pipe):
    for step in (1, 2, 3, 4):
        _step(pipe)
        snapshot.take(pipe.pid, step, _optims(pipe), {0: "master", 1: "master"})
        current().shipping[pipe.pid].wait()
        if step == 3:
            at_three = pipe.state_dict()
    _step(pipe)
    served = current()
    # kept until the master says every buddy holds a later step; at most snapshot.MOST where it never says so
    assert sorted(served.snapshots[(pipe.pid, 0)]) == [2, 3, 4] and snapshot.held(pipe.pid, 1) == 4
    snapshot.forget(pipe.pid + 1000, 4)  # another pipeline's: nothing of this one goes
    assert snapshot.own_steps(pipe.pid) == [2, 3, 4] and snapshot.own_steps(pipe.pid + 1000) == []
    snapshot.forget(pipe.pid, 3)
    assert snapshot.own_steps(pipe.pid) == [3, 4]
    for index in (0, 1):
        kept = served.snapshots[(pipe.pid, index)][3]
        prefix = kept["prefix"]
        assert kept["params"] and all(torch.equal(v, at_three[prefix + k]) for k, v in kept["params"].items())
        assert any(not torch.equal(v, pipe.state_dict()[prefix + k]) for k, v in kept["params"].items())
    with pytest.raises(RuntimeError, match="of step 4, not 3"):  # a buddy answers only for the step it holds
        snapshot.fetch(pipe.pid, 1, 3, "master", 10)


def test_a_buddy_keeps_the_copy_a_recovery_chose_when_a_later_one_lands_meanwhile(pipe):
    # the lost owner's last shipment lands after the recovery asked what is held and before the spare reads it
    _step(pipe)
    snapshot.take(pipe.pid, 1, _optims(pipe), {0: "master", 1: "master"})
    current().shipping[pipe.pid].wait()
    state = pipe.state_dict()
    assert snapshot.held(pipe.pid, 1) == 1  # the recovery's question: it rolls every stage back to step 1
    _step(pipe)
    snapshot.take(pipe.pid, 2, _optims(pipe), {0: "master", 1: "master"})
    current().shipping[pipe.pid].wait()
    copy = current().buddy_snapshots[(pipe.pid, 1)][1]
    names = [copy["prefix"] + k for k in copy["params"]]
    snapshot.fetch(pipe.pid, 1, 1, "master", 10)  # the spare takes step 1's copy, not the one that came after
    snapshot.restore(pipe.pid, 1, 1, True)
    now = pipe.state_dict()
    assert names and all(torch.equal(now[k], state[k]) for k in names)
    assert list(current().buddy_snapshots[(pipe.pid, 1)]) == [2]  # read: the latest alone stays
    with pytest.raises(RuntimeError, match="of step 2, not 1"):
        snapshot.fetch(pipe.pid, 1, 1, "master", 10)
    snapshot.take(pipe.pid, 3, _optims(pipe), {0: "master", 1: "master"})
    current().shipping[pipe.pid].wait()
    assert list(current().buddy_snapshots[(pipe.pid, 0)]) == [3]  # no recovery reading: one copy a stage


def test_a_stage_rolls_back_to_its_own_copy_or_its_buddys_with_optimizer_state_by_name(pipe):
    _step(pipe)
    state, optim = pipe.state_dict(), pipe.optimizer_state()
    snapshot.take(pipe.pid, 1, _optims(pipe), {0: "master", 1: "master"})
    current().shipping[pipe.pid].wait()
    _step(pipe, 2)
    snapshot.restore(pipe.pid, 0, 1)  # its own copy
    snapshot.fetch(pipe.pid, 1, 1, "master", 10)  # the buddy's, as a stage rebuilt on a spare
    snapshot.restore(pipe.pid, 1, 1, True)
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, state[key]), key
    for index in (0, 1):
        moved, fields = current().host(pipe.pid, index).moved_optimizer
        assert moved and all(torch.equal(moved[n]["exp_avg"], optim[n]["exp_avg"]) for n in moved)
        assert fields  # the optimizer's own fields (lr, betas) travel with it


def test_a_rolled_back_optimizer_takes_the_snapshot_s_state_into_its_own_tensors_and_the_snapshot_stays(pipe):
    _step(pipe)
    optim = pipe.optimizer_state()
    snapshot.take(pipe.pid, 1, _optims(pipe), {0: "master", 1: "master"})
    current().shipping[pipe.pid].wait()
    _step(pipe, 2)
    rref = pipe.optimizer.remote_optimizers[0]
    state = rref.local_value().optim.state
    first = list(current().host(pipe.pid, 0).module.parameters())
    before = [{k: v.data_ptr() for k, v in state[p].items()} for p in first]
    snapshot.restore(pipe.pid, 0, 1, False, rref)  # into the optimizer at once, as a recovery's rollback does
    assert current().host(pipe.pid, 0).moved_optimizer[0] is None  # nothing left for adopt_optimizer but fields
    snapshot.restore(pipe.pid, 1, 1)  # copied, for adopt_optimizer
    move.adopt_optimizer(pipe.pid, rref, None)
    assert first and [{k: v.data_ptr() for k, v in state[p].items()} for p in first] == before  # no fresh memory
    after = pipe.optimizer_state()
    assert optim and all(torch.equal(after[n][k], optim[n][k]) for n in optim for k in optim[n])
    _step(pipe)  # a later step changes the optimizer's tensors, not the snapshot it came from
    kept = current().snapshots[(pipe.pid, 0)][1]["optimizer"]
    assert kept and all(torch.equal(kept[n]["exp_avg"], optim[n]["exp_avg"]) for n in kept)


def test_a_stage_of_other_tensors_or_shapes_is_refused_by_name(pipe):
    got = move.export_stage(pipe.pid, 0, None, rng=False, copy=True)
    host = current().host(pipe.pid, 0)
    name = next(iter(got["params"]))
    other = dict(got, params={**got["params"], name: torch.zeros(3, 1)})
    with pytest.raises(StageError, match=rf"moving: param {name} has shape .* here and \(3, 1\) there"):
        move.fill_stage(host, other, "moving")
    fewer = dict(got, params={k: v for k, v in got["params"].items() if k != name})
    with pytest.raises(StageError, match=rf"other params than the one it replaces \(only here: \['{name}'\]"):
        move.fill_stage(host, fewer, "moving")
    before = {k: v.clone() for k, v in host.module.state_dict().items()}
    move.fill_stage(host, got, "moving")  # its own values: nothing changes
    assert all(torch.equal(v, before[k]) for k, v in host.module.state_dict().items())


def _failed(text: str) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_exception(RuntimeError(text))
    return fut


def test_a_snapshot_whose_owner_failed_to_answer_is_still_a_candidate_for_recovery(monkeypatch):
    """The owner may have shipped its copy and died before answering: what is held decides, not the answer;
    nothing is said of a lost owner's snapshot (its loss is said by the recovery)."""
    monkeypatch.setattr("rpcmp.master.recovery.unresponsive", lambda processes, timeout: list(processes))
    snaps = Snapshots(None, 5, [])
    snaps.taking, snaps.kept = [("worker2", 5, _failed("EOF"))], {0: {"position": (0, 0, 0)}, 5: {"position": (5, 0, 5)}}
    snaps.settle()
    assert sorted(snaps.kept) == [0, 5] and snaps.taking == [] and snaps.notes == []


def test_a_snapshot_an_owner_that_answers_could_not_take_is_said_once_per_reason(world):
    serve(world)  # the master of the one-process world answers its ping
    snaps = Snapshots(None, 5, [])
    for step in (5, 10):
        snaps.taking = [("master", step, _failed("TensorPipe RPC backend only supports CPU tensors by default"))]
        snaps.settle()
    assert len(snaps.notes) == 1 and snaps.notes[0].startswith("warning: master could not take the snapshot of step 5 ")
    assert "only supports CPU tensors" in snaps.notes[0] and "earlier snapshot" in snaps.notes[0]


def test_a_snapshot_not_whole_says_what_each_process_holds(pipe):
    """The line that ends a run for want of a snapshot names, per process, the steps it holds."""
    _step(pipe)
    snaps = Snapshots(pipe, 5, ["worker9"])
    snapshot.take(pipe.pid, 1, _optims(pipe), {0: "master", 1: "master"})
    current().shipping[pipe.pid].wait()
    snaps.kept = {1: {}}
    assert snaps._whole_snapshot({0: "master", 1: "master"}, "worker2", [1]) == (1, "")
    snaps.kept = {0: {}}  # the master's part of step 1 is gone: not whole
    step, held = snaps._whole_snapshot({0: "master", 1: "master"}, "worker2", [1])
    assert step is None and held == ("master holds stage 1's copy of step 1; master its own of steps [1]; "
                                     "the master its part of steps [0]")
    del current().buddy_snapshots[(pipe.pid, 0)]  # the copy of stage 0 never landed
    step, held = snaps._whole_snapshot({0: "master", 1: "master"}, "worker2", [0])
    assert step is None and held.startswith("master holds no copy of stage 0; master its own of steps [1]")
    why = snaps._cannot(["worker2"], step, None, held)
    assert why.startswith("no snapshot holds the lost stages (--snapshot-every N) (master holds no copy of stage 0;")


def test_a_re_cut_lets_the_old_cut_s_snapshots_go_here_and_on_the_buddies(pipe):
    _step(pipe)
    snapshot.take(pipe.pid, 1, _optims(pipe), {0: "master", 1: "master"})
    current().shipping[pipe.pid].wait()
    old = pipe.pid
    pipe.recut([4, 3])  # both stages change: built again under a new pipeline id
    served = current()
    assert pipe.pid != old
    assert not [k for k in (*served.snapshots, *served.buddy_snapshots) if k[0] == old]
