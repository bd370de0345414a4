"""Split points on the traced model: ``stages=rpcmp.SplitAt("layer2", "layer4")``.

[Note: split points on the traced model]
Most models are not a chain of their children: ``forward`` holds functional ops,
``flatten``, residual adds and skip connections. ``SplitAt`` cuts the model's *traced
graph* instead, with the front end of ``torch.distributed.pipelining``: ``pipeline()``
traces ``forward`` with ``torch.export`` on one micro-batch and cuts the graph before
each named submodule (or at ``pipe_split()`` markers in ``forward`` when no name is
given). Each stage is the graph between two cuts, so every operation of ``forward`` is
in exactly one stage; a value a later stage needs (a Unet's skip features, a residual
stream) is handed along; parameters and buffers keep the unsplit model's names, so
``state_dict()`` and every checkpoint load into the plain model with ``strict=True``.
rpcmp's own runtime runs the stages (not pipelining's schedules): the master traces the
model on the meta device to plan, and the plan carries each stage's graphs to its owner (see
[Note: an owner builds the graphs the master traced] in :mod:`rpcmp.plan.shipped`), which
gives its own stage, and only it, the unsplit model's values (see [Note: each owner
materializes only its part] in :mod:`rpcmp.plan.materialize`). Tracing needs a batch: the job's
data, or ``Pipeline(sample=...)``. What ``torch.export`` cannot trace (data-dependent control
flow) is refused with its message and the way out.

[Note: a traced stage in eval mode]
``torch.export`` records the graph of the mode the model is in: traced in train mode, a
BatchNorm layer normalises with batch statistics and updates its running ones, and
dropout drops, whatever ``.eval()`` says later, so held-out evaluation and ``rpcmp
predict`` would run the training graph: other outputs, and running statistics that
evaluation changes (figures: benchmarks/PERFORMANCE.md, design measurements). So the model is traced twice, in train and in eval
mode; each stage holds both graphs over the same parameters and buffers and runs the
one of its mode (:func:`attach_eval`). Both must cut the model alike
(:func:`check_same_cut`). Where the two are the same graphs (:func:`same_graphs`: a model
with no BatchNorm, no dropout but with p=0 and no other branch on ``self.training``), the
plan says so (``StageSpec.one_graph``): the model is traced once, in train mode, and each
stage runs that graph in both modes (half the tracing, where an owner traces).

[Note: any batch size]
A stage runs micro-batches, a smaller last micro-batch, whole batches (BatchNorm) and
evaluation batches, but ``pipeline()`` exports with the shapes of the one micro-batch it is
given, and a graph that reshapes by the batch size (``nn.MultiheadAttention`` does) then
holds that size as a constant. So rpcmp exports with dimension 0 of every input dynamic
(``torch.export.Dim``); the sizes the graph derives from it travel between stages as 0-dim
tensors (every value on the wire is a tensor) and become ints again in the stage that uses
them (:class:`_Route`). A model that does fix its batch size is traced with static shapes
and refused by :func:`check_any_batch_size` before any process starts. Export cannot make a
dimension of size 1 dynamic, so a one-sample micro-batch is traced as two.

[Note: the model's output, as the model returns it]
pipelining's split graph returns the model's outputs flattened: a Hugging Face model's
``CausalLMOutput`` arrived as its one tensor and a 1-tuple as its item, so ``Job.loss`` written
for the unsplit model (``out.logits``) failed on the split one. The export's output spec is kept
(``pipe.rpcmp_out_spec``) and the last stage rebuilds the model's own structure from it.

Dimension 1 (tokens, time) is traced as dynamic too: see [Note: any sequence length] in
:mod:`rpcmp.plan.lengths`.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..errors import PartitionError

__all__ = ["SplitAt", "stage_module", "stage_route", "stage_graph", "graph_copy", "attach_eval",
           "check_same_cut", "same_graphs", "run_stages", "stage_flow", "check_any_batch_size", "example_of", "from_example",
           "outputs_no_gradient"]


@dataclass(frozen=True)
class SplitAt:
    """Cut the traced model before each named submodule (qualified names: ``"encoder.layer3"``);
    with no names, at the ``torch.distributed.pipelining.pipe_split()`` calls in ``forward``.

    ``lengths="any"`` says that batches will differ in dimension 1 (tokens, time): the plan then
    refuses, naming the line of ``forward`` that fixes it, a model that cannot take that (see
    [Note: any sequence length]). Without it such a model is traced for the length it was given."""

    points: tuple[str, ...] = ()
    lengths: str | None = None

    def __init__(self, *points: str, lengths: str | None = None):
        bad = [p for p in points if not isinstance(p, str) or not p]
        if bad:
            raise PartitionError(f"SplitAt takes submodule names, e.g. SplitAt('layer2', 'layer4'), got {bad!r}")
        twice = sorted({p for p in points if points.count(p) > 1})
        if twice:
            raise PartitionError(f"SplitAt names {twice} more than once: each point cuts once, e.g. SplitAt('h.2', 'h.4')")
        if lengths not in (None, "any"):
            raise PartitionError(f"SplitAt(lengths=...) takes 'any' (batches differ in dimension 1) or None "
                                 f"(the traced length), got {lengths!r}")
        object.__setattr__(self, "points", tuple(points))
        object.__setattr__(self, "lengths", lengths)

    @property
    def count(self) -> int:
        """Stages the named cuts give (with ``pipe_split()`` markers instead: known once traced)."""
        return len(self.points) + 1


def example_of(batch: Any) -> tuple:
    """A picklable description (shapes and dtypes) of one micro-batch, to trace with on an owner."""
    pairs, spec = pytree.tree_flatten_with_path(batch)
    for path, leaf in pairs:
        if not isinstance(leaf, torch.Tensor):  # a trace would take the first batch's value as a constant
            raise PartitionError(
                f"SplitAt traces the model on a batch of tensors, but batch{pytree.keystr(path)} is a "
                f"{type(leaf).__name__} ({leaf!r:.40}): a value that is not a tensor (a sample's name or text, kept by "
                f"the dataset) would be traced as the first batch's constant. Leave it out of the model's input (a "
                f"collate_fn, or the dataset's columns), or make it a tensor")
    return [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for _, t in pairs], spec


def from_example(example: tuple, device: str = "cpu") -> Any:
    leaves, spec = example
    return pytree.tree_unflatten([torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
                                  for shape, dtype in leaves], spec)


class _Route:
    """Runs one traced stage inside rpcmp's stage-to-stage chain.

    [Note: skip values go straight to their consumer]
    The split graph may hand a value to a stage further on (a Unet encoder's features reach
    the decoder, two stages later). A value the next stage does not read goes from the stage
    that makes it straight to every later stage that reads it, as a separate message
    (``posts``, ``rpcmp.owner.stage.post``), which the consumer waits for (``mail_in``) before it runs
    that micro-batch; distributed autograd sends its gradient back the same way. A value the
    next stage reads travels on the chain (``chain_out``) and is passed on by the stages
    between, up to its last reader. That keeps each value's gradient terms summed in the
    order the unsplit model sums them: for the Unet cut inside its encoder, the deepest skip
    feature is read by the middle stage (layer3: two terms) and by the decoder (one more);
    sent straight to the decoder, its three terms were summed as (c + d) + b instead of
    (b + c) + d, float32-equal but not bit-equal, and three Adam steps made that 3e-5 in the
    loss. On one machine the route does not show in step time; what crosses the middle
    stage's links does, about eight times less with this rule (the encoder's two largest
    feature maps, which the middle stage does not read, go straight), which on a network
    is the difference (figures: benchmarks/PERFORMANCE.md, design measurements).

    A routed stage is called with ``x`` (the chain value), or ``(x, mail)`` when it reads
    mail, and returns its chain value, or ``(value, {stage: {name: tensor}})`` when it posts.
    """

    def __init__(self, forward, route: dict, first: bool, last: bool, sizes: set[str], out_spec=None):
        self.forward, self.first, self.last, self.sizes = forward, first, last, sizes
        self.out_spec = out_spec if last and out_spec is not None and out_spec.num_leaves == len(route["chain_out"]) else None
        self.module, self.eval_forward = None, None  # see [Note: a traced stage in eval mode]
        self.chain_in, self.mail_in, self.args = route["chain_in"], route["mail_in"], route["args"]
        self.produced, self.chain_out, self.posts = route["produced"], route["chain_out"], route["posts"]

    def __call__(self, x):
        mail = {}
        if self.mail_in:
            x, mail = x
        if self.first:  # the model's input: the graph's inputs are its leaves (a dict's, a tuple's), in order
            given = pytree.tree_leaves(x)
        else:  # what the stage before passed on: a tuple of values, or the one value
            given = x if len(self.chain_in) != 1 else (x,)
        values = {**dict(zip(self.chain_in, given)), **mail}
        forward = self.forward if self.module is None or self.module.training else self.eval_forward
        out = forward(*(int(values[a]) if a in self.sizes else values[a] for a in self.args))
        for name, index in self.produced.items():
            values[name] = out if index is None else out[index]
        out = tuple(_wire(values[n]) for n in self.chain_out)
        if self.out_spec is not None:
            return pytree.tree_unflatten(list(out), self.out_spec)
        out = out[0] if len(out) == 1 and (self.last or len(self.chain_out) == 1) else out
        if not self.posts:
            return out
        return out, {j: {n: _wire(values[n]) for n in names} for j, names in self.posts.items()}


def _wire(value):
    """Sizes the graph computed from the dynamic batch size travel as tensors, as every stage output."""
    return torch.tensor(value) if isinstance(value, int) else value


def run_stages(stages: list[nn.Module], x: Any) -> Any:
    """Run routed stages one after another in this process, mail included (checks and tests)."""
    for _, x in stage_flow(stages, x):
        pass
    return x


def stage_flow(stages: list[nn.Module], x: Any, call: Callable | None = None):
    """Yield (what stage i sent, the input of the next stage) as the stages run one after another in
    this process, values posted to later stages delivered; ``call(stage, input)`` runs one (default: the
    stage itself; a None output ends what is known)."""
    mail: dict[int, dict] = {}
    for i, stage in enumerate(stages):
        route = stage.__dict__.get("forward")  # a traced stage's route; a named stage has none
        if x is not None and getattr(route, "mail_in", ()):
            x = (x, mail.pop(i, {}))
        sent = x = None if x is None else call(stage, x) if call else stage(x)
        if sent is not None and getattr(route, "posts", False):
            x, posted = sent
            for j, values in posted.items():
                mail.setdefault(j, {}).update(values)
        yield sent, x


def _split_graph(pipe) -> tuple[list, dict[str, tuple], list[str]]:
    """The split graph read once: its stage calls, where every value comes from (name ->
    (stage, index in its output, None for the whole output, or ("input", k) for the model's
    k-th input, made available at stage 0)) and the names of the model's outputs."""
    graph = pipe.split_gm.graph
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    source = {n.name: (0, ("input", k)) for k, n in enumerate(inputs)}
    for n in graph.nodes:
        if n.op == "call_function" and n.args and n.args[0] in calls:
            source[n.name] = (calls.index(n.args[0]), n.args[1])
    for i, c in enumerate(calls):
        if any(u.op != "call_function" for u in c.users):  # the output used whole
            source[c.name] = (i, None)
    out_node = next(n for n in graph.nodes if n.op == "output")
    return calls, source, [a.name for a in pytree.tree_leaves(out_node.args) if hasattr(a, "name")]


