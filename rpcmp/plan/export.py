"""Tracing a model into ``torch.distributed.pipelining``'s ``Pipe`` for a :class:`rpcmp.plan.traced.SplitAt`:
the export with a dynamic batch (see [Note: any batch size] in :mod:`rpcmp.plan.traced`), the model's output
spec kept (see [Note: the model's output, as the model returns it] there), and the checks that only the
export can answer: the batch is the model's one argument, each point is called once and named in order. A
module forward calls more than once is one module in each stage (:mod:`rpcmp.plan.repeats`)."""
from __future__ import annotations

import contextlib
import difflib
import inspect
import operator
import re
import threading
import warnings
from collections import OrderedDict
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..errors import PartitionError
from .graphs import each_once, graphs, meta_of, place_graph, unshadow
from .marks import Unplaced, exported, keep_only, marks_for, unmark
from .materialize import meta_model
from .repeats import outlined_once
from .points import check_reached, check_stages
from .strange import cached_modules
from .traced import SplitAt, from_example

__all__ = ["trace_split", "traces"]

_TRACES: OrderedDict = OrderedDict()  # the last few traces of this process (see traces)
_TRACING = threading.Lock()  # two stages of one process are built at once, by two RPC threads


def trace_split(model: nn.Module, split: SplitAt, sample: Any, key: tuple | None = None):
    """``torch.distributed.pipelining``'s ``Pipe`` of ``model`` cut at ``split``, traced on ``sample``
    with a dynamic batch size where the model allows it (see [Note: any batch size]). ``key``: the export is
    kept under it for other cuts of the same model (see [Note: one export for every cut among siblings] in
    :mod:`rpcmp.plan.marks`): (model factory, seed, sample's description, training mode)."""
    names = {n for n, _ in model.named_modules() if n}
    missing = [p for p in split.points if p not in names]
    if missing:
        raise PartitionError(f"SplitAt: {type(model).__name__} has no submodule {missing}: {_nearest(model, missing[0])}")
    _check_one_argument(model, sample)
    # export cannot make a dimension of size 1 dynamic: trace a one-sample micro-batch as two
    sample = pytree.tree_map(lambda t: torch.cat([t, t]) if isinstance(t, torch.Tensor) and t.dim() and len(t) == 1
                             else t, sample)
    try:
        with _as_cpu(model, sample) as fake_sample:  # see [Note: traced as if on the CPU]
            try:
                pipe, reached = _pipeline(model, split, marks_for(model, split.points), fake_sample, key)
            except Unplaced:  # see [Note: one export for every cut among siblings]
                unmark(model, marks_for(model, split.points))
                pipe, reached = _pipeline(model, split, tuple(split.points), fake_sample, key)
    except PartitionError:  # a cause found and said
        raise
    except Exception as exc:  # noqa: BLE001 - any tracing failure means the same to the user
        exc = exc.__cause__ or exc  # pipelining wraps export's error in a general one
        raise PartitionError(
            f"SplitAt{split.points}: tracing {type(model).__name__}.forward with torch.export failed: "
            f"{type(exc).__name__}: {_what_to_do(model, str(exc).strip())}") from None
    check_reached(model, split, reached)
    check_stages(type(model).__name__, split, pipe)
    for i in range(pipe.num_stages):
        unshadow(pipe.get_stage_module(i))  # see [Note: a node named self] in rpcmp/plan/graphs.py
    _back_to_meta(pipe)
    return pipe



_TABLES = {"_parameters", "_buffers", "_modules"}  # a module's own tables, gone through one by one


