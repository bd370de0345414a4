"""``Job(wire="bf16" | "fp16")``: activations cross between stages in half the bytes, and their
gradients come back the same way, while every stage computes in float32. The stages live on the
master of the one-process RPC world (tests/unit/conftest.py), so the hop is a real RPC."""
import dataclasses

import pytest
import torch

import rpcmp
from helpers import assert_close_f32, batches, load, train_reference
from rpcmp.core.microbatch import from_wire, to_wire
from rpcmp.core.served import serve


def _train(job, wire, steps=4):
    serve(job)
    pipe = rpcmp.Pipeline(dataclasses.replace(job, wire=wire, optimizer=(torch.optim.SGD, {"lr": 0.05})), world_size=1)
    losses = [pipe.train_step(x, y).item() for x, y in batches(steps, size=16)]
    state, out = pipe.state_dict(), pipe.stats()  # one per stage, in order
    pipe.close()
    return losses, state, out


@pytest.mark.parametrize("wire,dtype,rtol", [("bf16", torch.bfloat16, 2e-2), ("fp16", torch.float16, 2e-3)])
def test_a_narrow_wire_halves_the_bytes_and_trains_within_its_rounding(world, wire, dtype, rtol):
    wide_losses, wide_state, wide = _train(world, "fp32")
    losses, state, narrow = _train(world, wire)
    # What stage 0 sent on is half of what it sends in float32; stage 1 received it so.
    assert narrow[0]["mib_out"] == pytest.approx(wide[0]["mib_out"] / 2)
    assert narrow[1]["mib_in"] == pytest.approx(wide[1]["mib_in"] / 2)
    assert losses != wide_losses  # rounded on the way: not the float32 numbers
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(wide_losses), rtol=rtol, atol=rtol)
    for key, value in state.items():
        assert value.dtype == torch.float32  # the stages keep computing in float32
        torch.testing.assert_close(value, wide_state[key], rtol=rtol, atol=rtol)


def test_the_float32_wire_is_the_unsplit_model_exactly(world):
    losses, state, _ = _train(world, "fp32")
    torch.manual_seed(world.seed)
    ref_losses, ref_state = train_reference(world.model(), (torch.optim.SGD, {"lr": 0.05}), world.loss,
                                            batches(4, size=16))
    assert_close_f32(losses, ref_losses)
    assert_close_f32(state, ref_state)


def test_only_float32_tensors_go_narrow_and_come_back_as_float32_with_a_narrow_gradient():
    x = torch.randn(4, 3, requires_grad=True)
    tokens, half = torch.arange(4), torch.randn(2, dtype=torch.float16)
    sent = to_wire((x, tokens, half), torch.bfloat16)
    assert [t.dtype for t in sent] == [torch.bfloat16, torch.int64, torch.float16]
    got = from_wire(sent[0].detach().requires_grad_(), torch.bfloat16)
    assert got.dtype == torch.float32
    got.sum().backward()
    sent[0].backward(torch.ones(4, 3, dtype=torch.bfloat16))
    assert x.grad.dtype == torch.float32
    assert to_wire(x, None) is x and from_wire(x, None) is x


def test_another_wire_is_refused_by_name():
    with pytest.raises(rpcmp.JobError, match=r"Job.wire must be 'fp32'.*'bf16' or 'fp16'.*got 'int4'"):
        dataclasses.replace(load("mlp"), wire="int4")
