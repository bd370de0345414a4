import segmentation_models_pytorch as smp
import torch

import rpcmp


def build():
    return smp.Unet("resnet18", encoder_weights=None, in_channels=1, classes=1)


def loss(out, y):
    return torch.nn.functional.binary_cross_entropy_with_logits(out, y)


job = rpcmp.Job(model=build, stages=["encoder", "decoder", "segmentation_head"], batch_size=4,
                microbatches=2, optimizer=(torch.optim.SGD, {"lr": 0.05}), loss=loss)
