"""The smp Unet cut with SplitAt inside its encoder: the encoder's skip features cross stages."""
import segmentation_models_pytorch as smp
import torch
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp


def unet():
    return smp.Unet("resnet18", encoder_weights=None, in_channels=1, classes=1)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(32, 1, 32, 32, generator=g)
    return TensorDataset(x, (x > 0.5).float()), None


job = rpcmp.Job(model=unet, stages=rpcmp.SplitAt("encoder.layer3", "decoder"), data=data, batch_size=8,
                microbatches=2, loss=nn.functional.binary_cross_entropy_with_logits,
                optimizer=(torch.optim.SGD, {"lr": 0.05}))