def _routes(pipe) -> list[dict]:
    """What each stage receives, computes and sends, read from the split graph (see _Route)."""
    calls, source, final = _split_graph(pipe)
    last = len(calls) - 1
    readers: dict[str, set[int]] = {}
    for i, c in enumerate(calls):
        for a in c.args:
            readers.setdefault(a.name, set()).add(i)
    for name in final:
        readers.setdefault(name, set()).add(last)
    inputs = [n for n, (_, idx) in source.items() if isinstance(idx, tuple)]
    chained = {n for n, (stage, _) in source.items() if stage + 1 in readers.get(n, ())}
    routes = []
    for i, c in enumerate(calls):
        here = [n for n, (stage, _) in source.items() if stage == i]  # in graph order
        chain_in = inputs if i == 0 else routes[i - 1]["chain_out"]
        available = list(chain_in) + [n for n in here if n not in chain_in]
        routes.append({
            "chain_in": chain_in,
            "args": [a.name for a in c.args],
            "produced": {n: idx for n, (stage, idx) in source.items() if stage == i and not isinstance(idx, tuple)},
            "chain_out": final if i == last else [n for n in available if n in chained and max(readers[n]) > i],
            "posts": {j: names for j in range(i + 2, len(calls))
                      if (names := [n for n in here if n not in chained and j in readers.get(n, ())])},
        })
    for i, route in enumerate(routes):
        route["mail_in"] = [n for r in routes[:i] for n in r["posts"].get(i, [])]
    return routes


