"""Stage declaration: how a model is cut into stages.

Three forms are accepted as ``Job(stages=...)``:

* names of submodules in forward order: ``["encoder", "decoder", "segmentation_head"]``
  (an item may itself be a list of names, run one after the other in one stage);
* an explicit list of modules or zero-argument module factories;
* :class:`Split` for an ``nn.Sequential``: a balance (``Split([3, 5, 2])``) or an
  automatic one (``Split(parts=3, by="params")`` / ``by="time"``).

The master turns the declaration into small picklable :class:`StageSpec` records
(:func:`plan_stages`); each owner builds only its own stage from its own import of the
job (:func:`build_stage`; a traced one from the graphs the master traced, structure only): no values travel.

A stage is called with one argument, the previous stage's output.
"""
from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from .balance import balance_by_params, balance_by_time
from .chain import check_chain
from .materialize import COMPILED, build_part, build_whole, meta_model, tensor_table
from .placement import place_unused, shared_params
from .strange import refuse_strange
from .export import traces
from .traced import SplitAt, check_any_batch_size, check_same_cut, example_of, from_example, outputs_no_gradient, same_graphs
from .shipped import ship_stage
from .tracedbuild import as_cut, build_traced
from .lengths import input_sizes, require_any_length
from .unreached import unreached_values
from .writes import has_batch_state, meta_findings, traced_writes
from ..errors import PartitionError

__all__ = ["Split", "SplitAt", "StageSpec", "plan_stages", "cached_meta", "replan", "build_stage", "build_empty", "warm_trace", "declaration_kind",
           "has_batch_state"]


@dataclass(frozen=True)
class Split:
    """Cut an ``nn.Sequential`` model into contiguous stages.

    ``Split([3, 5, 2])`` gives the layers per stage; ``Split(parts=3, by="params")``
    or ``by="time"`` balances automatically (``time`` profiles every layer once on a
    sample batch, in the master process).
    """

    balance: Sequence[int] | None = None
    parts: int | None = None
    by: str = "params"

    def __post_init__(self):
        if (self.balance is None) == (self.parts is None):
            raise PartitionError(f"Split expects exactly one of balance=[...] or parts=N, got balance={self.balance!r}, "
                                 f"parts={self.parts!r}: e.g. Split([3, 5, 2]) or Split(parts=3, by='params')")
        if self.balance is not None:
            bad = [b for b in self.balance if not isinstance(b, int) or b < 1]
            if not self.balance or bad:
                raise PartitionError(f"Split balance must be a non-empty list of positive layer counts, got "
                                     f"{list(self.balance)!r}")
        if self.by not in ("params", "time"):
            raise PartitionError(f"Split(by=...) expects 'params' or 'time', got {self.by!r}")

    @property
    def count(self) -> int:
        return len(self.balance) if self.balance is not None else int(self.parts)


@dataclass(frozen=True)
class StageSpec:
    """What an owner needs to build one stage: everything here is small and picklable (a traced stage's graphs:
    18-29 KB for a stage of a 4-layer Llama)."""

    index: int
    name: str
    kind: str  # "names" | "modules" | "slice" | "traced"
    names: tuple[str, ...] = ()
    start: int = 0
    stop: int = 0
    prefix: str = ""  # key prefix of this stage's state_dict in the unsplit model's
    total: int = 0  # "slice": layers the whole nn.Sequential must have (sum of the balance)
    example: Any = None  # shapes and dtypes of the micro-batch a "traced" model was traced with, of the batch a
    # "slice" plan ran the model on (a re-cut runs it again: replan)
    has_bn: bool = False  # "traced": the model has BatchNorm (a traced graph holds no BatchNorm modules)
    writes: tuple[str, ...] = ()  # buffers the model's training forward writes (rpcmp.plan.writes), where a sample was given
    unused: tuple[str, ...] = ()  # "traced": tensors no graph reads, kept here (see [Note: parameters forward does not use])
    tied: tuple[tuple[str, str], ...] = ()  # (name here, the unsplit model's first name) of parameters other stages share
    sizes: tuple = ()  # "traced": per input tensor, each dimension's size where the graph fixes it, else None
    cut: tuple[str, ...] = ()  # "traced": the SplitAt points the graph was cut at (a re-cut moves them)
    one_graph: bool = False  # "traced": the model traces alike in train and eval mode: one graph runs both
    detached: bool = False  # the next stage takes no gradient of this one's output (see rpcmp.owner.reach)
    detached_values: tuple[int, ...] = ()  # nor of these of its tensors, by position: sent detached (rpcmp.plan.unreached)
    detached_posts: tuple[tuple[int, str], ...] = ()  # (stage, name) of posted values their reader takes no gradient of
    mixes: tuple[str, ...] = ()  # the model's outputs whose samples meet (see rpcmp.plan.writes.batch_sized)
    # "traced": its route and graphs as the master traced them (see [Note: an owner builds the graphs the master traced])
    graphs: bytes = field(default=b"", repr=False, compare=False)


