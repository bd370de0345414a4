"""What a model's training forward updates besides its parameters: BatchNorm's statistics, spectral norm's power
iteration, and any buffer a forward of the user's writes (a running mean, an EMA codebook, a quantization
observer's range); and a model whose samples meet each other in its output (in-batch negatives). A split run
updates such state once per micro-batch where the unsplit model does once a batch (and each sample meets only its
micro-batch's), so such a model runs each training batch as one micro-batch under ``Job(batchnorm="batch")``, the
default (see [Note: BatchNorm and micro-batches] in rpcmp/master/pipeline.py)."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm

from ..core.microbatch import received, tensors, unreached
from .graphs import graphs
from .materialize import meta_model

__all__ = ["has_batch_state", "meta_findings", "Found", "one_more", "batch_sized", "traced_writes", "whole_batch_note",
           "detached_note", "stamps", "unknown_writes"]


def has_batch_state(module: nn.Module, spec=None) -> bool:
    """Whether a stage (or model) updates state from each training batch in its forward: a module of a known kind
    (:func:`_known`), or, from the plan (``spec``), a traced model with BatchNorm (a traced graph holds no BatchNorm
    modules), a model whose forward writes buffers or one whose samples meet (:func:`meta_findings`)."""
    return bool(spec is not None and (spec.has_bn or spec.writes or spec.mixes)) or any(_known(m) for m in module.modules())


def _known(m: nn.Module) -> bool:
    """BatchNorm (statistics over the batch) or spectral norm (``_u``, ``_v``: one power-iteration step per forward),
    as a parametrization or as the older hook."""
    return (isinstance(m, (nn.modules.batchnorm._BatchNorm, _SpectralNorm))
            or any(isinstance(h, SpectralNorm) for h in m._forward_pre_hooks.values()))


class Found(NamedTuple):
    """What a run of the model on the meta device finds (:func:`meta_findings`)."""

    writes: tuple[str, ...] = ()  # buffers the training forward writes, by the unsplit model's names
    detached: tuple[int, ...] = ()  # stages whose output the next stage takes no gradient of
    mixes: tuple[str, ...] = ()  # outputs whose samples meet each other (:func:`batch_sized`)
    # stage -> positions of its output's tensors that the next stage takes no gradient of (read-only: one default)
    values: Mapping[int, tuple[int, ...]] = MappingProxyType({})


def meta_findings(job, sample: Any, ends: tuple = ()) -> Found:
    """Run ``job.model()`` built on the meta device (no memory, no arithmetic) on ``sample`` and find: the buffers its
    training forward writes on every call, in place or by putting another tensor in their place, other than those of
    a module :func:`has_batch_state` knows by its kind, by the unsplit model's names (a write in the second of two
    calls counts, so a cache a forward builds on its first call and then only reads does not); for stages ending at
    the submodules ``ends`` (names, or positions among the model's children), the stages whose output the next
    stage's output takes no gradient from, or some of whose output's tensors it takes none from (see [Note: an input
    the backward never reaches] in rpcmp/owner/reach.py);
    and the outputs whose samples meet (:func:`batch_sized`: a third call, one sample more). Nothing for a forward
    that cannot run on the meta device (one that reads values, ``if mask.all():``): none is known."""
    model = meta_model(job).train()
    x = pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, sample)
    outs: dict[int, list] = {i: [] for i in range(len(ends))}  # a stage's output: its last module's, called once
    hooks = []
    try:
        children = list(model.children())
        hooks = [(children[end] if isinstance(end, int) else model.get_submodule(end)).register_forward_hook(
            lambda m, args, out, i=i: outs[i].append(out)) for i, end in enumerate(ends)]
        with torch.random.fork_rng(devices=[]):  # the process's generators come out as they went in
            model(x)
            before = stamps(model)
            out = model(x)
            writes = unknown_writes(model, before)  # before a call of another size, which may rebuild a cache
            for hook in hooks:
                hook.remove()
            mixes = _mixes(model, x, out)
    except Exception:  # noqa: BLE001 - a forward that needs values: not known, as before this check
        return Found()
    finally:
        for hook in hooks:
            hook.remove()
    once = {i: out[-1] for i, out in outs.items() if len(out) == 2}  # once in each of the two calls
    cut, values = [], {}
    for i in range(len(ends) - 1):
        if i in once and i + 1 in once and (nodes := received(once[i])):
            missed = unreached(once[i + 1], nodes)
            if len(missed) == len(nodes):
                cut.append(i)
            elif missed:  # by position among the output's tensors; one node that others' share is reached with them
                values[i] = tuple(p for p, t in enumerate(tensors(once[i])) if t.requires_grad and t.grad_fn in missed)
    return Found(writes, tuple(cut), mixes, values)


def _mixes(model: nn.Module, x: Any, out: Any) -> tuple[str, ...]:
    """:func:`batch_sized` of ``model``'s output ``out`` for ``x``, from a call on one sample more; nothing known for
    a forward that fixes its batch size (what the two calls before found stands)."""
    try:
        return batch_sized(out, model(one_more(x)))
    except Exception:  # noqa: BLE001 - a forward that fixes its batch size: not known
        return ()


def one_more(batch: Any) -> Any:
    """``batch`` with its first sample twice: one sample more."""
    return pytree.tree_map(lambda t: torch.cat([t, t[:1]]) if isinstance(t, torch.Tensor) and t.dim() else t, batch)


def batch_sized(out: Any, bigger: Any) -> tuple[str, ...]:
    """[Note: samples that meet in the model]
    The model's outputs for a batch (``out``) and for one sample more (``bigger``): those with a dimension after the
    first that follows the batch size, as ``"logits_per_text (8, 8)"``. Such an output is computed from every sample
    of the batch together (CLIP's similarity of each text to each image, in-batch negatives): over micro-batches the
    model computes another one (each sample meets only its micro-batch's), and a loss over it (a contrastive one, its
    targets ``arange(len(logits))``) trains another model, without a word. Such a model runs each training batch, and
    each batch it predicts, as one micro-batch under ``Job(batchnorm="batch")``, the default, as a model with
    BatchNorm trains; the run and ``rpcmp plan`` say so. With replicas each copy's share meets itself, as under DDP.
    Found by shapes alone: samples that meet in an output of the batch's shape (``x - x.mean(0)``) are not."""
    found = []
    pairs, _ = pytree.tree_flatten_with_path(out)
    for (path, a), b in zip(pairs, pytree.tree_leaves(bigger)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() and a.dim() > 1 and any(
                a.shape[d] != b.shape[d] for d in range(1, a.dim())):
            found.append(f"output{pytree.keystr(path)} {tuple(a.shape)}")
    return tuple(found)


def traced_writes(pipe, model: nn.Module) -> tuple[str, ...]:
    """The buffers the graphs of a traced split (``pipe``) write in place, other than those of a module of ``model``
    :func:`has_batch_state` knows by its kind; by the unsplit model's names. Found in the graphs, this holds also
    for a forward that cannot run on the meta device (one that reads values, as most Hugging Face models do)."""
    buffers, found = dict(model.named_buffers(remove_duplicate=False)), set()
    for i in range(pipe.num_stages):
        for prefix, _, graph in graphs(pipe.get_stage_module(i)):
            for node in graph.nodes:
                schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
                for arg, value in zip(schema.arguments if schema is not None else (), node.args):
                    if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.fx.Node):
                        root = _aliased(value)
                        if root.op == "get_attr":
                            found.add(f"{prefix}.{root.target}" if prefix else root.target)
    return tuple(sorted(n for n in found if n in buffers and not _known(model.get_submodule(n.rpartition(".")[0]))))


def _aliased(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose tensor ``node`` is: through views, ``detach`` and in-place ops, which return their input."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.arguments or schema.arguments[0].alias_info is None:
            break
        node = node.args[0]
    return node


def unknown_writes(module: nn.Module, before: dict, known=()) -> tuple[str, ...]:
    """The buffers of ``module`` written since their ``before`` :func:`stamps`, other than ``known`` ones and
    those of a module :func:`has_batch_state` knows by its kind."""
    return tuple(n for n, (b, version) in stamps(module).items()
                 if (n not in before or before[n][0] is not b or before[n][1] != version) and n not in known
                 and not _known(module.get_submodule(n.rpartition(".")[0])))


def stamps(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Each buffer and its version counter (which every in-place write advances); the buffer itself, not its id,
    which a tensor put in its place may be given once the old one is freed."""
    return {n: (b, b._version) for n, b in model.named_buffers(remove_duplicate=False)}


def whole_batch_note(writes: tuple[str, ...], microbatches: int, mixes: tuple[str, ...] = ()) -> str:
    """The run banner's line for a model that runs each training batch as one micro-batch, and why."""
    if mixes:  # see [Note: samples that meet in the model]
        return (f"the model's samples meet each other ({', '.join(mixes[:2])}: a dimension after the first follows the "
                f"batch size): each batch runs as 1 micro-batch so that they meet as in the unsplit model "
                f"(Job.batchnorm='batch'); batchnorm='micro' pipelines {microbatches} micro-batches, each sample meeting "
                f"only its micro-batch's")
    what = ("it writes " + ", ".join(writes[:3]) + (f" and {len(writes) - 3} more buffers" if len(writes) > 3 else "")
            if writes else "BatchNorm or spectral norm")
    return (f"the model's training forward updates state ({what}): each batch runs as 1 micro-batch so that it is "
            f"updated once a batch, as by the unsplit model (Job.batchnorm='batch'); batchnorm='micro' pipelines "
            f"{microbatches} micro-batches, updating it once each")


def detached_note(spec) -> str:
    """The run banner's lines for a stage whose output the next stage takes no gradient of (``spec.detached``), or
    of some of its tensors (``spec.detached_values``), or of values it posts to later stages (``spec.detached_posts``)."""
    k, lines = spec.index, []
    how = "through detach, no_grad or an op without one"
    for j, name in spec.detached_posts:
        lines.append(f"stage {j} takes no gradient of the value {name} that stage {k} posts to it (its forward reads it "
                     f"{how}): sent without one, as in the unsplit model")
    if spec.detached_values and not spec.detached:
        which, many = ", ".join(str(p) for p in spec.detached_values), len(spec.detached_values) > 1
        lines.append(f"stage {k + 1} takes no gradient of tensor{'s' if many else ''} {which} of stage {k}'s output "
                     f"(its forward reads {'them' if many else 'it'} {how}): sent without one, as in the unsplit model")
    if spec.detached:
        before = f"stages 0-{k} get none and keep their" if k else "stage 0 gets none and keeps its"
        lines.append(f"stage {k + 1} takes no gradient of stage {k}'s output (its forward reads it {how}): {before} "
                     f"first values, as in the unsplit model")
    return "\n".join(lines)
