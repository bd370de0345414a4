"""The MLP job's data on a model whose output holds each sample against every other of its batch (in-batch
negatives, CLIP's logits) and a contrastive loss: its batches run whole, as the unsplit model computes them."""
import dataclasses

import torch
from torch import nn

import rpcmp
from mlp import job as mlp_job


class Similarity(nn.Module):
    def forward(self, z):
        return z @ z.t()


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), Similarity())


def in_batch_negatives(out, y):
    return nn.functional.cross_entropy(out, torch.arange(len(out)))


def accuracy(out, y):
    return (out.argmax(1) == torch.arange(len(out))).float().mean().item()


job = dataclasses.replace(mlp_job, model=model, stages=rpcmp.Split([2, 2]), loss=in_batch_negatives, metric=accuracy,
                          metric_name="accuracy", microbatches=4)
