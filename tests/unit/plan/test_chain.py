"""Stages given by name are the model's forward, or refused with what forward does beyond the chain."""
import pytest
import segmentation_models_pytorch as smp
import torch
import torchvision
from torch import nn
from torch.nn import functional as F

import rpcmp
from rpcmp.errors import PartitionError
from rpcmp.plan.partition import plan_stages


class Classifier(nn.Module):  # the classic: a functional activation in forward
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.inner(x)
        return self.outer(h) + h


class Skip(nn.Module):  # the second child also reads the model's input
    def __init__(self):
        super().__init__()
        self.down, self.up = nn.Linear(16, 16), nn.Bilinear(16, 16, 16)

    def forward(self, x):
        return self.up(self.down(x), x)


class Chain(nn.Module):  # forward is exactly its children, one after another
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.b(self.a(x))


def _plan(model, stages, x=torch.randn(4, 16)):
    return plan_stages(rpcmp.Job(model=model, stages=stages), x)


def test_a_functional_op_in_forward_is_refused_with_its_name_and_place():
    with pytest.raises(PartitionError, match=r"Classifier.forward applies torch.relu \(from `return self.fc2\(F.relu\("
                                             r"self.fc1\(x\)\)\)`, test_chain.py line \d+\) between fc1 and fc2; a chain "
                                             r"of children leaves it out. Cut the traced model instead.*rpcmp.SplitAt"):
        _plan(Classifier, ["fc1", "fc2"])


def test_resnets_flatten_is_refused():
    resnet = lambda: torchvision.models.resnet18(num_classes=10)  # noqa: E731
    stages = [["conv1", "bn1", "relu", "maxpool", "layer1"], ["layer2", "layer3"], ["layer4", "avgpool", "fc"]]
    with pytest.raises(PartitionError, match=r"ResNet.forward applies torch.flatten .* between avgpool and fc"):
        _plan(resnet, stages, torch.randn(2, 3, 32, 32))


def test_a_residual_add_and_a_skip_connection_are_refused():
    with pytest.raises(PartitionError, match=r"Residual.forward applies torch.add .* after outer"):
        _plan(Residual, ["inner", "outer"])
    with pytest.raises(PartitionError, match=r"Skip.forward passes the model's input to 'up' \(a residual or skip connection\)"):
        _plan(Skip, ["down", "up"])


class ByKeyword(Chain):
    def forward(self, x):
        return self.b(input=self.a(x))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x, mask=None, scale=1.0):
        return self.lin(x) * scale


class WithDefaults(nn.Module):  # a child handed its defaults as well: the chain's call hands it the same
    def __init__(self, scale=1.0):
        super().__init__()
        self.a, self.b, self.scale = nn.Linear(16, 16), Scaled(), scale

    def forward(self, x):
        return self.b(self.a(x), mask=None, scale=self.scale)


def test_a_chain_that_is_forward_is_accepted():
    assert [s.name for s in _plan(Chain, ["a", "b"])] == ["a", "b"]
    assert len(_plan(ByKeyword, ["a", "b"])) == 2  # the output before handed whole, by keyword
    assert len(_plan(WithDefaults, ["a", "b"])) == 2  # and arguments equal to their defaults
    unet = lambda: smp.Unet("resnet18", encoder_weights=None, in_channels=1, classes=1)  # noqa: E731
    assert len(_plan(unet, ["encoder", ["decoder", "segmentation_head"]], torch.randn(2, 1, 64, 64))) == 2
    seq = lambda: nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))  # noqa: E731
    assert len(_plan(seq, [["0", "1"], "2"])) == 2  # an nn.Sequential's forward is its chain: no tracing


class Recurrent(nn.Module):  # nn.LSTM returns (output, (h, c)): forward takes the output alone
    def __init__(self, last: bool = False):
        super().__init__()
        self.emb, self.rnn, self.head, self.last = nn.Embedding(10, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 3), last

    def forward(self, x):
        return self.rnn(self.emb(x))[0] if self.last else self.head(self.rnn(self.emb(x))[0])


def test_a_child_handed_a_part_of_the_output_before_is_refused():
    """Picking an element of a child's output is no operation in the graph: the chain passed rnn's whole tuple to
    head, and the first step failed inside the stage (`linear(): argument 'input' must be Tensor, not tuple`)."""
    x = torch.randint(0, 10, (2, 5))
    with pytest.raises(PartitionError, match=r"Recurrent.forward calls 'head' with a tensor, not with the output of "
                                             r"'rnn' whole \(tuple of 2\): a part of it"):
        _plan(Recurrent, ["emb", "rnn", "head"], x)
    with pytest.raises(PartitionError, match=r"Recurrent.forward returns a tensor, not the output of 'rnn' whole"):
        _plan(lambda: Recurrent(last=True), ["emb", "rnn"], x)
    with pytest.raises(PartitionError, match=r"WithDefaults.forward calls 'b' with 2 arguments \(x, scale\)"):
        _plan(lambda: WithDefaults(scale=2.0), ["a", "b"])  # more than the output before: a chain would leave it out


def test_a_model_that_cannot_be_traced_is_refused_with_the_fix():
    class DataDependent(Chain):
        def forward(self, x):
            return self.b(self.a(x)) if x.sum() > 0 else self.a(x)

    with pytest.raises(PartitionError, match=r"cannot check that DataDependent.forward is the chain \['a', 'b'\]: "
                                             r"tracing it with torch.export failed .*Declare the stages as modules"):
        _plan(DataDependent, ["a", "b"])
