"""What crosses between stages (``Job.wire``): activations, and the gradients that come back for them.

- ``fp32``: as computed.
- ``bf16`` / ``fp16``: every float32 tensor cast, half the bytes; its gradient comes back cast too.
- ``int8``: every float32 tensor as int8 with one float32 scale (absmax / 127) per row, about a
  quarter of the bytes; its gradient comes back the same way. A row is a token of a
  ``[batch, tokens, features]`` activation, one channel's map of a ``[batch, channels, height,
  width]`` one (dims 0 and 1 kept, the rest flattened); where that leaves fewer than 64 values a
  row, a sample (dim 0 kept), or else the whole tensor, so that the scales cost at most 1/16 of
  the int8 bytes (a 4x4 deep feature map would otherwise double them).

Tensors of other dtypes (token ids, masks, what already is half precision) cross as they are, and
every stage computes in its own precision: the receiver turns what arrives into float32 again.

[Note: an int8 hop's gradient rides on its carrier]
Distributed autograd sends back a gradient of the shape and dtype of what was sent, and only a
floating-point tensor can carry one, so an int8 value cannot cross as an int8 tensor and still be
differentiable. An int8 hop sends one float32 *carrier* instead: the value's shape, its per-row
scales and its int8 values, as bytes viewed as float32. The receiver unpacks it; its backward packs
the gradient it got in the same way, which for the same shape gives a carrier of the same size,
and returns that as the carrier's gradient; the sender's backward unpacks it. Nothing computes
with a carrier's float32 "values": each carrier has one sender and one reader, so autograd hands
its gradient on without adding to it, and TensorPipe copies bytes, so any bit pattern (a NaN's
among them) arrives intact.

>>> x = torch.randn(2, 3, 64, requires_grad=True)
>>> sent = to_wire(x, "int8")
>>> sent.dtype, sent.numel() * 4 < x.nbytes / 2
(torch.float32, True)
>>> got = from_wire(sent.detach().requires_grad_(), "int8")
>>> torch.allclose(got, x, atol=x.abs().max().item() / 254), got.shape
(True, torch.Size([2, 3, 64]))
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .microbatch import map_tensors

__all__ = ["WIRES", "to_wire", "from_wire"]

_CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
WIRES = ("fp32", "bf16", "fp16", "int8")  # the choices of Job.wire


def to_wire(batch: Any, wire: str) -> Any:
    """The float32 tensors of ``batch`` as ``wire`` sends them to the next stage. Differentiable:
    their gradients travel back in the same format."""
    if wire == "fp32":
        return batch
    if wire == "int8":
        return map_tensors(batch, lambda t: _Hop.apply(t, _pack, _unpack) if t.dtype == torch.float32 else t)
    return map_tensors(batch, lambda t: t.to(_CAST[wire]) if t.dtype == torch.float32 else t)


def from_wire(batch: Any, wire: str) -> Any:
    """What :func:`to_wire` sent, in float32 again for the stage's own computation."""
    if wire == "fp32":
        return batch
    if wire == "int8":  # every float32 tensor that crosses an int8 hop is a carrier
        return map_tensors(batch, lambda t: _Hop.apply(t, _unpack, _pack) if t.dtype == torch.float32 else t)
    return map_tensors(batch, lambda t: t.float() if t.dtype == _CAST[wire] else t)


def _pack(x: torch.Tensor, shape: list[int] | None = None) -> torch.Tensor:
    """``x`` (float32) as a 1-D float32 carrier: int64 ndim and shape, float32 scales, int8 values.
    (``shape`` is unused: :class:`_Hop` calls both directions alike.)"""
    rows, cols = _grid(list(x.shape))
    flat = x.detach().reshape(rows, cols)
    amax = flat.abs().amax(dim=1) if flat.numel() else flat.new_zeros(rows)
    # A row of zeros gets scale 1; a row holding inf or NaN gets a non-finite scale and arrives
    # non-finite, so that a diverging model is still stopped (Job.nonfinite), not fed zeros.
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 127)
    q = torch.round(flat / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    head = torch.tensor([x.dim(), *x.shape], dtype=torch.int64, device=x.device)
    parts = [head.view(torch.uint8), scale.view(torch.uint8), q.reshape(-1).view(torch.uint8)]
    size = sum(p.numel() for p in parts)
    parts.append(torch.zeros(-size % 4, dtype=torch.uint8, device=x.device))
    return torch.cat(parts).view(torch.float32)


def _unpack(carrier: torch.Tensor, shape: list[int] | None = None) -> torch.Tensor:
    """What :func:`_pack` packed; ``shape``: the sender's own, for a carrier's gradient, which is all
    zeros (header included) when the receiver never used the value (an smp encoder's first feature)."""
    raw = carrier.detach().contiguous().view(torch.uint8)
    ndim = int(raw[:8].view(torch.int64)) if shape is None else len(shape)
    shape = raw[8:8 * (ndim + 1)].view(torch.int64).tolist() if shape is None else shape
    rows, cols = _grid(shape)
    at = 8 * (ndim + 1)
    scale = raw[at:at + 4 * rows].view(torch.float32)
    q = raw[at + 4 * rows:at + 4 * rows + rows * cols].view(torch.int8)
    return (q.reshape(rows, cols).float() * scale[:, None]).reshape(shape)


def _grid(shape: list[int]) -> tuple[int, int]:
    """Rows (one scale each) and columns of a tensor of ``shape``: dims 0 and 1 kept, or dim 0 alone,
    or none, the first that leaves rows of at least ``_ROW`` values."""
    numel = math.prod(shape)
    for keep in (2, 1):
        rows = math.prod(shape[:keep])
        if len(shape) > keep and rows and numel // rows >= _ROW:
            return rows, numel // rows
    return 1, numel


_ROW = 64  # values per scale at least: a scale costs at most 1/16 of the int8 bytes


class _Hop(torch.autograd.Function):
    """``there(t)`` forward, ``back(grad)`` backward: ``(_pack, _unpack)`` on the sender,
    ``(_unpack, _pack)`` on the receiver."""

    @staticmethod
    def forward(ctx, t, there, back):
        ctx.back, ctx.shape = back, list(t.shape)
        return there(t)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous(), ctx.shape), None, None
