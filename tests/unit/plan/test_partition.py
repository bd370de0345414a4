import pytest
import segmentation_models_pytorch as smp
import torch
from torch import nn

import rpcmp
from rpcmp.errors import PartitionError
from rpcmp.plan.partition import Split, build_stage, plan_stages


def unet():
    return smp.Unet("resnet18", encoder_weights=None, in_channels=1, classes=1)


def seq():
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])


def job(**kw):
    return rpcmp.Job(**{"model": unet, "stages": ["encoder", "decoder", "segmentation_head"], **kw})


SAMPLE = torch.randn(2, 1, 64, 64)  # names are checked against Unet.forward on a sample (rpcmp/plan/chain.py)


def test_names_build_the_unsplit_modules_and_compose_to_the_model():
    j = job()
    specs = plan_stages(j, SAMPLE)
    assert [s.name for s in specs] == ["encoder", "decoder", "segmentation_head"]
    stages = [build_stage(j, s) for s in specs]
    torch.manual_seed(0)
    whole = unet().eval()
    for s in stages:
        s.eval()
    x = torch.randn(2, 1, 64, 64)
    torch.testing.assert_close(stages[2](stages[1](stages[0](x))), whole(x))
    keys = {specs[i].prefix + k for i, s in enumerate(stages) for k in s.state_dict()}
    assert keys == set(whole.state_dict())


def test_several_names_in_one_stage_keep_their_keys():
    j = job(stages=["encoder", ["decoder", "segmentation_head"]])
    specs = plan_stages(j, SAMPLE)
    stage = build_stage(j, specs[1])
    assert all(k.startswith(("decoder.", "segmentation_head.")) for k in stage.state_dict())


def test_unknown_name_lists_valid_names():
    j = job(stages=["encoder", "decodr"])
    with pytest.raises(PartitionError, match=r"no submodule 'decodr'; valid names, in order: \['encoder', 'decoder', 'segmentation_head'\]"):
        plan_stages(j, SAMPLE)


def test_out_of_order_and_duplicate_names():
    j = job(stages=["decoder", "encoder"])
    with pytest.raises(PartitionError, match="must follow the model's submodule order"):
        plan_stages(j, SAMPLE)
    with pytest.raises(PartitionError, match=r"more than once"):
        plan_stages(job(stages=["encoder", "encoder"]), SAMPLE)
    with pytest.raises(PartitionError, match=r"checked against Unet.forward on one sample batch, but the job has no data"):
        plan_stages(job())


def test_explicit_modules_and_factories():
    j = rpcmp.Job(stages=[nn.Linear(2, 3), lambda: nn.Linear(3, 1)])
    specs = plan_stages(j)
    assert [s.kind for s in specs] == ["modules", "modules"]
    assert isinstance(build_stage(j, specs[1]), nn.Linear)
    bad = rpcmp.Job(stages=[lambda: 3])
    with pytest.raises(PartitionError, match="returned int, expected an nn.Module"):
        build_stage(bad, plan_stages(bad)[0])


def test_split_balance_and_automatic():
    j = rpcmp.Job(model=seq, stages=Split([2, 3, 1]))
    specs = plan_stages(j)
    assert [(s.start, s.stop) for s in specs] == [(0, 2), (2, 5), (5, 6)]
    assert len(build_stage(j, specs[1])) == 3
    assert [s.stop - s.start for s in plan_stages(rpcmp.Job(model=seq, stages=Split(parts=3)))] == [2, 2, 2]
    timed = plan_stages(rpcmp.Job(model=seq, stages=Split(parts=2, by="time")), sample=torch.randn(4, 4))
    assert sum(s.stop - s.start for s in timed) == 6


def test_split_errors_say_what_and_how():
    j = rpcmp.Job(model=seq, stages=Split([2, 3]))
    with pytest.raises(PartitionError, match=r"model: 6 layers, sum of balance: 5\): make the balance add up to 6"):
        build_stage(j, plan_stages(j)[0])
    with pytest.raises(PartitionError, match="exactly one of balance"):
        Split()
    with pytest.raises(PartitionError, match="positive layer counts"):
        Split([2, 0])
    with pytest.raises(PartitionError, match="'params' or 'time'"):
        Split(parts=2, by="flops")
    with pytest.raises(PartitionError, match="cuts an nn.Sequential, got Unet"):
        plan_stages(job(stages=Split(parts=2)))
    with pytest.raises(PartitionError, match="needs a sample batch"):
        plan_stages(rpcmp.Job(model=seq, stages=Split(parts=2, by="time")))


def test_bad_declarations():
    for bad in ([], "encoder", 3, ["encoder", nn.Linear(1, 1)]):
        with pytest.raises(PartitionError):
            rpcmp.Job(model=unet, stages=bad)


def test_a_warmed_process_builds_empty_stages_without_constructing_the_model_again(monkeypatch):
    from rpcmp.plan import partition
    from helpers import load
    job = load("named")
    specs = plan_stages(job, torch.zeros(2, 16))
    made = []
    monkeypatch.setattr(partition, "meta_model", lambda j: made.append(1) or rpcmp.plan.materialize.meta_model(j))
    monkeypatch.setattr(partition, "_METAS", type(partition._METAS)())
    partition.warm_trace(job, specs[1])  # a spare, while it waits
    first = partition.build_empty(job, specs[1], "cpu")
    second = partition.build_empty(job, specs[1], "cpu")
    assert made == [1]  # the model was made on the meta device once, while warming
    assert {p.device.type for p in [*first.parameters(), *second.parameters()]} == {"cpu"}
    assert first[0].weight is not second[0].weight  # each build its own copy: the kept model stays on meta
    assert {p.device.type for p in partition.cached_meta(job).parameters()} == {"meta"}


class _Detached(nn.Module):
    def forward(self, x):
        return x.detach().tanh()


@pytest.mark.parametrize("named", [False, True])
def test_a_plan_finds_the_stage_whose_output_the_next_stage_takes_no_gradient_of(named):
    """Run on the meta device with the first batch, a Split plan marks the stage before one that reads its input
    detached (it then sends detached: see rpcmp/owner/reach.py), by position also where the children have names."""
    from collections import OrderedDict
    layers = [nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), _Detached(), nn.Linear(32, 8)]
    model = (lambda: nn.Sequential(OrderedDict(zip("abcde", layers)))) if named else (lambda: nn.Sequential(*layers))
    specs = plan_stages(rpcmp.Job(model=model, stages=Split([2, 2, 1])), torch.randn(4, 16))
    assert [s.detached for s in specs] == [True, False, False]  # stage 1 reads stage 0's output detached
    assert [s.detached for s in plan_stages(rpcmp.Job(model=model, stages=Split([2, 2, 1])))] == [False] * 3  # no batch