def declaration_kind(stages: Any) -> str:
    if isinstance(stages, Split):
        return "slice"
    if isinstance(stages, SplitAt):
        return "traced"
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or len(stages) == 0:
        raise PartitionError(f"stages must be a non-empty list of submodule names, of modules / factories, or a "
                             f"Split(...), got {stages!r}: e.g. stages=['encoder', 'decoder', 'segmentation_head']")
    if all(isinstance(s, str) or (isinstance(s, (list, tuple)) and s and all(isinstance(n, str) for n in s))
           for s in stages):
        return "names"
    if all(isinstance(s, nn.Module) or callable(s) for s in stages):
        return "modules"
    raise PartitionError(f"stages mixes kinds ({[type(s).__name__ for s in stages]}): use only names, or only "
                         f"modules/factories")


def plan_stages(job, sample: Any = None) -> list[StageSpec]:
    """Resolve ``job.stages`` into :class:`StageSpec` records (master side); with a ``sample`` batch, each also says
    what a run of the model on the meta device finds (:func:`rpcmp.plan.writes.meta_findings`)."""
    specs = _plan(job, sample)
    if sample is not None and specs[0].kind != "modules":  # stages given as modules: there is no whole model to run
        ends = () if specs[0].kind == "traced" else tuple(s.names[-1] if s.kind == "names" else s.stop - 1 for s in specs)
        found = meta_findings(job, sample, ends)
        writes = tuple(dict.fromkeys(specs[0].writes + found.writes))  # a SplitAt's graphs say some
        mixes = specs[0].mixes or found.mixes  # a SplitAt's trace may have said
        example = specs[0].example if specs[0].kind == "traced" else _described(sample)
        specs = [replace(s, writes=writes, detached=s.detached or s.index in found.detached, mixes=mixes,
                         detached_values=s.detached_values or found.values.get(s.index, ()), example=example)
                 for s in specs]
    if job.model in COMPILED:  # see rpcmp.plan.materialize._construct
        warnings.warn("Job.model returns a torch.compile'd module: rpcmp splits the module it wraps and runs its "
                      "stages uncompiled, with its names (no '_orig_mod.' prefix)", stacklevel=2)
    return specs


def _plan(job, sample: Any) -> list[StageSpec]:
    stages = job.stages
    kind = declaration_kind(stages)
    if kind == "names":
        specs = []
        for i, item in enumerate(stages):
            names = (item,) if isinstance(item, str) else tuple(item)
            prefix = f"{names[0]}." if len(names) == 1 else ""
            specs.append(StageSpec(i, "+".join(names), "names", names=names, prefix=prefix))
        flat = [n for s in specs for n in s.names]
        dup = sorted({n for n in flat if flat.count(n) > 1})
        if dup:
            raise PartitionError(f"each submodule may appear in one stage only, got {dup} more than once")
        model = meta_model(job)  # see [Note: each owner materializes only its part]
        _check_names(model, flat)
        if not isinstance(model, nn.Sequential):  # see [Note: a chain of children is the model only if forward is that chain]
            if sample is None:
                raise PartitionError(
                    f"stages given by name are checked against {type(model).__name__}.forward on one sample batch, "
                    f"but the job has no data: give Job(data=...), or declare the stages as modules or a Split")
            check_chain(model, flat, _on_meta(sample))
        return _with_shared(model, specs)
    if kind == "modules":
        return [StageSpec(i, _label(s), "modules", prefix=f"{i}.") for i, s in enumerate(stages)]
    if kind == "traced":
        return _plan_traced(job, sample)
    balance = list(stages.balance) if stages.balance is not None else None
    model = meta_model(job)
    if balance is None:
        if stages.by == "params":
            balance = balance_by_params(_as_sequential(model), stages.parts)
        else:  # timing needs real layers: the master builds the model (documented at Split)
            if sample is None:
                raise PartitionError("Split(by='time') needs a sample batch: give the job data=... so one can be drawn")
            balance = balance_by_time(_as_sequential(_build_model(job)), stages.parts, sample)
    specs, start = [], 0
    for i, n in enumerate(balance):
        specs.append(StageSpec(i, f"layers[{start}:{start + n}]", "slice", start=start, stop=start + n,
                               total=sum(balance)))
        start += n
    return _with_shared(model, specs)


def _with_shared(model: nn.Module, specs: list[StageSpec]) -> list[StageSpec]:
    """``specs`` of a names or slice declaration with the parameters their stages share."""
    every = tensor_table(model)
    held = [{n for n in every if n.startswith(_heads(s))} for s in specs]
    return [replace(s, tied=tuple((name[len(s.prefix):], key) for name, key in t))
            for s, t in zip(specs, shared_params(model, held))]


