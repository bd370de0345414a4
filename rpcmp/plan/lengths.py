"""Which input sizes a traced pipeline takes: any batch size, and any length where the model allows.

[Note: any sequence length]
A language model's batches differ in length (tokens, time: dimension 1) as they differ in
size. Dimension 1 of every input is traced as ``Dim.AUTO``: dynamic wherever the model's
``forward`` allows it (positions made with ``torch.arange(t)``, a causal mask, RoPE tables sliced
to ``t``), and kept static, without an error, where the model fixes it (an image's channels, a
positional table added whole). Sizes derived from it travel between stages as the batch
size's do. The plan runs the stages once more on fake tensors one token longer (no computation)
to learn which input dimensions are fixed (:func:`input_sizes`, shown by ``rpcmp plan``), and
the master refuses an input of another size there before any stage runs it (:func:`check_sizes`),
saying what the model fixes. A job whose batches will differ in length says so,
``SplitAt(..., lengths="any")``, and a model that fixes the length is then refused at plan time
(:func:`require_any_length`), naming the line of ``forward`` that fixes it: found by running the
unsplit model on the meta device one token longer, which costs no computation and no memory.
``torch.distributed.pipelining`` needs static shapes; an RPC pipeline does not.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import MicroBatchError, PartitionError
from .traced import run_stages, stage_module

__all__ = ["input_sizes", "check_sizes", "describe_sizes", "require_any_length"]


def input_sizes(pipe, example: Any) -> tuple[tuple[int | None, ...], ...]:
    """For each tensor of the traced model's input ``example``, in order: every dimension's size
    where the stages take no other, None where they take any (see [Note: any sequence length]).
    Dimension 1 is tried one longer on fake tensors (no computation); the rest is as traced."""
    import logging
    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs the expected failure as an error
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        return _sizes(pipe, example)
    finally:
        quiet.setLevel(level)


def _sizes(pipe, example: Any) -> tuple:
    from torch._subclasses.fake_tensor import FakeTensorMode
    leaves, spec = pytree.tree_flatten(example)
    out = []
    for k, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            out.append(())
            continue
        sizes = [None] + [int(n) for n in t.shape[1:]]
        if t.dim() >= 2:
            longer = [torch.cat([x, x[:, :1]], 1) if i == k else x for i, x in enumerate(leaves)]
            try:
                with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                    run_stages([stage_module(pipe, i) for i in range(pipe.num_stages)],
                               pytree.tree_unflatten([mode.from_tensor(x) for x in longer], spec))
                sizes[1] = None
            except Exception:  # noqa: BLE001 - the graph, or the model, fixes the length
                pass
            finally:
                for i in range(pipe.num_stages):  # undo the routing installed for the check
                    pipe.get_stage_module(i).__dict__.pop("forward", None)
        out.append(tuple(sizes))
    return tuple(out)


def check_sizes(sizes: tuple, x: Any) -> None:
    """Refuse, before any stage runs it, an input whose dimension 1 or later differs from a size
    the traced graph fixes."""
    if not sizes:
        return
    for k, (fixed, t) in enumerate(zip(sizes, pytree.tree_leaves(x))):
        shape = tuple(getattr(t, "shape", ()))
        for d, size in enumerate(fixed):
            if d and size is not None and d < len(shape) and shape[d] != size:
                raise MicroBatchError(
                    f"input {k} has size {shape[d]} in dimension {d}, but the model, traced on the job's first batch, "
                    f"fixes that dimension at {size} (its forward needs that size, e.g. it adds a positional table "
                    f"of {size} entries): give it batches of {size}, pad them to {size}, or make forward take any "
                    f"size (slice the table to the input's length)")


def describe_sizes(sizes: tuple, example: tuple) -> str:
    """The model's inputs for ``rpcmp plan``: which dimensions may change from batch to batch."""
    parts = []
    for fixed, (shape, dtype) in zip(sizes, example[0]):
        dims = ["batch" if d == 0 else ("any" if size is None else f"{size} (fixed)") for d, size in enumerate(fixed)]
        parts.append(f"({', '.join(dims)}) {dtype}")
    return "; ".join(parts) + " (any: a batch may have another size there than the traced sample)"


def require_any_length(model, example: Any, sizes: tuple) -> None:
    """``SplitAt(..., lengths="any")``: refuse a model whose stages fix dimension 1 of an input,
    naming the line of its ``forward`` that does (see [Note: any sequence length])."""
    leaves, spec = pytree.tree_flatten(example)
    for k, (fixed, t) in enumerate(zip(sizes, leaves)):
        if len(fixed) < 2 or fixed[1] is None:
            continue
        longer = [torch.cat([x, x[:, :1]], 1) if i == k else x for i, x in enumerate(leaves)]
        raise PartitionError(
            f"SplitAt(..., lengths='any'): batches will differ in length, but {type(model).__name__}.forward takes "
            f"input {k} {tuple(t.shape)} with exactly {fixed[1]} in dimension 1: {_where(model, pytree.tree_unflatten(longer, spec))}. "
            f"Make forward take any length (slice a positional table or mask to the input's length, "
            f"e.g. self.pos[:x.size(1)]), or leave out lengths='any' to train on batches of {fixed[1]} only")


def _where(model, longer: Any) -> str:
    """The line of the unsplit model's code that fails on an input one longer (meta tensors)."""
    import traceback
    try:
        model(longer)  # as the trace calls it: one micro-batch, one argument
    except Exception as exc:  # noqa: BLE001 - the failure is what we report
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename
                  and not f.filename.endswith(__file__.rsplit("/", 1)[-1])]
        at = f"{frames[-1].filename}:{frames[-1].lineno} `{frames[-1].line}` " if frames else ""
        return f"{at}fails one longer ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})"
    return ("the unsplit model takes one longer, so the trace made it a constant "
            "(a Python branch or loop on the length, e.g. `if x.size(1) > n`)")
