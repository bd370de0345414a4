"""Tensors a model's construction makes by ``copy.deepcopy``, for :func:`rpcmp.plan.materialize.build_part`.

[Note: copies of a module]
``nn.TransformerEncoder(layer, n)`` (and ``nn.TransformerDecoder``, ``nn.Transformer``, DETR-style ``_get_clones``)
builds one layer and deep-copies it ``n`` times: the copies' tensors are the model's, and no registration hook sees
them made (a deep copy fills the new module's tables directly). :func:`build_part` hands every tensor its stage does
not keep a view of one scratch buffer, so the layer that is copied held scratch, which later constructions wrote
over: every copy got another tensor's values, and a pipeline of ``nn.TransformerEncoder`` trained another model than
the unsplit one (its first loss 5 % off), without a word. So the construction runs with ``copy.deepcopy`` of a tensor
seen as well (:class:`Copies`): the meta run records each copy in order, what it copied (a registration or an earlier
copy) and the names the copy ends with; the real run then gives memory of its own to every tensor a kept copy is
made from (the layer copied: one layer more, for the construction's time), lets a kept copy (and one the model
does not hold: a temporary the construction may read) clone it, and makes every other copy, a tensor of another
stage, a scratch view of its own (so that an initialization after the copy still draws the same numbers).
"""
from __future__ import annotations

import threading
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..errors import PartitionError

__all__ = ["Copies", "Copy", "recorded", "needed", "same"]

_LOCAL = threading.local()
_LOCK = threading.Lock()
_ORIGINAL = {torch.Tensor: torch.Tensor.__deepcopy__, nn.Parameter: nn.Parameter.__deepcopy__}
_active = 0


class Copy(NamedTuple):
    """A deep copy of a tensor during the construction: the names the copy has in the model, its shape and dtype,
    and what it copied: ("registered", i), ("copy", j) or None (a tensor neither registered nor copied)."""

    names: list[str]
    shape: tuple
    dtype: torch.dtype
    source: tuple | None


def _hooked(cls):
    original = _ORIGINAL[cls]

    def __deepcopy__(self, memo):
        on_copy = getattr(_LOCAL, "on_copy", None)
        if on_copy is None or isinstance(self, nn.parameter.UninitializedTensorMixin):
            return original(self, memo)
        return on_copy(self, memo, original)
    return __deepcopy__


class Copies:
    """While the ``with`` block runs, ``on_copy(tensor, memo, original_deepcopy)`` makes every deep copy of a
    parameter or buffer in this thread; other threads copy as always."""

    def __init__(self, on_copy: Callable):
        self.on_copy = on_copy

    def __enter__(self):
        global _active
        with _LOCK:
            if not _active:
                for cls in _ORIGINAL:
                    cls.__deepcopy__ = _hooked(cls)
            _active += 1
        _LOCAL.on_copy = self.on_copy
        return self

    def __exit__(self, *exc):
        global _active
        _LOCAL.on_copy = None
        with _LOCK:
            _active -= 1
            if not _active:
                for cls, original in _ORIGINAL.items():
                    cls.__deepcopy__ = original


def recorded(copies: list[tuple], registered: list[torch.Tensor], names: dict[int, list[str]],
             meta_of: dict[int, torch.Tensor]) -> list[Copy]:
    """The meta run's ``copies`` ((the tensor copied, its copy), in order) as :class:`Copy` records: ``registered``,
    the tensors registered, in order; ``names``, the model's (by id); ``meta_of``: what each tensor became there."""
    where = {id(t): ("registered", i) for i, t in enumerate(registered)}
    out = []
    for j, (source, copy) in enumerate(copies):
        out.append(Copy(names.get(id(meta_of.get(id(copy), copy)), []), tuple(copy.shape), copy.dtype, where.get(id(source))))
        where[id(copy)] = ("copy", j)  # a copy that is then registered too is the copy's: its value comes from it
    return out


def same(job, what: str, first: tuple, t: torch.Tensor) -> None:
    """Refuse a construction that ``what`` (registered, copied) another tensor than the first time (``first``: its
    shape and dtype then)."""
    if first != (tuple(t.shape), t.dtype):
        raise PartitionError(
            f"building {job.source or 'the model'} twice {what} different tensors ({first[0]}, {first[1]} the first "
            f"time, {tuple(t.shape)}, {t.dtype} the second): the model's construction is not deterministic, so "
            f"an owner cannot build its part alone. Build the same model for the same seed, or declare the "
            f"stages as modules")


def needed(copies: list[Copy], keep: Callable[[str], bool]) -> tuple[list[bool], set[int]]:
    """Which copies the built part must make for real (it keeps them, they are no tensor of the model: a temporary
    the construction may read, or a kept one is made from them), and which registrations must hold their own values
    for that (see [Note: copies of a module])."""
    real = [not c.names or any(keep(n) for n in c.names) for c in copies]  # a temporary may be read: its values
    registrations: set[int] = set()
    for j in reversed(range(len(copies))):
        source = copies[j].source
        if not real[j] or source is None:
            continue
        if source[0] == "copy":
            real[source[1]] = True
        else:
            registrations.add(source[1])
    return real, registrations
