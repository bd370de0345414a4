"""A segmentation_models_pytorch Unet split into encoder / decoder / segmentation head.

    rpcmp run examples/unet_split/job.py --local 3         # 3 processes on this machine
    rpcmp plan examples/unet_split/job.py                  # the partition, no processes

With three processes and placement "auto", the encoder runs on worker1, the decoder
on worker2 and the segmentation head on the master, next to the loss.
"""
import segmentation_models_pytorch as smp
import torch
import torch.nn.functional as F

import rpcmp
from data import datasets


def build_model():
    return smp.Unet("resnet34", encoder_weights=None, in_channels=1, classes=1)


def dice_bce_loss(logits, mask):
    prob = torch.sigmoid(logits)
    inter = (prob * mask).sum((1, 2, 3))
    dice = (2 * inter + 1) / (prob.sum((1, 2, 3)) + mask.sum((1, 2, 3)) + 1)
    return F.binary_cross_entropy_with_logits(logits, mask) + (1 - dice).mean()


def dice_score(logits, mask):
    pred = (logits > 0).float()
    inter = (pred * mask).sum((1, 2, 3))
    return ((2 * inter + 1) / (pred.sum((1, 2, 3)) + mask.sum((1, 2, 3)) + 1)).mean().item()


job = rpcmp.Job(
    model=build_model,
    stages=["encoder", "decoder", "segmentation_head"],
    placement="auto",
    data=datasets,
    loss=dice_bce_loss,
    metric=dice_score,
    metric_name="Dice",
    optimizer=(torch.optim.Adam, {"lr": 1e-3}),
    batch_size=16,
    microbatches=4,
    # Pipeline the 4 micro-batches, each normalised by its own BatchNorm statistics (as GPipe
    # does). The default, batchnorm="batch", keeps whole-batch statistics exactly by running
    # each batch as one micro-batch (see [Note: BatchNorm and micro-batches] in rpcmp/master/pipeline.py).
    batchnorm="micro",
    epochs=3,
)
