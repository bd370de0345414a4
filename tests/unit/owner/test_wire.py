"""``Job(wire="bf16" | "fp16" | "int8")``: activations cross between stages in half (a quarter of)
the bytes, and their gradients come back the same way, while every stage computes in float32. The stages live on the
master of the one-process RPC world (tests/unit/conftest.py), so the hop is a real RPC."""
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rpcmp
from helpers import assert_close_f32, batches, load, train_reference
from rpcmp.core.wire import from_wire, to_wire
from rpcmp.core.served import current, serve


def _train(job, wire, steps=4):
    serve(job)
    pipe = rpcmp.Pipeline(dataclasses.replace(job, wire=wire, optimizer=(torch.optim.SGD, {"lr": 0.05})), world_size=1)
    losses = [pipe.train_step(x, y).item() for x, y in batches(steps, size=16)]
    state, out = pipe.state_dict(), pipe.stats()  # one per stage, in order
    pipe.close()
    return losses, state, out


# int8: a micro-batch's 8 x 32 activation is its ndim and shape (3 int64), one float32 scale (rows of 32
# values would be under 64), a byte a value.
@pytest.mark.parametrize("wire,part,rtol", [("bf16", 1 / 2, 2e-2), ("fp16", 1 / 2, 2e-3),
                                            ("int8", (24 + 4 + 8 * 32) / (4 * 8 * 32), 2e-2)])
def test_a_narrow_wire_sends_fewer_bytes_and_trains_within_its_rounding(world, wire, part, rtol):
    wide_losses, wide_state, wide = _train(world, "fp32")
    losses, state, narrow = _train(world, wire)
    # What stage 0 sent on is that part of what it sends in float32; stage 1 received it so.
    assert narrow[0]["mib_out"] == pytest.approx(wide[0]["mib_out"] * part)
    assert narrow[1]["mib_in"] == narrow[0]["mib_out"]
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
    sent = to_wire((x, tokens, half), "bf16")
    assert [t.dtype for t in sent] == [torch.bfloat16, torch.int64, torch.float16]
    got = from_wire(sent[0].detach().requires_grad_(), "bf16")
    assert got.dtype == torch.float32
    got.sum().backward()
    sent[0].backward(torch.ones(4, 3, dtype=torch.bfloat16))
    assert x.grad.dtype == torch.float32
    assert to_wire(x, "fp32") is x and from_wire(x, "fp32") is x


def test_int8_sends_a_scale_per_row_and_brings_each_value_and_gradient_back_within_half_a_step():
    x = torch.randn(3, 4, 64, requires_grad=True) * torch.logspace(-3, 3, 4)[:, None]  # rows of very different sizes
    x.retain_grad()
    sent = to_wire((x, torch.arange(3), torch.randn(3, dtype=torch.float16)), "int8")
    assert sent[0].dtype == torch.float32 and sent[0].dim() == 1  # the carrier
    assert sent[1].dtype == torch.int64 and sent[2].dtype == torch.float16  # not float32: as they are
    assert sent[0].nbytes == 8 * 4 + 4 * 12 + 3 * 4 * 64  # ndim and shape, a scale per row of 64, the values
    arrived = sent[0].detach().requires_grad_()
    got = from_wire(arrived, "int8")
    step = x.detach().abs().amax(dim=2, keepdim=True) / 127  # one int8 step of each row
    assert got.shape == x.shape and bool(((got - x).abs() <= step / 2 * 1.0001).all())
    grad = torch.randn(3, 4, 64) * torch.logspace(2, -2, 3)[:, None, None]
    got.backward(grad)
    assert arrived.grad.shape == arrived.shape  # the gradient comes back packed the same way
    sent[0].backward(arrived.grad)
    gstep = grad.abs().amax(dim=2, keepdim=True) / 127
    assert bool(((x.grad - grad).abs() <= gstep / 2 * 1.0001).all())
    unused = torch.randn(4, 1, 8, 8, requires_grad=True)  # a value the next stage never reads (smp's first feature):
    carrier = to_wire(unused, "int8")
    carrier.backward(torch.zeros_like(carrier))  # what distributed autograd sends back for it: zeros, header too
    assert torch.equal(unused.grad, torch.zeros(4, 1, 8, 8))
    zeros = from_wire(to_wire(torch.zeros(2, 5), "int8"), "int8")  # a row of zeros has no scale to divide by
    assert torch.equal(zeros, torch.zeros(2, 5))
    assert to_wire(torch.randn(4, 8, 4, 4), "int8").nbytes == 8 * 5 + 4 * 4 + 4 * 128  # 16-value maps: a scale a sample
    bad = torch.ones(3, 2, 64)
    bad[1, 0, 2], bad[2, 1, 0] = float("nan"), float("inf")
    arrived = from_wire(to_wire(bad, "int8"), "int8")
    assert torch.equal(arrived[0], bad[0])  # the rows holding inf or NaN arrive non-finite, not as zeros
    assert not arrived[1, 0].isfinite().any() and not arrived[2, 1].isfinite().any()


def test_another_wire_is_refused_by_name():
    with pytest.raises(rpcmp.JobError, match=r"Job.wire must be 'fp32'.*'bf16' or 'fp16'.*'int8'.*got 'int4'"):
        dataclasses.replace(load("mlp"), wire="int4")


class _Ops(TorchDispatchMode):
    """Every aten operation run under it, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("wire,each_way", [("fp32", []), ("bf16", ["_to_copy"]), ("fp16", ["_to_copy"])])
def test_an_owner_copies_nothing_on_the_way_in_or_out_but_the_wire_format_asks(world, wire, each_way):
    """Between what arrives over RPC and the module, and between the module and what goes to RPC
    (the activation forward, its gradient back): no copy, no contiguous, no device move, for float32;
    one cast each way for a half-precision wire. What RPC itself does (pickling the call once,
    TensorPipe sending each tensor's memory) is beside it."""
    serve(world)
    pipe = rpcmp.Pipeline(dataclasses.replace(world, wire=wire), world_size=1)
    middle = current().host(pipe.pid, 0)  # stage 0 of 2: what it sends on is converted to the wire format
    last = current().host(pipe.pid, 1)  # it receives the wire format
    for host in (middle, last):
        host.module = torch.nn.Identity()  # so that every operation counted is the owner's own
    x = torch.randn(8, 16, requires_grad=True)
    with _Ops() as sending:
        sent = middle._compute(x, True, 0)
    arrived = sent.detach().requires_grad_()  # as RPC hands it over: a leaf of the next context
    with _Ops() as receiving:
        out = last._compute(arrived, True, 0)
    g = torch.ones_like(out)
    with _Ops() as back:  # the gradient comes back: through the receiver, then the sender
        (g_arrived,) = torch.autograd.grad(out, arrived, g)
        (g_x,) = torch.autograd.grad(sent, x, g_arrived)
    assert (sending.names, receiving.names, back.names) == (each_way, each_way, each_way * 2)
    assert g_x.dtype == torch.float32 and g_x.shape == x.shape
    pipe.close()
