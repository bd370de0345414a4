"""Job(rebalance=True)'s decision, on measured stage times: re-cut when the slowest stage gets at least
5 % faster, never back to a balance it has had (rpcmp.master.recut.Rebalancer)."""
import types

import torch
from torch import nn

import rpcmp
from rpcmp.master.recut import Rebalancer


def _pipe(balance):
    job = rpcmp.Job(model=lambda: nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)]), stages=rpcmp.Split(balance),
                    batch_size=4, loss=nn.functional.mse_loss, optimizer=(torch.optim.SGD, {"lr": 0.1}))
    specs, start = [], 0
    for n in balance:
        specs.append(types.SimpleNamespace(start=start, stop=start + n))
        start += n
    return types.SimpleNamespace(job=job, specs=specs, owners=["worker1", "worker2", "worker3"])


def test_an_uneven_cut_of_equal_layers_is_evened_out():
    r = Rebalancer(_pipe([1, 5, 2]))
    balance, now, then = r.propose([1.0, 5.0, 2.0])  # time in proportion to the layers: equal layers
    assert max(balance) == 3 and sum(balance) == 8
    assert now == 5.0 and then == 3.0


def test_a_small_gain_or_a_balance_it_had_is_not_taken():
    r = Rebalancer(_pipe([3, 3, 2]))
    assert r.propose([3.0, 3.0, 2.0])[0] is None  # already the best: nothing gains 5 %
    r = Rebalancer(_pipe([2, 3, 3]))
    better = r.propose([2.0, 3.6, 2.4])[0]
    assert better is not None and max(better) == 3
    r.had.add(better)
    assert r.propose([2.0, 3.6, 2.4])[0] is None  # the better cut is one it had: it does not go back


def test_measured_costs_not_parameter_counts_decide():
    r = Rebalancer(_pipe([4, 2, 2]))
    balance, _, _ = r.propose([1.0, 4.0, 1.0])  # the middle stage's two layers are slow ones
    assert balance[1] == 1 and sum(balance) == 8
