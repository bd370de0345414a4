"""Activation checkpointing of a stage, in one process: the same outputs, gradients, dropout masks
and BatchNorm running statistics as without it, and the RNG left where the first pass left it."""
import copy
import threading

import torch
from torch import nn

from rpcmp.owner.recompute import Recomputed, make_recomputable


def _stage():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2))


def _run(module, x, recompute):
    torch.manual_seed(11)
    if recompute:
        out = Recomputed.run(module, threading.RLock(), torch.device("cpu"), x)
    else:
        out = module(x)
    torch.rand(5)  # other work draws from the RNG before the backward reaches the stage
    out.pow(2).sum().backward()
    return out.detach(), [p.grad.clone() for p in module.parameters()]


def test_recomputation_matches_the_plain_stage_exactly():
    x = torch.randn(16, 6)
    plain, again = _stage(), _stage()
    make_recomputable(again)
    out_a, grads_a = _run(plain, x.clone().requires_grad_(), recompute=False)
    out_b, grads_b = _run(again, x.clone().requires_grad_(), recompute=True)
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)  # the same dropout mask in both passes
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    bn_a, bn_b = plain[1], again[1]
    torch.testing.assert_close(bn_b.running_mean, bn_a.running_mean, rtol=0, atol=0)  # updated once, not twice
    assert bn_b.num_batches_tracked.item() == bn_a.num_batches_tracked.item() == 1


def test_the_recomputation_puts_back_the_rng_the_other_work_left():
    stage = _stage()
    make_recomputable(stage)
    x = torch.randn(16, 6, requires_grad=True)
    torch.manual_seed(11)
    out = Recomputed.run(stage, threading.RLock(), torch.device("cpu"), x)
    torch.rand(5)
    before_backward = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), before_backward)


def test_one_mixed_in_class_per_batchnorm_class():
    a, b = copy.deepcopy(_stage()), _stage()
    make_recomputable(a)
    make_recomputable(b)
    make_recomputable(b)  # twice: no second mix-in
    assert type(a[1]) is type(b[1]) and type(b[1]).__mro__[2] is nn.BatchNorm1d
