"""One export for every cut among one module's children (rpcmp.plan.marks): a re-cut exports nothing again and
builds the stages an export marked at its own points builds."""
import dataclasses

import torch
from torch import nn

import rpcmp
import rpcmp.plan.export as export
import rpcmp.plan.marks as marks
from rpcmp.plan.graphs import graphs
from rpcmp.plan.partition import build_stage, plan_stages
from rpcmp.plan.traced import run_stages


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _exports(monkeypatch) -> list:
    """Each ``torch.export.export`` from here on appends to the list returned; nothing is kept from before."""
    monkeypatch.setattr(export, "_TRACES", type(export._TRACES)())
    monkeypatch.setattr(marks, "_EXPORTS", type(marks._EXPORTS)())
    made, plain = [], torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: made.append(1) or plain(*a, **k))
    return made


def _built(job, x):
    """The stages' graphs' code, and that the stages compute the unsplit model in both modes."""
    specs = plan_stages(job, x)
    stages = [build_stage(job, s) for s in specs]
    torch.manual_seed(job.seed)
    whole = job.model()
    for mode in ("train", "eval"):
        for module in (*stages, whole):
            getattr(module, mode)()
        torch.testing.assert_close(run_stages(stages, x), whole(x))
    return [s.name for s in specs], [[g.python_code("self").src for _, _, g in graphs(m)] for m in stages]


def test_a_second_cut_among_one_module_s_children_exports_nothing_and_builds_what_its_own_export_builds(monkeypatch):
    made, x = _exports(monkeypatch), torch.randn(6, 8)
    job = rpcmp.Job(model=_Blocks, stages=rpcmp.SplitAt("blocks.1", "blocks.3"))
    first = _built(job, x)
    assert first[0] == ["input..blocks.1", "blocks.1..blocks.3", "blocks.3..output"] and len(made) == 2  # train, eval
    recut = dataclasses.replace(job, stages=rpcmp.SplitAt("blocks.2"))
    again = _built(recut, x)
    assert again[0] == ["input..blocks.2", "blocks.2..output"] and len(made) == 2  # no export
    inside = dataclasses.replace(job, stages=rpcmp.SplitAt("blocks.2.0"))  # the first child of another module
    assert _built(inside, x)[0] == ["input..blocks.2.0", "blocks.2.0..output"] and len(made) == 4

    # what an export marked at the points alone builds (as every cut was traced before)
    alone = _exports(monkeypatch)
    monkeypatch.setattr(export, "marks_for", lambda model, points: tuple(points))
    assert _built(recut, x) == again and len(alone) == 2


def test_a_marker_that_names_no_module_has_the_cut_exported_with_its_points_alone(monkeypatch):
    """A marker without a module (no ``nn_module_stack``) cannot be told apart (dropped as no point's, it cut
    nothing at ``blocks.1``): the export is made again with the points alone, and the stages are cut where asked."""
    made, x = _exports(monkeypatch), torch.randn(6, 8)
    plain = marks.marked_module
    monkeypatch.setattr(marks, "marked_module", lambda node: None if plain(node) == "blocks.1" else plain(node))
    job = rpcmp.Job(model=_Blocks, stages=rpcmp.SplitAt("blocks.1", "blocks.3"))
    names, _ = _built(job, x)
    assert names == ["input..blocks.1", "blocks.1..blocks.3", "blocks.3..output"] and len(made) == 4
    recut = dataclasses.replace(job, stages=rpcmp.SplitAt("blocks.2"))  # straight to its points alone: train, eval
    assert _built(recut, x)[0] == ["input..blocks.2", "blocks.2..output"] and len(made) == 6
