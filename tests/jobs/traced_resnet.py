"""torchvision's ResNet-18 (flatten, residual adds, BatchNorm) cut on the traced graph with SplitAt."""
import torch
import torchvision
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp


def resnet():
    return torchvision.models.resnet18(num_classes=10)


def data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)), None


job = rpcmp.Job(model=resnet, stages=rpcmp.SplitAt("layer2", "layer4"), data=data, batch_size=8, microbatches=2,
                loss=nn.functional.cross_entropy, optimizer=(torch.optim.SGD, {"lr": 0.05}))
