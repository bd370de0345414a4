"""Proof that a chain of named children is the model's ``forward``.

[Note: a chain of children is the model only if forward is that chain]
``stages=["fc1", "fc2"]`` runs ``fc2(fc1(x))``. If ``Model.forward`` is
``fc2(F.relu(fc1(x)))``, or flattens before ``fc`` (torchvision's ResNet), or adds a
residual, the chain trains another model than the job builds, silently or with a shape
error deep inside a stage. So before any stage is built, the master traces the model's
``forward`` on one sample with ``torch.export`` (non-strict: Python control flow such as
input-shape checks runs as Python) and reads the graph: every operation must belong to
one of the declared children (``nn_module_stack``), the children must run once each, in
the declared order, each fed only by the one before it (the first by the model's input),
and the model must return the last child's output. Anything else is refused with what
``forward`` does that the chain does not.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export.graph_signature import ConstantArgument

from ..errors import PartitionError

__all__ = ["check_chain"]

_NEUTRAL = {operator.getitem}  # picking an element of a child's output is no computation


def check_chain(model: nn.Module, chain: list[str], sample: Any) -> None:
    """Raise :class:`PartitionError` unless ``model.forward(sample)`` is exactly the children
    ``chain`` applied one after another."""
    cls = type(model).__name__
    was_training = model.training
    model.eval()  # the graph's structure; BatchNorm and dropout in eval mode need no batch statistics
    try:
        program = _export(model, sample, chain)
    except Exception as exc:  # noqa: BLE001 - any tracing failure means the same to the user
        raise PartitionError(
            f"cannot check that {cls}.forward is the chain {chain}: tracing it with torch.export failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Declare the stages as modules "
            f"(stages=[module_or_factory, ...]) or as an nn.Sequential cut with rpcmp.Split"
        ) from None
    finally:
        model.train(was_training)
    graph = program.graph
    specs = program.graph_signature.input_specs
    user_inputs = {s.arg.name for s in specs if s.kind.name == "USER_INPUT"}
    state = {s.arg.name for s in specs if s.kind.name != "USER_INPUT"}  # parameters, buffers, constants
    owner = {n: _owner(n, chain) for n in graph.nodes}
    by_name = {n.name: n for n in graph.nodes}
    order = [n for n in graph.nodes if n.op == "call_function"]
    for node in order:
        if owner[node] is None and node.target not in _NEUTRAL:
            raise PartitionError(f"{cls}.forward applies {_describe(node)} {_where(node, order, owner, chain)}; "
                                 f"a chain of children leaves it out. {_FIX}")
    ran = [owner[n] for n in order if owner[n] is not None]
    runs = [c for i, c in enumerate(ran) if i == 0 or ran[i - 1] != c]
    if runs != chain:
        raise PartitionError(f"{cls}.forward runs its children in the order {runs}, not as the chain {chain} "
                             f"(each once, one after another). {_FIX}")
    for node in order:
        child = owner[node]
        if child is None:
            continue
        k = chain.index(child)
        for src in _sources(node, owner) - state:
            src_owner = owner.get(by_name[src])
            ok = src_owner == child or (src in user_inputs if k == 0 else src_owner == chain[k - 1])
            if not ok:
                what = "the model's input" if src in user_inputs else f"the output of {src_owner!r}"
                raise PartitionError(f"{cls}.forward passes {what} to {child!r} (a residual or skip connection); a "
                                     f"chain hands each child only the output of the one before it. {_FIX}")
    out = next(n for n in graph.nodes if n.op == "output")
    returned = {owner.get(by_name[s]) for s in _sources(out, owner) - state}
    if returned != {chain[-1]}:
        raise PartitionError(f"{cls}.forward returns {sorted(map(str, returned))}, not only the output of "
                             f"{chain[-1]!r}. {_FIX}")
    _whole_outputs(model, program, chain, cls)


def _export(model: nn.Module, sample: Any, chain: list[str]):
    """The model's program, with each child's call signature where export can keep them (see _whole_outputs)."""
    try:
        return torch.export.export(model, (sample,), strict=False, preserve_module_call_signature=tuple(chain))
    except Exception:  # noqa: BLE001 - a child whose call export cannot keep: the graph alone is checked
        return torch.export.export(model, (sample,), strict=False)


def _whole_outputs(model: nn.Module, program, chain: list[str], cls: str) -> None:
    """Refuse a ``forward`` that hands a child a part of the one before's output (``self.head(self.rnn(x)[0])``,
    ``.last_hidden_state``) or more than it (another argument than its default), or takes a part of the model's
    input or of the last child's output: picking an element is no operation in the graph, but the chain hands each
    child the whole output of the one before, and the model's input to the first."""
    calls = {e.fqn: e.signature for e in program.module_call_graph if e.signature is not None}
    root = calls.get("")
    inputs = root.in_spec.children()[0] if root else None  # the model is called with the sample alone
    pairs = [("the model's input", inputs.children()[0] if inputs is not None and inputs.num_children == 1 else None, chain[0])]
    pairs += [(f"the output of {a!r}", calls[a].out_spec if a in calls else None, b) for a, b in zip(chain, chain[1:])]
    for what, given, child in pairs:
        if given is None or child not in calls:
            continue
        handed = _handed(calls[child], model.get_submodule(child))
        if handed is not None and len(handed) != 1 or pytree.tree_structure(handed[0][1]) != given:
            got = _spec(pytree.tree_structure(handed[0][1])) if len(handed) == 1 else \
                f"{len(handed)} arguments ({', '.join(n for n, _ in handed)})"
            raise PartitionError(f"{cls}.forward calls {child!r} with {got}, not with {what} whole ({_spec(given)}): a "
                                 f"part of it (`out[0]`, `out.last_hidden_state`) or more; a chain of children hands "
                                 f"each child the whole output of the one before. {_FIX}")
    if root is not None and chain[-1] in calls and root.out_spec != calls[chain[-1]].out_spec:
        raise PartitionError(f"{cls}.forward returns {_spec(root.out_spec)}, not the output of {chain[-1]!r} whole "
                             f"({_spec(calls[chain[-1]].out_spec)}). {_FIX}")


