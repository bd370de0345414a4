"""An owner builds its part of a model alone, with the values the unsplit build gives it."""
import copy
import types

import pytest
import segmentation_models_pytorch as smp
import torch
import torchvision
from torch import nn

from rpcmp.errors import PartitionError
from rpcmp.plan.materialize import build_part, meta_model


class Tied(nn.Module):  # a parameter computed before it is registered, a constant buffer, tied weights
    def __init__(self):
        super().__init__()
        self.a, self.pos, self.b = nn.Linear(5, 6), nn.Parameter(torch.randn(3, 6) * 0.02), nn.Linear(6, 5)
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))
        self.emb, self.out = nn.Embedding(5, 6), nn.Linear(6, 5, bias=False)
        self.out.weight = self.emb.weight


class ReadsValues(nn.Module):  # construction reads a tensor's value: cannot run on the meta device
    def __init__(self):
        super().__init__()
        rates = [r.item() for r in torch.linspace(0, 0.1, 3)]
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in rates)
        self.bn = nn.BatchNorm1d(4)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True) for _ in range(3))


class Teacher(nn.Module):  # a copy of a module the model keeps (an EMA teacher), and copies of copies
    def __init__(self):
        super().__init__()
        self.student = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3))
        self.teacher = copy.deepcopy(self.student)
        self.pair = nn.ModuleList(copy.deepcopy(self.teacher[0]) for _ in range(2))
        self.pairs = copy.deepcopy(self.pair)
        nn.init.normal_(self.pair[1].weight)  # drawn after the copies were made


class CopiedTable(nn.Module):  # a temporary copy the construction reads: it keeps its values
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        table = copy.deepcopy(torch.randn(3, 4))
        self.register_buffer("pe", table * 2)
        self.b = nn.Linear(4, 4)


FAMILIES = {
    "resnet18": lambda: torchvision.models.resnet18(num_classes=10),
    "unet": lambda: smp.Unet("resnet18", encoder_weights=None, in_channels=1, classes=2),  # torch.Tensor(n) inside
    "transformer": Encoder,
    # one layer built, then deep-copied into each of the model's layers (see [Note: copies of a module]); nn.Transformer
    # draws every weight again after its copies
    "torch_encoder": lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 4,
                                                   enable_nested_tensor=False),
    "torch_transformer": lambda: nn.Transformer(16, 4, 2, 2, 32, batch_first=True),
    "copies": Teacher,
    "copied_table": CopiedTable,
    "tied": Tied,
    "reads_values": ReadsValues,
    # converted in the construction: the buffers `.to` makes anew are the registered ones
    "tied_float64": lambda: Tied().double(),
    "bn_bfloat16": lambda: nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(torch.bfloat16),
    # weight_norm's `original1` is the very tensor it replaces, whose name is gone: it went to scratch, and a part's
    # `original1` held whatever the construction wrote there next
    "weight_norm": lambda: nn.Sequential(*[nn.utils.parametrizations.weight_norm(nn.Linear(6, 6)) for _ in range(4)]),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cut", [0.25, 0.75])
def test_a_part_holds_the_unsplit_values_and_nothing_else(family, cut):
    factory = FAMILIES[family]
    job = types.SimpleNamespace(model=factory, seed=7, source=family)
    torch.manual_seed(7)
    whole = factory()
    after_whole = torch.rand(3)  # what the global generator gives next (dropout masks, data order)
    values = {**dict(whole.named_parameters(remove_duplicate=False)), **dict(whole.named_buffers())}
    names = list(values)
    keep = set(names[int(len(names) * cut):])

    part = build_part(job, keep.__contains__)

    torch.testing.assert_close(torch.rand(3), after_whole, rtol=0, atol=0)
    got = {**dict(part.named_parameters(remove_duplicate=False)), **dict(part.named_buffers())}
    assert set(got) == set(names)
    for name in names:
        if name in keep:
            torch.testing.assert_close(got[name], values[name], rtol=0, atol=0, msg=name)
        elif not (family.startswith("tied") and name in ("emb.weight", "out.weight")):
            assert got[name].device.type == "meta", name
    assert {t.device.type for t in meta_model(job).parameters()} == {"meta"}


def test_a_construction_that_is_not_deterministic_is_refused():
    sizes = iter([4, 5])
    job = types.SimpleNamespace(model=lambda: nn.Linear(next(sizes), 2), seed=0, source="job.py")
    with pytest.raises(PartitionError, match="not deterministic"):
        build_part(job, lambda name: name == "bias")


def test_a_model_with_lazy_modules_is_refused_saying_what_to_give():
    job = types.SimpleNamespace(model=lambda: nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 2)), seed=0, source="job.py")
    with pytest.raises(PartitionError, match=r"tensors have no shape yet: 0.bias, 0.weight \(lazy modules.*Give them "
                                             r"their sizes"):
        build_part(job, lambda name: name.startswith("1."))
    warmed = nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 2))
    warmed(torch.zeros(1, 3))  # run once in the factory: shapes, and values drawn there
    job.model = lambda: copy.deepcopy(warmed)
    assert build_part(job, lambda name: name.startswith("0."))[0].weight.shape == (8, 3)
