"""Placement: which process and device owns each stage.

Processes are named by rank: rank 0 is ``master``, rank r > 0 is ``worker{r}``.
A placement is ``"auto"`` or one ``"process/device"`` string per stage, e.g.
``["worker1/cpu", "worker2/cuda:0", "master/cpu"]``.

``auto`` puts stage i on ``worker{i+1}`` when there are more processes than stages,
and the last stage on the master when there are exactly as many (the master then
computes the loss next to the last stage's output, with no extra hop).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..errors import PlacementError
from .materialize import tensor_names

__all__ = ["Place", "process_name", "resolve_placement", "device_maps_for", "MASTER", "place_unused", "shared_params"]

MASTER = "master"


def process_name(rank: int) -> str:
    return MASTER if rank == 0 else f"worker{rank}"


@dataclass(frozen=True)
class Place:
    process: str
    device: str = "cpu"

    def __str__(self) -> str:
        return f"{self.process}/{self.device}"

    @property
    def rank(self) -> int:
        return 0 if self.process == MASTER else int(self.process[len("worker"):])


def resolve_placement(placement: str | Sequence[str], stages: int, world_size: int, spares: int = 0) -> list[Place]:
    """Turn a placement declaration into one :class:`Place` per stage, checked against the world: the
    ``world_size`` processes that may hold stages, besides the run's ``spares`` (its last ranks)."""
    names = [process_name(r) for r in range(world_size)]
    besides = (f" besides the {spares} spare{'s' if spares > 1 else ''} "
               f"({', '.join(process_name(r) for r in range(world_size, world_size + spares))}, --spares)" if spares else "")
    if placement == "auto":
        if world_size > stages:
            return [Place(process_name(i + 1)) for i in range(stages)]
        if world_size == stages:
            return [Place(process_name((i + 1) % world_size)) for i in range(stages)]
        raise PlacementError(
            f"placement 'auto' needs at least as many processes as stages: {stages} stages > "
            f"{world_size} processes ({', '.join(names)}){besides}; start {stages + spares} processes "
            f"(--local {stages + spares}) or give an explicit placement that puts several stages on one process"
        )
    if isinstance(placement, str) or not isinstance(placement, Sequence):
        raise PlacementError(f"placement must be 'auto' or a list of 'process/device' strings, got {placement!r}")
    if len(placement) != stages:
        raise PlacementError(
            f"placement has {len(placement)} entries but there are {stages} stages: give one 'process/device' per stage"
        )
    places = []
    for i, item in enumerate(placement):
        process, _, device = str(item).partition("/")
        device = device or "cpu"
        if process not in names:
            raise PlacementError(
                f"stage {i} is placed on {process!r}, which is not a process of this run that holds stages; "
                f"with {world_size} processes{besides} the names are {names}"
            )
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise PlacementError(f"stage {i}: {device!r} is not a device ({exc}); use e.g. 'cpu' or 'cuda:0'") from None
        if dev.type not in ("cpu", "cuda"):
            raise PlacementError(f"stage {i}: device type {dev.type!r} is not supported; use 'cpu' or 'cuda:N'")
        if dev.type == "cuda" and dev.index is None:
            device = "cuda:0"
        places.append(Place(process, device))
    return places


def check_device(place: Place) -> torch.device:
    """Owner-side check that the device of ``place`` exists here."""
    dev = torch.device(place.device)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if dev.index >= count:
            raise PlacementError(
                f"a stage is placed on {place}, but {place.process} sees {count} CUDA device(s): "
                f"place it on 'cpu' or on one of cuda:0..cuda:{max(count - 1, 0)}"
            )
    return dev


def device_maps_for(places: list[Place], me: str) -> dict[str, dict[str, str]]:
    """TensorPipe device maps for ``Job(device_maps=True)``: CUDA activations go from
    stage i to stage i + 1 (and gradients back) without a trip through host memory.

    Returns ``{peer: {my_device: peer_device}}`` for every neighbouring pair of CUDA
    stages on different processes that involves process ``me``.

    >>> p = [Place("worker1", "cuda:0"), Place("worker2", "cuda:1"), Place("master", "cpu")]
    >>> device_maps_for(p, "worker1"), device_maps_for(p, "worker2")
    ({'worker2': {'cuda:0': 'cuda:1'}}, {'worker1': {'cuda:1': 'cuda:0'}})
    """
    maps: dict[str, dict[str, str]] = {}
    for a, b in zip(places, places[1:]):
        if a.process == b.process or not (a.device.startswith("cuda") and b.device.startswith("cuda")):
            continue
        if a.process == me:
            maps.setdefault(b.process, {})[a.device] = b.device
        elif b.process == me:
            maps.setdefault(a.process, {})[b.device] = a.device
    return maps


def place_unused(model: nn.Module, held: list[set[str]]) -> list[list[str]]:
    """Where each parameter or buffer that no stage graph reads goes.

    [Note: parameters forward does not use]
    A traced stage holds what its graph reads; a tensor ``forward`` never reads (a pooler, a
    positional table another configuration uses) is in no graph, yet it is part of the model and
    of its ``state_dict``. It is kept, with the stage that holds the same tensor under another
    name (a tied alias), else with the stage that holds its nearest relative by name (its module's
    other tensors), else with the first stage; it gets no gradient, so no optimizer moves it, and
    checkpoints carry it as the plain model's do."""
    names = tensor_names(model)
    placed: list[list[str]] = [[] for _ in held]
    for group in names.values():
        for name in group:
            if any(name in h for h in held):
                continue
            twin = next((i for i, h in enumerate(held) if any(n in h for n in group)), None)
            placed[twin if twin is not None else _nearest(name, held)].append(name)
    return placed


def _nearest(name: str, held: list[set[str]]) -> int:
    def common(a: str, b: str) -> int:
        n = 0
        for x, y in zip(a.split("."), b.split(".")):
            if x != y:
                break
            n += 1
        return n
    scores = [max((common(name, h) for h in names), default=0) for names in held]
    return scores.index(max(scores)) if max(scores) else 0


def shared_params(model: nn.Module, held: list[set[str]]) -> list[tuple[tuple[str, str], ...]]:
    """For each stage: (its name, the unsplit model's first name) of every parameter it shares with
    another stage (see [Note: a parameter shared by stages] in rpcmp/master/tied.py)."""
    params = {id(p) for p in model.parameters()}
    out: list[list[tuple[str, str]]] = [[] for _ in held]
    for key, group in tensor_names(model).items():
        holders = {i: next(n for n in group if n in h) for i, h in enumerate(held) if any(n in h for n in group)}
        if key in params and len(holders) > 1:
            for i, name in holders.items():
                out[i].append((name, group[0]))
    return [tuple(t) for t in out]
