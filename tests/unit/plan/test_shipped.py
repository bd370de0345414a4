"""An owner builds a traced stage from the graphs the master traced (rpcmp/plan/shipped.py): the same graphs, node
for node, and the same stage; where they cannot be written or read, it traces them itself."""
import dataclasses

import pytest
import torch
from torch import nn

import rpcmp
from helpers import load, same_built_graphs
from rpcmp.plan.export import _as_eager
from rpcmp.plan.graphs import graphs
from rpcmp.plan.partition import build_stage, plan_stages
from rpcmp.plan.shipped import ship, unship_stage
from rpcmp.plan.traced import run_stages


_RunningMean = type(load("ema").model()[1])  # tests/jobs/ema.py: a no_grad block whose op returns its input


def _ema_mlp():
    return nn.Sequential(nn.Linear(16, 32), _RunningMean(32), nn.Tanh(), nn.Linear(32, 8))


def test_the_shipped_graphs_are_the_traced_graphs_node_for_node():
    """Every graph of every stage (pipelining's modules within modules) as traced, with the same meta tensors, and a
    call of a plain Python function kept as a call (fx's own pickling traces such a function's code again: here the
    no_grad block's output would be the tracer's value, its gradient cut off). The language models:
    tests/unit/plan/test_language_model_stages.py."""
    x = torch.randn(4, 16)
    job = rpcmp.Job(model=_ema_mlp, stages=rpcmp.SplitAt("2"))
    specs = plan_stages(job, x)
    assert same_built_graphs(job, specs)
    assert any(n.target is _as_eager for _, _, graph in graphs(unship_stage(specs[0].graphs)[1][0])
               for n in graph.nodes)
    stages = [build_stage(job, s) for s in specs]
    torch.manual_seed(job.seed)
    model = _ema_mlp()
    out = run_stages(stages, x)
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(stages[0].get_buffer("1.mean"), model[1].mean)  # the EMA written alike
    out.sum().backward()  # through the block's input: the gradient reaches the first layer
    assert stages[0].get_parameter("0.weight").grad is not None
    from torch.export.unflatten import InterpreterModule  # see [Note: a stage's graphs run as generated code]
    nested = [m for stage in stages for m in stage.modules() if isinstance(m, InterpreterModule)]
    assert nested and not any(m._run_with_interpreter for m in nested)


def test_an_owner_traces_the_graphs_it_cannot_read():
    job = rpcmp.Job(model=_ema_mlp, stages=rpcmp.SplitAt("2"))
    x = torch.randn(4, 16)
    specs = [dataclasses.replace(s, graphs=b"not a pickle") for s in plan_stages(job, x)]
    assert unship_stage(specs[0].graphs) is None
    stages = [build_stage(job, s) for s in specs]
    torch.manual_seed(job.seed)
    torch.testing.assert_close(run_stages(stages, x), _ema_mlp()(x))


def test_what_cannot_be_written_ships_as_nothing():
    assert ship(lambda x: x) == b""  # the owner traces


class _Attention(nn.Module):
    """Named as BERT's: ``attention.self`` then ``attention.output``."""

    def __init__(self):
        super().__init__()
        self.add_module("self", nn.Linear(8, 8))
        self.output = nn.Linear(8, 8)

    def forward(self, x):
        return self.output(getattr(self, "self")(x).relu())


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = _Attention()

    def forward(self, x):
        return self.attention(x) + x


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.ModuleList(_Layer() for _ in range(2))

    def forward(self, x):
        for layer in self.layer:
            x = layer(x)
        return x


class _TopSelf(nn.Module):
    """A child of the model itself named ``self``: a node of the stage's own graph module."""

    def __init__(self):
        super().__init__()
        self.add_module("self", nn.Linear(8, 8))
        self.output, self.last = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.last(self.output(getattr(self, "self")(x).relu()))


@pytest.mark.parametrize("model, point", [(_Encoder, "layer.1"), (_TopSelf, "last")], ids=["bert-like", "top-level"])
def test_a_submodule_named_self_runs_as_code_as_the_unsplit_model(model, point):
    """Its call is a graph node named ``self``, which the generated code made a variable that took the place of the
    module it runs on: BERT's stages failed on their first micro-batch (``'Tensor' object has no attribute
    'output'``), a model's own child so named failed its plan. The node is renamed at the trace (see [Note: a node
    named self] in rpcmp/plan/graphs.py); every nested module still runs as code."""
    x = torch.randn(4, 8)
    job = rpcmp.Job(model=model, stages=rpcmp.SplitAt(point))
    stages = [build_stage(job, s) for s in plan_stages(job, x)]
    from torch.export.unflatten import InterpreterModule
    nested = [m for stage in stages for m in stage.modules() if isinstance(m, InterpreterModule)]
    assert nested and not any(m._run_with_interpreter for m in nested)
    torch.manual_seed(job.seed)
    torch.testing.assert_close(run_stages(stages, x), model()(x))
