"""Job files for the benchmarks: each process of a run imports one of these."""
import segmentation_models_pytorch as smp
import torch
import torch.distributed.rpc as rpc
from torch import nn


def mlp():
    layers = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers)


def unet():
    return smp.Unet("resnet34", encoder_weights=None, in_channels=1, classes=1)


def mse(out, y):
    return nn.functional.mse_loss(out, y)


def bce(out, y):
    return nn.functional.binary_cross_entropy_with_logits(out, y)


class UnetStage(nn.Module):
    """One part of the seeded Unet as a torch.distributed.pipelining stage: tensors in, tensors out
    (the encoder's list of features travels as a tuple)."""

    def __init__(self, name):
        super().__init__()
        torch.manual_seed(0)
        self.name, self.part = name, getattr(unet(), name)

    def forward(self, *x):
        for t in x:  # gloo receives into contiguous buffers; grads out of torch.cat are views
            if t.requires_grad:
                t.register_hook(torch.Tensor.contiguous)
        if self.name == "encoder":
            return tuple(self.part(*x))
        return self.part(list(x)) if self.name == "decoder" else self.part(*x)


class Part(nn.Module):
    """One named part of the seeded Unet, for the hand-written RemoteModule baseline."""

    def __init__(self, name):
        super().__init__()
        torch.manual_seed(0)
        self.part = getattr(unet(), name)

    def forward(self, x):
        return self.part(x)


SGD = (torch.optim.SGD, {"lr": 0.01})


# A chain of identity hops without rpcmp, for the per-hop floor: master -> worker1 -> ... ->
# workerN -> master with nested async RPCs, as rpcmp's stages forward to each other.
CHAIN = {}


@rpc.functions.async_execution
def chain_forward(k: int, last: int, x: torch.Tensor) -> torch.futures.Future:
    y = x * 1.0
    if k < last:
        return rpc.rpc_async(f"worker{k + 1}", chain_forward, args=(k + 1, last, y))
    return rpc.rpc_async("master", chain_deliver, args=(y,))


def chain_deliver(y: torch.Tensor) -> None:
    CHAIN["out"].set_result(y)