def _handed(signature, module: nn.Module) -> list[tuple[str, Any]] | None:
    """The arguments a call of ``module`` was handed (by position or keyword; export's argument records as leaves)
    but those equal to their parameter's default (``mask=None``), which the chain's call hands it as well; None
    where export kept no record of them."""
    if len(signature.inputs) != signature.in_spec.num_leaves:
        return None
    args, kwargs = pytree.tree_unflatten(signature.inputs, signature.in_spec)
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params] + [f"argument {k}" for k in range(len(params), len(args))]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return [(n, v) for n, v in [*zip(names, args), *kwargs.items()] if not _default(v, defaults, n)]


def _default(value: Any, defaults: dict, name: str) -> bool:
    if not isinstance(value, ConstantArgument) or name not in defaults:
        return False
    try:
        return value.value is defaults[name] or bool(value.value == defaults[name])
    except Exception:  # noqa: BLE001 - values that do not compare
        return False


def _spec(spec) -> str:
    return "a tensor" if spec.is_leaf() else f"{getattr(spec.type, '__name__', spec.type)} of {spec.num_children}"


_FIX = ("Cut the traced model instead, which keeps every operation of forward: stages=rpcmp.SplitAt(<name of the "
        "first submodule of each stage after the first>, ...); or wrap that computation into a module of the chain")


def _owner(node, chain: list[str]) -> str | None:
    """The declared child a node's operation belongs to, or None for ``forward`` itself."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        top = path.split(".")[0] if path else ""
        if top.startswith("L['self']."):  # strict-mode spelling
            top = top[len("L['self']."):]
        if top in chain:
            return top
    return None


def _sources(node, owner) -> set[str]:
    """Names of the nodes ``node`` reads from, seen through neutral ``getitem``s."""
    found = set()
    for arg in node.all_input_nodes:
        if arg.op == "call_function" and arg.target in _NEUTRAL and owner[arg] is None:
            found |= _sources(arg, owner)
        elif arg.op in ("placeholder", "call_function"):
            found.add(arg.name)
    return found


def _describe(node) -> str:
    """``torch.flatten (from `return self._forward_impl(x)`, resnet.py line 285)``."""
    import re
    op = str(node.target).removeprefix("aten.").split(".")[0]
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    where = re.search(r'File "(.*)", line (\d+)', trace[-2]) if len(trace) >= 2 else None
    if not where:
        return f"torch.{op}"
    return f"torch.{op} (from `{trace[-1].strip()}`, {where.group(1).rsplit('/', 1)[-1]} line {where.group(2)})"


def _where(node, order: list, owner: dict, chain: list[str]) -> str:
    i = order.index(node)
    before = next((owner[n] for n in reversed(order[:i]) if owner[n] is not None), None)
    after = next((owner[n] for n in order[i + 1:] if owner[n] is not None), None)
    if before and after:
        return f"between {before} and {after}"
    return f"after {before}" if before else (f"before {after}" if after else "outside every child")
