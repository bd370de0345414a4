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
    """Refuse, saying why, a split whose stages hold tensors the model has no name for and no value: a tensor
    the model keeps in a list or dict attribute (made on the meta device with the model), or state ``forward``
    keeps between calls (a key-value cache). A tensor ``forward`` makes from Python values is known, and kept."""
    strange = sorted(set().union(*held) - set(tensor_table(model)))
    if not cached_modules(model):  # a constant made from Python values, its value known (see [Note: traced as if
        # on the CPU] in rpcmp/plan/export.py), is no stranger; a key-value cache's is: the setting to change says so
        strange = [n for n in strange if any(n in h and attribute(pipe.get_stage_module(i), n).is_meta
                                            for i, h in enumerate(held))]
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
            f"SplitAt: {where or type(model).__name__}'s forward reads a tensor the model keeps outside its parameters "
            f"and buffers, in a list or dict attribute ({name}, read by {', '.join(readers) or 'the graph'}). The "
            f"model is built on the meta device to be cut, so its value is unknown there, and no owner could give it "
            f"the unsplit model's. Register it as a buffer (self.register_buffer(name, tensor, persistent=False)), "
            f"or declare the stages by modules (rpcmp.Split over an nn.Sequential)")
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
