"""What a ``SplitAt``'s points must be: modules ``forward`` calls once each, named in the order it calls them,
with something computed between every two."""
from __future__ import annotations

from torch import nn

from ..errors import PartitionError

__all__ = ["check_reached", "check_stages"]


def check_reached(model: nn.Module, split, reached: list) -> None:
    """Each point is a module forward calls once, and the points are named in the order it calls them: the
    stages are named after them ("h.1..h.3"), so another order named every stage wrongly."""
    if not split.points or None in reached or list(reached) == list(split.points):
        return
    name = type(model).__name__
    twice = sorted({p for p in reached if reached.count(p) > 1})
    never = [p for p in split.points if p not in reached]
    raise PartitionError(
        f"SplitAt{split.points}: " + (f"{name}.forward calls {twice} more than once; a split point must be a module "
                                      f"forward calls once" if twice else
                                      f"{name}.forward never calls {never}{_instead(model, never)}" if never
                                      else f"{name}.forward reaches the points in the order {tuple(reached)}: name "
                                      f"them in that order"))


def _instead(model: nn.Module, never: list[str]) -> str:
    """What to cut at instead of modules ``forward`` never calls: the children of a container (a ``ModuleList`` of
    blocks has no ``forward``: a loop calls each block), or why such a module cannot be a point."""
    for point in never:
        module = model.get_submodule(point)
        children = [f"{point}.{n}" for n, _ in module.named_children()]
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and children:
            return (f": {point} is a {type(module).__name__}, whose blocks forward calls one by one; cut before one "
                    f"of them ({', '.join(repr(c) for c in children[:3])}{', ...' if len(children) > 3 else ''})")
    return (": a module forward does not call (one whose parameters another module reads, or one on a path this "
            "batch does not take) cannot be a point; name a module forward calls")


def check_stages(cls: str, split, pipe) -> None:
    """Refuse a cut that leaves a stage without an operation (two points around an ``nn.Identity``): pipelining
    makes no module for it (``'GraphModule' object has no attribute 'submod_pp_1'``)."""
    bounds = ["the input", *map(repr, split.points), "the output"]
    for i in range(len(split.points) + 1):
        try:
            pipe.get_stage_module(i)
        except AttributeError:
            raise PartitionError(f"SplitAt{split.points}: the stage from {bounds[i]} to {bounds[i + 1]} holds no "
                                 f"operation of {cls}.forward (a module that computes nothing, nn.Identity, or two "
                                 f"points at one place): leave out one of its points") from None
