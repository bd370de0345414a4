import pytest
import torch
from torch import nn

from rpcmp.plan.balance import balance_by_params, balance_by_time, partition_costs
from rpcmp.errors import PartitionError


@pytest.mark.parametrize("costs,parts,expected", [
    ([1, 1, 1, 1], 2, [2, 2]),
    ([1, 1, 1, 1, 4], 2, [4, 1]),
    ([5, 1, 1, 1, 1, 1], 3, [1, 3, 2]),
    ([3], 1, [1]),
])
def test_partition_minimises_heaviest_stage(costs, parts, expected):
    sizes = partition_costs(costs, parts)
    assert sum(sizes) == len(costs) and all(s > 0 for s in sizes)
    heaviest = max(sum(costs[sum(sizes[:i]):sum(sizes[:i + 1])]) for i in range(parts))
    best = max(sum(costs[sum(expected[:i]):sum(expected[:i + 1])]) for i in range(parts))
    assert heaviest == best


def test_partition_errors():
    with pytest.raises(PartitionError, match=r"cannot cut 2 layers into 3 stages"):
        partition_costs([1, 1], 3)


def test_balance_by_params_puts_the_big_layer_alone():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(64, 64))
    assert balance_by_params(model, 2) == [3, 1]


def test_balance_by_time_follows_cost():
    # the heavy layers (about 1.6 GFLOP each, forward and backward) far above what a busy machine's preemption
    # adds to a cheap one's time (512 x 512 on 64 rows: once the cheap layer measured the heavier, under load)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 1024),
                          nn.Linear(1024, 8))
    sizes = balance_by_time(model, 2, torch.randn(256, 8), repeats=5)
    assert sum(sizes) == 5 and len(sizes) == 2
    assert sizes[0] >= 2  # the two cheap layers never form a stage on their own with a heavy one left over
    assert all(p.grad is None for p in model.parameters())
