"""Job(replicas=R) without processes: the grid, the shares of a batch, the meeting point, the refusals."""
import threading

import pytest
import torch

import rpcmp
from rpcmp.errors import JobError, PlacementError
from rpcmp.plan.placement import Place
from rpcmp.master.replicas import ReplicaSync, shard, unshard
from rpcmp.plan.topology import Topology


def _grid(job, world_size, nodes=None):
    return [list(row) for row in Topology.of(job, world_size, nodes=nodes).grid]


def _job(**kw):
    return rpcmp.Job(model=lambda: torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)),
                     stages=rpcmp.Split([1, 1]), batch_size=8, **kw)


def test_auto_keeps_a_stages_copies_on_consecutive_ranks_and_a_copys_stages_apart():
    grid = _grid(_job(replicas=2), world_size=5)
    assert [[p.process for p in row] for row in grid] == [["worker1", "worker3"], ["worker2", "worker4"]]
    grid = _grid(_job(replicas=2), world_size=4)  # exactly R x S: the master holds a copy
    assert [[p.process for p in row] for row in grid] == [["master", "worker2"], ["worker1", "worker3"]]
    with pytest.raises(PlacementError, match=r"2 replicas x 2 stages need 4 processes \(or 5: .*got 3"):
        _grid(_job(replicas=2), world_size=3)


def test_auto_keeps_a_stages_copies_on_one_node_and_a_copys_stages_on_other_nodes():
    def names(grid):
        return [[p.process for p in row] for row in grid]
    # torchrun --nnodes 3 --nproc-per-node 2: the master (rank 0) holds no stage; by rank, stage 0's copies
    # would be ranks 1 and 2, on two nodes
    by_node = [f"node {q // 2}" for q in range(6)]
    assert names(_grid(_job(replicas=2), 6, nodes=by_node)) == [["worker2", "worker4"], ["worker3", "worker5"]]
    # two nodes of 4: each stage's copies on one node, the two stages on the two nodes
    two = ["a"] * 4 + ["b"] * 4
    assert names(_grid(_job(replicas=2), 8, nodes=two)) == [["worker1", "worker4"], ["worker2", "worker5"]]
    # a node per process (no node has 2): by rank, as on one node
    assert names(_grid(_job(replicas=2), 5, nodes=list("abcde"))) == names(_grid(_job(replicas=2), 5))


def test_an_explicit_grid_is_listed_copy_by_copy_and_copies_of_a_stage_need_their_own_processes():
    job = _job(replicas=2, placement=["worker1/cpu", "worker2/cpu", "worker3/cpu", "worker4/cpu"])
    assert _grid(job, 5) == [[Place("worker1"), Place("worker2")], [Place("worker3"), Place("worker4")]]
    with pytest.raises(PlacementError, match="4 'process/device' entries"):
        _grid(_job(replicas=2, placement=["worker1", "worker2"]), 5)
    with pytest.raises(PlacementError, match=r"the 2 copies of stage 0 must be on 2 different processes.*'worker1', 'worker1'"):
        _grid(_job(replicas=2, placement=["worker1", "worker2", "worker1", "worker3"]), 5)
    with pytest.raises(PlacementError, match=r"copies of stage 1 are on \['worker2/cpu', 'worker4/cuda:0'\]: put them all on CUDA"):
        _grid(_job(replicas=2, placement=["worker1", "worker2", "worker3", "worker4/cuda:0"]), 5)


def test_shares_are_what_distributed_samplers_hand_out_and_weave_back_in_order():
    x = {"image": torch.arange(12).reshape(6, 2), "id": torch.arange(6), "tag": "batch"}
    parts = [shard(x, r, 3) for r in range(3)]
    assert parts[1]["id"].tolist() == [1, 4] and parts[2]["image"].tolist() == [[4, 5], [10, 11]] and parts[0]["tag"] == "batch"
    back = unshard(parts)
    assert torch.equal(back["image"], x["image"]) and torch.equal(back["id"], x["id"])
    assert torch.equal(unshard([torch.arange(3), torch.arange(3, 5)]), torch.tensor([0, 3, 1, 4, 2]))  # uneven shares


def test_the_copies_leave_the_meeting_with_the_mean_loss_or_all_stop_when_one_fails():
    sync, out = ReplicaSync(2, timeout=10), [None, None]

    def meet(i):
        out[i] = sync.meet(i, torch.tensor(float(i + 1)))
    threads = [threading.Thread(target=meet, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out[0].item() == out[1].item() == 1.5
    sync.reset()
    waiting = threading.Thread(target=lambda: out.__setitem__(0, _broken(sync)))
    waiting.start()
    sync.abort()  # the other copy failed before it got here
    waiting.join(10)
    assert out[0] == "broken"


def _broken(sync):
    try:
        sync.meet(0, torch.tensor(1.0))
    except threading.BrokenBarrierError:
        return "broken"


@pytest.mark.parametrize("fields,match", [
    ({"replicas": 3}, r"batch_size \(8\) is the global batch, split over 3 replicas"),
    ({"replicas": 2, "microbatches": 8}, r"make it a multiple of 2 of at least 16"),
    ({"replicas": 2, "mode": "ddp"}, "DDP mode copies the whole model"),
    ({"replicas": 2, "trace_file": "t.json"}, "trace with replicas=1"),
    ({"replicas": 0}, "Job.replicas must be a positive integer"),
])
def test_a_job_with_replicas_it_cannot_run_is_refused_with_what_to_change(fields, match):
    with pytest.raises(JobError, match=match):
        _job(**fields)


def test_too_few_processes_for_the_stages_and_the_spares_counts_the_spares_in_the_way_out():
    with pytest.raises(PlacementError, match=r"got 3 besides 1 spare \(--spares\): start 6 processes \(--local 6\)"):
        Topology.of(_job(replicas=2, spares=1), world_size=4)  # 2 x 2 stages (+ the master) and a spare: 6
    with pytest.raises(PlacementError, match=r"2 stages > 1 processes \(master\) besides the 2 spares \(worker1, worker2, "
                                             r"--spares\); start 4 processes \(--local 4\)"):
        Topology.of(_job(spares=2), world_size=3)
    with pytest.raises(PlacementError, match=r"'worker2', which is not a process of this run that holds stages; with 2 "
                                             r"processes besides the 1 spare \(worker2, --spares\)"):
        Topology.of(_job(spares=1, placement=["worker1/cpu", "worker2/cpu"]), world_size=3)