@contextlib.contextmanager
def _as_cpu(model: nn.Module, sample: Any):
    """[Note: traced as if on the CPU]
    The model is built on the meta device (no memory; see [Note: each owner materializes only its part]
    in rpcmp/plan/materialize.py), but a ``forward`` may choose its path by the device type of its
    tensors (``x.device.type == "cpu"``), and traced on meta it records the path for ``meta``: the
    grouped experts of Hugging Face's MoE models then call ``histc`` on integers, which has no CPU
    kernel, and the stage failed on its first micro-batch. So the trace sees fake tensors of the CPU
    (``FakeTensorMode``: shapes, dtypes and a device, no memory) in place of the meta ones, model and
    sample; the model gets its meta tensors back after the trace, and :func:`_back_to_meta` turns what the
    trace kept back into meta tensors and the CPU its graphs name into ``meta``, so that everything after
    the trace sees a graph traced on meta, as before (an owner's device replaces ``meta``: see [Note: a
    traced graph names the device it was traced on] in rpcmp/plan/graphs.py). A stage on a GPU runs the
    CPU's path of such a ``forward`` (the one for ``meta`` before). A constant ``forward`` makes from
    Python values (``x[..., [-1]]`` indexes with one, BEiT's relative position index is filled with them)
    is a real tensor of the CPU, not a fake one: it stays real, its value known (a few numbers; it travels
    with the stage's graphs, and the owner puts it on its device: :func:`rpcmp.plan.tracedbuild.build_traced`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)

    def on_cpu(t):
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    fake_of = each_once(on_cpu)

    def fake(t):
        return fake_of(t) if isinstance(t, torch.Tensor) and t.is_meta else t
    swapped = []  # (the table, the key, what it held)
    for table, key, value in _entries(model.modules()):
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves(value)):  # or a list, a dict
            swapped.append((table, key, value))
            table[key] = pytree.tree_map(fake, value)
    try:
        yield pytree.tree_map(fake, sample)
    finally:
        for table, key, t in swapped:
            table[key] = t


def _back_to_meta(pipe) -> None:
    """What the trace kept of the fake tensors, as meta tensors, and ``meta`` where its graphs name the CPU
    (see [Note: traced as if on the CPU])."""
    from torch._subclasses.fake_tensor import FakeTensor
    meta = each_once(meta_of)
    for table, key, t in _entries(_reachable(pipe.split_gm)):
        if _unknown(key, t):
            table[key] = meta(t)

    # A node's fake value is made to say ``meta`` in place: shape (symbolic sizes kept), strides and dtype as traced.
    # These values belong to this trace alone (its fake mode ends with it), and a new tensor for each (empty_strided
    # in its fake mode) cost 10-15 % of a trace: each computed its symbolic strides and contiguity again.
    for i in range(pipe.num_stages):
        stage = pipe.get_stage_module(i)
        place_graph(stage, torch.device("meta"), of="cpu")
        for _, _, graph in graphs(stage):
            for node in graph.nodes:
                for key in ("val", "example_value"):
                    for v in pytree.tree_leaves(node.meta.get(key)):
                        if isinstance(v, FakeTensor) and v.fake_device.type == "cpu":
                            v.fake_device = torch.device("meta")


def _unknown(key: str, t: Any) -> bool:
    """Whether tensor ``t``, kept by a trace under ``key``, goes back to the meta device: a fake tensor, or a real
    one of the model's (built on the CPU in spite of the meta device: an owner gives it its value by name). Not a
    constant the trace made from Python values (``lifted_tensor_N``): its value is known, and kept (see [Note:
    traced as if on the CPU])."""
    from torch._subclasses.fake_tensor import FakeTensor
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return False
    return isinstance(t, FakeTensor) or not key.rpartition(".")[2].startswith(("lifted_tensor", "_tensor_constant"))


def _nearest(model: nn.Module, point: str) -> str:
    """Where the name ``point`` leaves ``model``'s modules, and the names close to it."""
    names, parts, at = [n for n, _ in model.named_modules() if n], point.split("."), ""
    while parts and (f"{at}.{parts[0]}" if at else parts[0]) in names:
        at = f"{at}.{parts.pop(0)}" if at else parts.pop(0)
    children = [n for n, _ in model.get_submodule(at).named_children()]
    close = difflib.get_close_matches(point, names, n=3, cutoff=0.6)
    where = f"{at} has no child {parts[0]!r}; its children" if at else "its children"
    return f"{where}, in order: {children}" + (f"; close to {point!r}: {close}" if close else "")