def _heads(spec: StageSpec) -> tuple[str, ...]:
    """Name prefixes of the unsplit model's tensors that a names or slice stage holds."""
    return tuple(f"{n}." for n in spec.names) if spec.kind == "names" else \
        tuple(f"{i}." for i in range(spec.start, spec.stop))


def build_stage(job, spec: StageSpec, meta: bool = False, device: torch.device | str | None = None) -> nn.Module:
    """Build the module of one stage (owner side) and no more of the model: its values are
    those of the unsplit model built with ``torch.manual_seed(job.seed)`` (see [Note: each
    owner materializes only its part]). ``meta``: its structure only, on the meta device; ``device``:
    where the stage will run (a traced graph creates tensors there)."""
    if spec.kind == "traced":  # see [Note: split points on the traced model]
        return build_traced(job, spec, meta, device)
    if meta and spec.kind != "modules":
        return copy.deepcopy(_pick(job, spec, cached_meta(job)))  # a part of the one this process keeps
    if spec.kind == "modules":
        torch.manual_seed(job.seed)
        item = job.stages[spec.index]
        module = item if isinstance(item, nn.Module) else item()
        if not isinstance(module, nn.Module):
            raise PartitionError(f"stage {spec.index} factory {_label(item)} returned {type(module).__name__}, expected an nn.Module")
        return module.to("meta") if meta else module
    heads = _heads(spec)
    return _pick(job, spec, build_part(job, lambda key: key.startswith(heads)))


def build_empty(job, spec: StageSpec, device: torch.device | str) -> nn.Module | None:
    """The stage's structure with memory that is not initialized, for a stage whose every parameter and
    buffer is about to be copied in (``rpcmp.owner.move.fill_stage`` checks that it gets them all): a
    tenth of a full build's time for an smp Unet's decoder, which draws the whole model's initial values.
    None where a tensor that is neither would be left on the meta device (a plain attribute), and for
    traced stages (constants the trace lifts) and module instances (``to("meta")`` would change the job's)."""
    if spec.kind not in ("names", "slice"):
        return None
    module = build_stage(job, spec, meta=True).to_empty(device=device)
    for m in module.modules():
        if any(isinstance(v, torch.Tensor) and v.is_meta for v in vars(m).values()):
            return None
    return module


def warm_trace(job, spec: StageSpec) -> None:
    """Trace the model that ``spec`` was cut from (a traced stage whose graphs the plan does not carry) or keep it on
    the meta device (by name or slice), so that a later build of any stage of it here skips that (a spare's: 25 ms
    of 40 for the demo's decoder)."""
    if spec.kind == "traced" and not spec.graphs:  # a build from the master's graphs traces nothing
        traces(as_cut(job, spec), spec.example, eval_too=not spec.one_graph)
    elif spec.kind in ("names", "slice"):
        cached_meta(job)


def cached_meta(job) -> nn.Module:
    """``meta_model(job)``, once per process for a model factory and seed (the last 4); callers copy what they change."""
    key = (id(job.model), job.seed)
    entry = _METAS.get(key)
    if entry is None or entry[0] is not job.model:  # held here: another thread may drop it from the cache
        entry = _METAS[key] = (job.model, meta_model(job))
        while len(_METAS) > 4:
            _METAS.popitem(last=False)
    return entry[1]


def _pick(job, spec: StageSpec, model: nn.Module) -> nn.Module:
    """Stage ``spec`` of ``model`` (a names or slice declaration)."""
    if spec.kind == "names":
        _check_names(model, _all_names(job))
        if len(spec.names) == 1:
            return getattr(model, spec.names[0])
        # keep the submodule names so that state_dict keys match the unsplit model's
        return nn.Sequential(OrderedDict((n, getattr(model, n)) for n in spec.names))
    seq = _as_sequential(model)
    if spec.total != len(seq):
        raise PartitionError(
            f"model and sum of balance have different length (model: {len(seq)} layers, "
            f"sum of balance: {spec.total}): make the balance add up to {len(seq)}"
        )
    return seq[spec.start:spec.stop]


_METAS: OrderedDict = OrderedDict()  # the last few meta models of this process (see cached_meta)


def _on_meta(sample: Any) -> Any:
    return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, sample)


def _plan_traced(job, sample: Any) -> list[StageSpec]:
    """Trace the model on the master (:func:`rpcmp.plan.export.traces`): how many stages the cuts give, and what the owners
    trace with."""
    from ..core.microbatch import scatter
    if sample is None:
        raise PartitionError("SplitAt traces the model on one batch, but the job has no data: give Job(data=...) "
                             "or Pipeline(..., sample=batch)")
    return _trace_plan(job, _on_meta(scatter(sample, job.microbatches)[0]))


