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

from ..errors import PlacementError

__all__ = ["Place", "process_name", "resolve_placement", "device_maps_for", "MASTER"]

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