def _sizes(pipe) -> set[str]:
    """Values that are sizes (ints), read from each stage graph's inputs: the split graph keeps no values."""
    sizes = set()
    for c in (n for n in pipe.split_gm.graph.nodes if n.op == "call_module" and n.target.startswith("submod_")):
        holders = [n for n in getattr(pipe.split_gm, c.target).graph.nodes if n.op == "placeholder"]
        sizes |= {a.name for a, h in zip(c.args, holders) if isinstance(h.meta.get("val"), (int, torch.SymInt))}
    return sizes


def check_any_batch_size(pipe, example: Any) -> tuple[str, ...]:
    """Refuse a traced graph that holds the micro-batch size it was traced with (a reshape to a
    fixed size, as ``nn.MultiheadAttention`` does): the stages also run a whole batch (BatchNorm),
    a smaller last micro-batch and evaluation batches. Checked on fake tensors: no computation; a graph that reads
    values (a router's counts through ``.item()``, as JetMoE's experts, or the rows it picks through ``nonzero``)
    cannot run on them and is not checked. Returns
    the model's outputs whose samples meet (see [Note: samples that meet in the model] in rpcmp/plan/writes.py)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
    from ..core.microbatch import batch_size
    from .writes import batch_sized, one_more
    n = batch_size(example)
    with routed_stages(pipe) as stages, FakeTensorMode(allow_non_fake_inputs=True) as mode:
        try:
            out = run_stages(stages, pytree.tree_map(mode.from_tensor, example))
        except (DataDependentOutputException, DynamicOutputShapeException):  # it reads values: not known here
            return ()
        try:
            bigger = run_stages(stages, pytree.tree_map(mode.from_tensor, one_more(example)))
        except Exception as exc:  # noqa: BLE001 - any failure here is the same finding
            raise PartitionError(
                f"SplitAt: the traced graph fixes the batch size "
                f"it was traced with ({n} samples per micro-batch): run on {n + 1} it fails with {type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]}. rpcmp's stages also run whole batches, a smaller last micro-batch and "
                f"evaluation batches, so such a model cannot be cut on its traced graph yet: declare the stages as modules, "
                f"or as an nn.Sequential cut with rpcmp.Split" + (f". Traced for any batch size, it failed with "
                f"{pipe.rpcmp_why_fixed}" if getattr(pipe, "rpcmp_why_fixed", None) else "")) from None
    return batch_sized(out, bigger)


@contextlib.contextmanager
def routed_stages(pipe):
    """The traced ``pipe``'s stages, each callable with one argument (:func:`stage_module`), for a run in this
    process (a check on fake tensors); the routing is undone on exit, so ``pipe`` stays as traced for the builds."""
    try:
        yield [stage_module(pipe, i) for i in range(pipe.num_stages)]
    finally:
        for i in range(pipe.num_stages):
            pipe.get_stage_module(i).__dict__.pop("forward", None)


def stage_module(pipe, index: int, module: nn.Module | None = None, route: tuple | None = None) -> nn.Module:
    """Stage ``index`` of the traced ``pipe`` (or ``module``, a :func:`graph_copy` of it), callable with one
    argument as every rpcmp stage is (see :class:`_Route`); ``route``: its :func:`stage_route`, where the
    graphs came from the master (``pipe`` is then None)."""
    module = stage_graph(pipe, index) if module is None else module
    module.forward = _Route(module.forward, *(route or stage_route(pipe, index)))
    return module


def stage_route(pipe, index: int) -> tuple:
    """What stage ``index`` of ``pipe`` needs of the whole split graph to run (see :class:`_Route`): small and
    picklable, for an owner that builds the graphs the master traced (rpcmp.plan.shipped)."""
    return (_routes(pipe)[index], index == 0, index == pipe.num_stages - 1, _sizes(pipe),
            getattr(pipe, "rpcmp_out_spec", None))


def stage_graph(pipe, index: int) -> nn.Module:
    """Stage ``index``'s graph module in ``pipe`` itself (:func:`graph_copy` for one a build may change)."""
    module = pipe.get_stage_module(index)
    if isinstance(module.graph._codegen, torch.fx.graph._PyTreeCodeGen):
        # The first stage's graph unpacks the model's whole input and fails when a leaf (a dict's entry)
        # is used by a later stage only: it takes the leaves it uses, as the split graph passes them.
        module.graph._codegen = torch.fx.graph.CodeGen()
        module.recompile()
    return module


