import segmentation_models_pytorch as smp
import torch

import rpcmp


def build():
    return smp.Unet("resnet18", encoder_weights=None, in_channels=1, classes=1)


def loss(out, y):
    return torch.nn.functional.binary_cross_entropy_with_logits(out, y)


job = rpcmp.Job(model=build, stages=["encoder", "decoder", "segmentation_head"], batch_size=4, data=lambda: data(),
                microbatches=2, optimizer=(torch.optim.SGD, {"lr": 0.05}), loss=loss)


def data():
    g = torch.Generator().manual_seed(4)
    x = torch.rand(8, 1, 64, 64, generator=g)
    return torch.utils.data.TensorDataset(x, (x > 0.5).float()), None
