"""The owner's side of the master's gradient policy between backward and optimizer step: the
global norm for clipping, the scaling it decides, and the gradients of a parameter that two
stages share (see [Note: a parameter shared by stages] in rpcmp/master/tied.py)."""
from __future__ import annotations

import torch
import torch.distributed.autograd as dist_autograd

from ..core.served import current
from .reduce import param_grads
from .stage import named_params

__all__ = ["grad_sq_norm", "shared_grad", "set_shared_grad", "scale_grads"]


def grad_sq_norm(pid: int, ctx_id: int, skip: tuple = ()) -> float:
    """Sum of squares of this process's parameter gradients in the context (for global clipping),
    leaving out the names in ``skip`` (copies of a shared parameter counted on another stage)."""
    params = {p: n for p, n in named_params(pid).items() if n not in skip}
    return float(sum(g.double().pow(2).sum() for g in param_grads(params, ctx_id).values()))


def shared_grad(pid: int, index: int, name: str, ctx_id: int) -> torch.Tensor | None:
    """Stage ``index``'s gradient of its parameter ``name`` in the context, or None (see [Note: a
    parameter shared by stages] in rpcmp/master/tied.py)."""
    param = current().host(pid, index).module.get_parameter(name)
    grad = dist_autograd.get_gradients(ctx_id).get(param)
    return None if grad is None else grad.detach().cpu()


def set_shared_grad(pid: int, index: int, name: str, ctx_id: int, value: torch.Tensor) -> None:
    param = current().host(pid, index).module.get_parameter(name)
    dist_autograd.get_gradients(ctx_id)[param].copy_(value)


def scale_grads(pid: int, ctx_id: int, scale: float) -> None:
    for g in param_grads(named_params(pid), ctx_id).values():
        g.mul_(scale)