def _what_to_do(model: nn.Module, error: str) -> str:
    """The gist of the trace's ``error`` and what the user can change for it."""
    found = re.search(r"Found <class '([\w.]+)'> in output", error)
    if found and "Cache" in found.group(1):
        cached = cached_modules(model)
        where = (f"self.{cached[0]}" if cached[0] else "the model") if cached else "the model"
        return (f"{found.group(0)}. {where} returns its key-value cache ({found.group(1).rsplit('.', 1)[-1]}: "
                f"use_cache=True in its config), for generation: training does not read it and a pipeline cannot pass "
                f"it between stages. Build it with use_cache=False in its config (e.g. GPT2Config(..., "
                f"use_cache=False)) or call it with use_cache=False")
    if found:
        return (f"{found.group(0)}. The model's output holds a {found.group(1)}, which rpcmp cannot take apart to "
                f"pass between stages: return tensors or tuples, lists and dicts of them, or register the class with "
                f"torch.utils._pytree.register_pytree_node")
    if re.search(r"attribute '?submod_\d+", error):  # a higher-order op's submodule, lost: see _inline_no_grad
        return (f"{error.splitlines()[0]}. forward changes a global mode in a block (`with torch.autocast(...)`, "
                f"`with torch.enable_grad()`), which export makes a submodule of its own and "
                f"torch.distributed.pipelining's split then loses (pytorch#164030; a `torch.no_grad()` block is kept): "
                f"enter the block only where the mode changes (`torch.is_autocast_enabled()`), or declare the stages "
                f"by name or as modules")
    return (f"{error.splitlines()[0][:300] if error else ''}. Data-dependent control flow (an `if` on a tensor's "
            f"values) cannot be traced: use torch.cond, move it into one stage's module and declare the stages as "
            f"modules, or cut an nn.Sequential with rpcmp.Split")


