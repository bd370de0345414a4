"""BatchNorm under micro-batching: ``Job(batchnorm="batch" | "micro")``.

[Note: BatchNorm and micro-batches]
A BatchNorm layer in training mode normalises with the statistics of the batch it
sees. Split into M micro-batches, it would see M smaller batches, so outputs,
gradients and running statistics would all depend on M.

``batchnorm="batch"`` (the default) keeps the whole-batch result exactly: a model
with BatchNorm runs each training batch as one micro-batch. There is no cheaper exact
way: the first sample's output of a BatchNorm layer depends on every sample's input to
it, and its backward on every sample's gradient, so no micro-batch can pass a
BatchNorm layer (either way) before all have reached it; a stage holding one cannot
overlap with its neighbours. Results then do not depend on M and equal the unsplit
model's (tested).

``batchnorm="micro"`` pipelines M micro-batches, each normalised with its own
statistics (as GPipe does), while the running statistics are those of the whole
batch, committed once per batch (torchgpipe's deferred batch norm): evaluation uses
the same running mean and variance whatever M (exactly so for the first BatchNorm
layer; later ones see inputs that went through micro-batch normalisation).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["DeferredBatchNorm", "has_batchnorm", "defer_batchnorm"]


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Mixed into a BatchNorm class by :func:`defer_batchnorm`: BatchNorm that normalises each micro-batch with its own statistics and updates the
    running statistics once per batch, from the sums over all its micro-batches.

    Same parameters, buffers and ``state_dict`` keys as the layer it replaces.
    """

    def _reset_sums(self) -> None:
        self._sum = self._sum_sq = None
        self._count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.track_running_stats):
            return super().forward(x)
        self._check_input_dim(x)
        if torch.is_grad_enabled():  # a training forward (not a prediction in train mode)
            self._track(x.detach())
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def _track(self, x: torch.Tensor) -> None:
        dims = [0] + list(range(2, x.dim()))
        x = x.double()
        s, sq = x.sum(dims), x.pow(2).sum(dims)
        if getattr(self, "_sum", None) is None:
            self._sum, self._sum_sq, self._count = s, sq, 0
        else:
            self._sum, self._sum_sq = self._sum + s, self._sum_sq + sq
        self._count += x.numel() // x.size(1)

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the sums of the batch's micro-batches into the running statistics, as
        ``nn.BatchNorm*`` does for one whole batch; then start the next batch."""
        if getattr(self, "_sum", None) is None or self._count < 2:
            self._reset_sums()
            return
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        mean = self._sum / self._count
        var = (self._sum_sq / self._count - mean.pow(2)).clamp_min(0) * (self._count / (self._count - 1))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype), alpha=factor)
        self._reset_sums()


def defer_batchnorm(module: nn.Module) -> list[DeferredBatchNorm]:
    """Turn every BatchNorm layer of ``module`` into a :class:`DeferredBatchNorm` in place
    (the same parameter and buffer tensors); return them, for :meth:`~DeferredBatchNorm.commit`."""
    found = []
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats \
                and not isinstance(m, (nn.SyncBatchNorm, DeferredBatchNorm)):
            cls = type(m)
            if cls not in _DEFERRED:
                _DEFERRED[cls] = type(f"Deferred{cls.__name__}", (DeferredBatchNorm, cls), {})
            m.__class__ = _DEFERRED[cls]
            m._reset_sums()
            found.append(m)
    return found


_DEFERRED: dict[type, type] = {}  # BatchNorm1d -> DeferredBatchNorm1d, ... (the layer's own input check stays)