def _trace_plan(job, example: Any) -> list[StageSpec]:
    model = meta_model(job)  # see [Note: each owner materializes only its part]
    pipe, evaluated = traces(job, example_of(example))
    held = [set(tensor_table(pipe.get_stage_module(i))) for i in range(pipe.num_stages)]
    refuse_strange(model, pipe, held)  # the promise of SplitAt: the unsplit model's names
    unused = place_unused(model, held)
    tied = shared_params(model, [h | set(u) for h, u in zip(held, unused)])
    mixes = check_any_batch_size(pipe, example)
    check_same_cut(pipe, evaluated)  # see [Note: a traced stage in eval mode]
    one = same_graphs(pipe, evaluated)
    if not one:  # the same graphs, op for op: the train graph's check was this one's
        check_any_batch_size(evaluated, example)
    sizes = input_sizes(pipe, example)
    if job.stages.lengths == "any":
        require_any_length(meta_model(job), example, sizes)
    bn, writes = has_batch_state(model), traced_writes(pipe, model)
    bounds = ["input", *job.stages.points, "output"] if job.stages.points else None
    # a stage that outputs no floating tensor takes no gradient of its input, nor one that reads it only through a
    # comparison, detach or no_grad: the stage before sends it detached (and any other tensor so read, by position)
    values = unreached_values(pipe, example)
    detached = {i - 1 for i in range(1, pipe.num_stages) if outputs_no_gradient(pipe.get_stage_module(i))}
    detached |= {k for k, (missed, count) in values.values.items() if len(missed) == count}
    pipes = [pipe, pipe if one else evaluated]
    return [StageSpec(i, f"{bounds[i]}..{bounds[i + 1]}" if bounds else f"part {i}", "traced", graphs=ship_stage(pipes, i),
                      example=example_of(example), has_bn=bn, writes=writes, unused=tuple(unused[i]), tied=tied[i], sizes=sizes,
                      cut=tuple(job.stages.points), one_graph=one, mixes=mixes, detached=i in detached,
                      detached_values=() if i in detached else values.values.get(i, ((), 0))[0],
                      detached_posts=values.posts.get(i, ()))
            for i in range(pipe.num_stages)]


def replan(job, specs: list[StageSpec], cut: Any) -> list[StageSpec]:
    """The stages of ``job``, now cut as ``specs``, cut anew (a re-cut while training: rpcmp.master.recut):
    ``cut`` is a balance (layer counts) for a ``Split``, the points of a ``SplitAt`` for a traced split."""
    if specs[0].kind == "traced":
        points = cut.points if isinstance(cut, SplitAt) else tuple(cut)
        new = _trace_plan(replace(job, stages=SplitAt(*points, lengths=job.stages.lengths)),
                          from_example(specs[0].example, "meta"))
    else:  # which stages send their output, or some of its tensors, detached is the cut's (rpcmp.owner.reach)
        sample = None if specs[0].example is None else from_example(specs[0].example, "meta")
        new = plan_stages(replace(job, stages=Split([int(b) for b in cut])), sample)
    # what the forward writes and whether its samples meet are the model's, not the cut's
    return [replace(s, writes=specs[0].writes, mixes=specs[0].mixes) for s in new]


def _described(sample: Any) -> Any:
    """:func:`rpcmp.plan.traced.example_of` ``sample``, or None for a batch that holds more than tensors."""
    try:
        return example_of(sample)
    except PartitionError:
        return None


def _check_names(model: nn.Module, names: list[str]) -> None:
    children = [n for n, _ in model.named_children()]
    for name in names:
        if name not in children:
            raise PartitionError(f"{type(model).__name__} has no submodule {name!r}; valid names, in order: {children}")
    order = [children.index(n) for n in names]
    if order != sorted(order):
        raise PartitionError(f"stage names must follow the model's submodule order {children}, got {names}")


def _all_names(job) -> list[str]:
    return [n for item in job.stages for n in ((item,) if isinstance(item, str) else item)]


def _build_model(job) -> nn.Module:
    """The whole model, for real (only ``Split(by="time")`` needs it: it times the layers)."""
    return build_whole(job)


def _as_sequential(model: nn.Module) -> nn.Sequential:
    if not isinstance(model, nn.Sequential):
        raise PartitionError(
            f"Split(...) cuts an nn.Sequential, got {type(model).__name__}: declare stages by "
            f"submodule names instead, or return an nn.Sequential from the model factory"
        )
    return model


def _label(item: Any) -> str:
    if isinstance(item, nn.Module):
        return type(item).__name__
    return getattr(item, "__name__", type(item).__name__)