def _check_one_argument(model: nn.Module, sample: Any) -> None:
    """Refuse a dict batch whose keys are the model's own arguments (a Hugging Face model's ``input_ids``,
    ``attention_mask``): rpcmp calls a model with the batch as one argument, so the dict would arrive as the
    first of them and fail deep in the trace."""
    if not isinstance(sample, dict):
        return
    params = inspect.signature(model.forward).parameters
    first = next((n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())  # forward(self, input_ids, ..., **kwargs)
    if first in sample and (takes_any or set(sample) <= set(params)):
        raise PartitionError(
            f"the batch is a dict of {type(model).__name__}.forward's own arguments {sorted(sample)}, but rpcmp calls "
            f"a model with the batch as one argument (model(batch)), so the dict would arrive as {first!r}. Wrap the "
            f"model: a module whose forward(self, batch) returns self.m(**batch)")


def _pipeline(model: nn.Module, split: SplitAt, marks: tuple[str, ...], sample: Any, key: tuple | None):
    """pipelining's ``Pipe`` of ``model`` exported with markers at ``marks`` and cut at ``split``'s points; the
    modules whose markers it was cut at, in order."""
    why = None
    try:
        pipe, reached, out_spec = _split(model, split, marks, sample, key, dynamic=True)
    except Unplaced:
        raise
    except Exception as exc:  # noqa: BLE001 - a model that fixes its batch size: traced for the size it has
        exc = exc.__cause__ or exc
        why = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
        if _reentrant(model):  # traced for its size it fails on another batch, or to trace at all (a bare model)
            raise PartitionError(
                f"SplitAt{split.points}: {type(model).__name__} checkpoints its layers with use_reentrant=True (Hugging "
                f"Face's gradient_checkpointing_enable), which torch.export cannot trace for any batch size ({why}). "
                f"Enable it with gradient_checkpointing_kwargs={{'use_reentrant': False}}, or leave it off and set "
                f"Job(recompute=True), which recomputes each stage's forward in its backward") from None
        unmark(model, marks)
        pipe, reached, out_spec = _split(model, split, marks, sample, key, dynamic=False)
    pipe.rpcmp_out_spec = out_spec  # see [Note: the model's output, as the model returns it]
    pipe.rpcmp_why_fixed = why  # said where a fixed batch size is refused (rpcmp.plan.traced.check_any_batch_size)
    return pipe, reached


def _split(model: nn.Module, split: SplitAt, marks: tuple[str, ...], sample: Any, key: tuple | None, dynamic: bool):
    """What ``torch.distributed.pipelining.pipeline`` does (mark, export, split), with the export kept and the
    markers the cut does not cut at dropped (:mod:`rpcmp.plan.marks`)."""
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining._IR import Pipe, annotate_split_points
    whole, reached, out_specs = marks != tuple(split.points), [], []
    with _exporting(Pipe, dynamic, key, marks, whole, out_specs):
        if marks:
            annotate_split_points(model, {m: SplitPoint.BEGINNING for m in marks})
        pipe = Pipe.from_tracing(model, (sample,), split_policy=keep_only(split.points, reached, whole))
    return pipe, reached, out_specs[-1]


def _reentrant(model: nn.Module) -> bool:
    """Whether the model checkpoints its layers with ``use_reentrant=True`` (Hugging Face's
    ``gradient_checkpointing_enable``), which export cannot trace for any batch size (it detaches the batch size)."""
    return any(getattr(getattr(m, "_gradient_checkpointing_func", None), "keywords", {}).get("use_reentrant")
               for m in model.modules() if getattr(m, "gradient_checkpointing", False))


def _entries(modules):
    """(table, key, value) of each parameter, buffer and other attribute of ``modules``."""
    for module in modules:
        for table in (module._parameters, module._buffers, vars(module)):
            for key, value in list(table.items()):
                if key not in _TABLES:
                    yield table, key, value


def _reachable(top: nn.Module) -> list[nn.Module]:
    """``top``'s modules and those its graphs name as the module they were first made for, and theirs."""
    found, todo = {}, [top]
    while todo:
        for module in todo.pop().modules():
            if id(module) not in found:
                found[id(module)] = module
                graph = getattr(module, "graph", None)
                if isinstance(graph, torch.fx.Graph) and graph.owning_module is not None:
                    todo.append(graph.owning_module)
    return list(found.values())


@contextlib.contextmanager
def _exporting(pipe_cls, dynamic: bool, key: tuple | None, marks: tuple[str, ...], whole: bool, out_specs: list):
    """pipelining's ``pipeline()`` exports with static shapes; export with dimension 0 of every
    input dynamic instead (see [Note: any batch size]), keep the export (:func:`rpcmp.plan.marks.exported`) and
    the structure of the model's output, which pipelining's split graph flattens (appended to ``out_specs``);
    outline a module forward calls more than once as one module in each stage."""
    plain = pipe_cls.__dict__["_trace_with_export"]

    def trace(mod, example_args, example_kwargs=None):
        def export():
            batch = torch.export.Dim("batch")
            shapes = pytree.tree_map(lambda t: _dims(t, batch) if isinstance(t, torch.Tensor) and t.dim() else None,
                                     example_args) if dynamic else None
            ep = torch.export.export(mod, example_args, example_kwargs, dynamic_shapes=shapes)
            _inline_no_grad(ep.graph_module)
            meta = each_once(meta_of)
            for table in (ep.state_dict, ep.constants):  # kept: its fake tensors as meta ones, as after every trace
                table.update({k: meta(t) for k, t in table.items() if _unknown(k, t)})
            return ep
        ep, out_spec = exported(key, marks, dynamic, export, whole)
        out_specs.append(out_spec)
        return ep
    pipe_cls._trace_with_export = staticmethod(trace)
    try:
        # outlined_once: see [Note: a module forward calls more than once]
        with warnings.catch_warnings(), outlined_once():  # pipelining deep-copies a tied parameter: here a fake one
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield
    finally:
        pipe_cls._trace_with_export = plain


def _inline_no_grad(gm: torch.fx.GraphModule) -> None:
    """[Note: a no_grad block in a traced forward]
    export turns a ``with torch.no_grad():`` block of ``forward`` (an EMA update, an MoE router's counts) into a
    higher-order op that calls a submodule of its own, and pipelining's split loses that submodule
    (``'InterpreterModule' object has no attribute 'submod_1'``, pytorch#164030): the model could not be cut.
    Each such block is put back in line, its inputs detached: what it computes needs no gradient either way,
    and what it writes in place (a buffer) is written through the detached view, as before. One exception: an
    op that returns its input itself (``x.flatten(0, -2)`` of a matrix, ``x.float()`` of a float, ``contiguous``)
    gives back the very tensor, gradient and all, and export then takes the block's output for ``x`` from there
    on; such an output is the block's own input again (:func:`_as_eager`), or everything before the block lost
    its gradient (and the run hung waiting for it). A block that holds a higher-order op or a submodule of its own
    is left as it is."""
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is hop and node.args[0] is False):
            continue
        sub = getattr(gm, node.args[1].target)
        body = [n for n in sub.graph.nodes if n.op not in ("placeholder", "output")]
        if any(n.op != "call_function" or isinstance(n.target, torch._ops.HigherOrderOperator) for n in body) or any(
                u.target is not operator.getitem for u in node.users):
            continue
        keep = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")}
        env = {}
        with gm.graph.inserting_before(node):
            placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            for ph, arg in zip(placeholders, node.args[2:]):
                env[ph] = arg
                if isinstance(arg, torch.fx.Node):
                    env[ph] = gm.graph.call_function(torch.ops.aten.detach.default, (arg,))
                    env[ph].meta.update(keep, **({"val": arg.meta["val"].detach()} if "val" in arg.meta else {}))
            for n in body:
                env[n] = gm.graph.node_copy(n, lambda a: env[a])
            inputs = [(ph, arg, env[ph]) for ph, arg in zip(placeholders, node.args[2:])]
            out = [_own_input(gm.graph, env[o], inputs) if isinstance(o, torch.fx.Node) else o
                   for o in sub.graph.output_node().args[0]]
        for user in list(node.users):
            user.replace_all_uses_with(out[user.args[1]], propagate_meta=False)
            gm.graph.erase_node(user)
        submodule = node.args[1]
        gm.graph.erase_node(node)
        if not submodule.users:
            gm.graph.erase_node(submodule)
            delattr(gm, submodule.target)
    gm.recompile()


