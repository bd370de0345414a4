"""Tensors the stages of a traced split hold that the model has no name for: refused, saying why
and what to change (the promise of ``SplitAt`` is the unsplit model's names)."""
from __future__ import annotations

from torch import nn

from .graphs import graphs
from .materialize import attribute, tensor_table
from .repeats import repeated_call
from ..errors import PartitionError

__all__ = ["refuse_strange", "cached_modules"]


def refuse_strange(model: nn.Module, pipe, held: list[set[str]]) -> None:
    """Refuse, saying why, a split whose stages hold tensors the model has no name for: a constant that
    ``forward`` makes from Python values on the meta device (its value is not known), or state ``forward``
    keeps between calls (a key-value cache)."""
    strange = sorted(set().union(*held) - set(tensor_table(model)))
    if not strange:
        return
    repeated = sorted({repeated_call(n) for n in strange} - {None})
    if repeated:  # see [Note: a module forward calls more than once]
        raise PartitionError(
            f"SplitAt: {type(model).__name__}.forward calls {repeated[:3]} more than once, and the calls trace to "
            f"different graphs (other shapes, arguments or branches), so a stage would hold a copy of its tensors per "
            f"call under names the model does not have ({strange[0]}). Cut so that the calls that differ fall in "
            f"different stages, or declare the stages as modules")
    lifted = [(i, n) for i in range(pipe.num_stages) for n in sorted(held[i]) if n in strange
              and n.rpartition(".")[2].startswith("lifted_tensor") and attribute(pipe.get_stage_module(i), n).is_meta]
    if lifted and not cached_modules(model):  # a key-value cache is such a tensor too: the setting to change says more
        i, name = lifted[0]
        where, _, leaf = name.rpartition(".")
        readers = sorted({str(u.target) for _, _, g in graphs(pipe.get_stage_module(i).get_submodule(where))
                          for node in g.nodes if node.op == "get_attr" and node.target == leaf for u in _readers(node)})
        raise PartitionError(
            f"SplitAt: {where or type(model).__name__}'s forward makes a tensor from Python values on its input's device ({name}, read by "
            f"{', '.join(readers) or 'the graph'}; indexing with a list, x[..., [-2]], does this). Traced on the meta "
            f"device, its value is unknown, so the stage could not be built exactly. Index with a slice "
            f"(x[..., -2:-1]) or a registered buffer, or declare the stages by modules (rpcmp.Split over an "
            f"nn.Sequential)")
    raise PartitionError(f"SplitAt: the traced stages hold tensors {type(model).__name__} has no name for "
                         f"({strange[:5]}{'...' if len(strange) > 5 else ''}): tensors its forward creates and "
                         f"keeps between calls, which a stage cannot hand on. {_cache_hint(model)}")


def _readers(node) -> list:
    """The nodes that read ``node``'s value, past the copies export makes of a constant (``lift_fresh_copy``)."""
    return [r for u in node.users for r in (_readers(u) if "lift_fresh" in str(u.target) else [u])]


def cached_modules(model: nn.Module) -> list[str]:
    """The submodules whose Hugging Face config keeps a key-value cache."""
    return [n for n, m in model.named_modules() if getattr(getattr(m, "config", None), "use_cache", False)]


def _cache_hint(model: nn.Module) -> str:
    """The setting to change when a Hugging Face model's key-value cache is what the trace kept."""
    cached = cached_modules(model)
    if cached:
        where = f"self.{cached[0]}" if cached[0] else "the model"
        return (f"{where} has config.use_cache=True: its key-value cache is such a tensor. Build it with "
                f"use_cache=False in its config (or call it with use_cache=False); a pipeline trains without a cache")
    return "Keep such state out of forward, or declare the stages another way"