def graph_copy(pipe, index: int) -> nn.Module:
    """A copy of stage ``index``'s graph module that a build may change (devices, tensors, its route)
    while ``pipe`` stays as traced for the next build (node metadata is shared, not copied)."""
    return copy.deepcopy(stage_graph(pipe, index))


def attach_eval(stage: nn.Module, eval_pipe, index: int, module: nn.Module | None = None) -> nn.Module:
    """Give traced ``stage`` the graph of the model traced in eval mode (or ``module``, a copy of it), run
    when ``stage.eval()``; returns that graph's module, whose tensors the caller makes the stage's own
    (see [Note: a traced stage in eval mode])."""
    evaluated = stage_graph(eval_pipe, index) if module is None else module
    stage.forward.module, stage.forward.eval_forward = stage, evaluated.forward
    return evaluated


def check_same_cut(train_pipe, eval_pipe) -> None:
    """Refuse a model whose graphs in train and eval mode are cut differently (the stages would hand
    each other other values in evaluation than in training)."""
    if _signature(train_pipe) != _signature(eval_pipe):
        raise PartitionError("SplitAt: the model traced in eval mode passes other values between the cuts than in "
                             "train mode (its forward branches on self.training across a cut): move the cut, or "
                             "declare the stages as modules")


def same_graphs(train_pipe, eval_pipe) -> bool:
    """Whether the model traced in train and in eval mode gave the same graphs, op for op and argument for
    argument, in every module of every stage (no BatchNorm, no dropout but with p=0, whose train flag changes
    nothing, no other branch on ``self.training``: a Llama, a nanoGPT, a GPT-2 configured without dropout): the
    eval graph would compute what the train graph does."""
    def graphs(pipe):
        return {name: [_node_text(n) for n in m.graph.nodes] for name, m in pipe.split_gm.named_modules()
                if isinstance(getattr(m, "graph", None), torch.fx.Graph)}
    return graphs(train_pipe) == graphs(eval_pipe)


def _node_text(node) -> str:
    args = node.args
    if node.target is torch.ops.aten.dropout.default and len(args) == 3 and args[1] == 0:
        args = args[:2]  # dropout(x, 0, train) is x either way
    return f"{node.name} = {node.op}[{node.target}]({args}, {node.kwargs})"


def _signature(pipe) -> tuple:
    """Where every stage's inputs and the model's outputs come from, by position, not by name."""
    calls, source, final = _split_graph(pipe)
    return (tuple(tuple(source.get(a.name, ("?",)) for a in c.args) for c in calls),
            tuple(source.get(name, ("?",)) for name in final))


def outputs_no_gradient(stage: nn.Module) -> bool:
    """Whether traced stage ``stage`` outputs no floating tensor (``argmax`` codes, a mask): nothing of its output
    can carry a gradient back, so the stage before sends its output detached from the first step (see [Note: an
    input the backward never reaches] in rpcmp/owner/reach.py). False where the graph does not say."""
    out = next((n for n in stage.graph.nodes if n.op == "output"), None)
    if out is None:
        return False
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in pytree.tree_leaves(out.args[0])]
    if any(v is None for v in vals):  # an output the trace kept no value of
        return False
    return not any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in vals)
