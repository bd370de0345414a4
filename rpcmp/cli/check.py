"""``rpcmp plan JOB --check``: the stages against the unsplit model, on one batch, in one process.

Builds the unsplit model (``Job.model()`` under the job's seed) and every stage as its owner
would, then checks, by name, that every parameter, buffer and constant of every stage has the
unsplit model's value (nothing on the meta device, nothing unwritten), and that one batch run
through the stages, one after another, gives the unsplit model's output (eval mode, so dropout
does not draw). It holds the whole model twice: a check for a machine that can, not a training
path. A loss that is not finite before any update points here (:class:`rpcmp.core.policy.NonFinite`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import PartitionError
from ..plan.materialize import attribute, build_whole, check_materialized, graph_constants, tensor_table
from ..plan.partition import build_stage

__all__ = ["StageCheck", "check_stages"]


@dataclass
class StageCheck:
    index: int
    name: str
    tensors: int = 0  # parameters, buffers and constants compared
    wrong: list[str] = field(default_factory=list)  # by name: what differs from the unsplit model


def check_stages(job, specs, batch: Any) -> tuple[list[StageCheck], float | None, str | None]:
    """Per stage: its tensors against the unsplit model's; then the largest difference between the
    stages' output and the unsplit model's on ``batch`` (None with the reason when it cannot run)."""
    if job.model is None:
        return [], None, "the job declares its stages as modules: there is no unsplit model to compare with"
    whole = build_whole(job).eval()
    reference = tensor_table(whole)
    stages, checks = [], []
    for spec in specs:
        check = StageCheck(spec.index, spec.name)
        try:
            module = build_stage(job, spec).eval()
            check_materialized({"stage": module}, f"stage {spec.index}")
        except PartitionError as exc:
            check.wrong.append(str(exc))
            checks.append(check)
            continue
        made = set(tensor_table(module)) - set(module.state_dict())  # non-persistent: RoPE's inv_freq, and a
        for name, t in tensor_table(module).items():  # tensor forward makes from Python values, the model has no name for
            ref = reference.get(spec.prefix + name)
            if ref is None and name in made:
                continue  # its value is the trace's (see [Note: traced as if on the CPU] in rpcmp/plan/export.py)
            check.tensors += 1
            if ref is None:
                check.wrong.append(f"{spec.prefix + name}: not in the unsplit model")
            elif ref.shape != t.shape or not torch.equal(ref, t):
                check.wrong.append(f"{spec.prefix + name}: differs from the unsplit model")
        for name in graph_constants(module):
            check.tensors += 1
            ref = attribute(whole, name)
            if isinstance(ref, torch.Tensor) and not torch.equal(ref, attribute(module, name)):
                check.wrong.append(f"{name} (a constant of the traced graph): differs from the unsplit model")
        stages.append(module)
        checks.append(check)
    if len(stages) < len(specs):
        return checks, None, "a stage could not be built"
    from ..core.microbatch import scatter
    x = scatter(batch, job.microbatches)[0] if batch is not None else None
    if x is None:
        return checks, None, "the job has no data to draw a batch from"
    with torch.no_grad():
        expected = whole(x)
        got = _run(stages, specs, x)
    diffs = [(a.float() - b.float()).abs().max().item() if a.numel() else 0.0
             for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected))]
    return checks, max(diffs, default=0.0), None


def _run(stages, specs, x):
    from ..plan.traced import run_stages
    if specs[0].kind == "traced":
        return run_stages(stages, x)
    for stage in stages:
        x = stage(x)
    return x

