"""Job(rebalance=True)'s decision, on measured stage times: re-cut when the slowest stage gets at least
5 % faster, never back to a balance it has had (rpcmp.master.recut.Rebalancer)."""
import types

import pytest
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


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=16, n_embd=32, n_layer=6, n_head=4, use_cache=False))


def _traced_pipe(points):
    job = rpcmp.Job(model=_gpt2, stages=rpcmp.SplitAt(*points), batch_size=4, loss=nn.functional.cross_entropy,
                    optimizer=(torch.optim.SGD, {"lr": 0.1}), rebalance=True)
    return types.SimpleNamespace(job=job, specs=[types.SimpleNamespace(cut=tuple(points))] * (len(points) + 1),
                                 owners=["worker1", "worker2", "worker3"])


def test_a_split_at_moves_its_points_among_the_blocks_the_head_weighing_on_the_last_stage():
    r = Rebalancer(_traced_pipe(["transformer.h.1", "transformer.h.2"]))
    assert r.units.names == tuple(f"transformer.h.{i}" for i in range(6)) and r.balance == (1, 1, 4)
    block, last = r.units.weights[0], r.units.weights[-1]
    assert r.units.weights[1:-1] == (block,) * 4 and last > block  # the tied head's product; the embeddings, nothing
    balance, now, then = r.propose([1.0, 1.0, 4.0 + (last - block) / block])  # time in proportion to the weights
    assert then < now and sum(balance) == 6 and balance[-1] < 4
    assert r.units.cut(balance) == tuple(f"transformer.h.{i}" for i in (balance[0], balance[0] + balance[1]))


def test_only_points_among_one_module_s_children_can_move():
    with pytest.raises(rpcmp.errors.JobError, match="children of one module"):
        _traced_pipe(["transformer.h.1", "lm_head"])
    with pytest.raises(rpcmp.errors.PartitionError, match="after the first"):
        Rebalancer(_traced_pipe(["transformer.h.0", "transformer.h.2"]))