def _own_input(graph: torch.fx.Graph, out: torch.fx.Node, inputs) -> torch.fx.Node:
    """``out`` of an inlined no_grad block, or, where it may be one of the block's detached inputs itself (it
    shares that input's storage: ``inputs`` are the block's placeholders, their arguments and those detached),
    a node that gives the undetached input in that case at run time."""
    storage = _storage(out)
    for placeholder, arg, detached in inputs:
        if storage is not None and detached is not arg and _storage(placeholder) == storage:
            node = graph.call_function(_as_eager, (out, detached, arg))
            node.meta.update(out.meta)
            out = node
    return out


def _storage(node: torch.fx.Node):
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(val.untyped_storage())


def _as_eager(out: torch.Tensor, detached: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """What eager's no_grad block gives: its input itself where the block's op returned it (see _inline_no_grad)."""
    return original if out is detached else out


def _dims(t: torch.Tensor, batch) -> dict:
    """Dimension 0 is the batch; dimension 1 (tokens, time) is dynamic where the model allows it
    (``Dim.AUTO``: export keeps it static where the model fixes it, see [Note: any sequence length])."""
    return {0: batch, 1: torch.export.Dim.AUTO} if t.dim() >= 2 and t.shape[1] > 1 else {0: batch}


def traces(job, example: tuple, eval_too: bool = True) -> list:
    """``job.model()`` traced on the meta device in train and eval mode, cut at ``job.stages``, on one
    micro-batch like ``example`` (:func:`rpcmp.plan.traced.example_of`); without ``eval_too`` (the plan found both modes' graphs
    the same: ``StageSpec.one_graph``), the train mode's twice. Each once per process for a model factory, seed,
    split, micro-batch shape and mode, the last 16 kept. The master's plan and the stage it holds share one
    trace, an owner's builds for every Pipeline of a run share one, and so does a second plan of the same job in
    one process (a sweep over other settings, a notebook): tracing is seconds, most of a build. A job whose
    factory was replaced in place is traced again."""
    train = _trace(job, example, True)
    return [train, _trace(job, example, False) if eval_too else train]


def _trace(job, example: tuple, train: bool):
    key = (id(job.model), job.seed, repr(job.stages), repr(example), train)
    with _TRACING:  # one at a time: a trace swaps pipelining's functions for its own while it runs
        entry = _TRACES.get(key)
        if entry is None or entry[0] is not job.model:  # held here: another thread's build may drop it from the cache
            model = meta_model(job)
            entry = _TRACES[key] = (job.model, trace_split(model if train else model.eval(), job.stages,
                                                           from_example(example, "meta"), (job.model, *key[1:2], *key[3:])))
            while len(_TRACES) > 16:
                _TRACES.popitem(last=False)
    return entry[1]
