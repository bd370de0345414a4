"""``rpcmp predict``: a trained checkpoint on the job's held-out data.

    rpcmp predict examples/unet_split/job.py -c runs/unet            # the unsplit model, here
    rpcmp predict examples/unet_split/job.py -c runs/unet --local 3  # split over 3 processes

Writes ``predictions.pt`` (every output, in data order) and, for image data, PNG panels
of input | truth | prediction side by side; prints the job's metric when it has one.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import numpy as np
import torch

from ..core import health
from ..core.served import RunStatus
from ..core.checkpoint import check_model_keys, load_checkpoint
from ..errors import JobError
from ..core.microbatch import batch_size, gather
from ..data import data_loader

__all__ = ["predict_local", "predict_split", "write_predictions", "panel"]


def predict_local(job, checkpoint: str, out_dir: str, images: int) -> dict[str, Any]:
    """Load the consolidated checkpoint into the unsplit model and predict in this process."""
    from ..plan.materialize import build_whole
    ckpt = load_checkpoint(checkpoint)
    model = build_whole(job)
    check_model_keys(ckpt, model.state_dict(), f"the model of {job.source}")
    model.load_state_dict(ckpt["model"], strict=True)
    model.eval()
    with torch.no_grad():
        return {"checkpoint": ckpt["path"], **write_predictions(job, model, out_dir, images)}


def predict_split(job, world_size: int, checkpoint: str, out_dir: str, images: int) -> dict[str, Any]:
    """The same through the job's stages on ``world_size`` processes (run as the master)."""
    from rich.console import Console
    from ..master.replicas import pipeline_for
    from .trainer import building_stages
    ckpt = load_checkpoint(checkpoint)
    status = RunStatus(task=f"predicting with {ckpt['path']}")
    with building_stages(job, Console()):
        pipe = pipeline_for(job, world_size, status=status)  # with replicas, each copy predicts a share
    try:
        with health.explained(pipe.explain):
            check_model_keys(ckpt, pipe.state_meta(), f"the model of {job.source}")
            pipe.load_files(ckpt["files"], optimizer=False)  # each owner reads its own keys, weights only
            pipe.eval()
            result = {"checkpoint": ckpt["path"], **write_predictions(job, pipe.predict, out_dir, images)}
    except BaseException:
        with contextlib.suppress(Exception):  # a lost worker fails the release too: keep the first error
            pipe.close()
        raise
    pipe.close()
    return result


def write_predictions(job, forward: Callable[[Any], Any], out_dir: str, images: int) -> dict[str, Any]:
    if job.data is None:
        raise JobError("rpcmp predict needs Job(data=...) returning (train, heldout): it predicts the held-out set")
    train, heldout = job.data()
    dataset, which = (heldout, "held-out") if heldout is not None else (train, "training")
    os.makedirs(out_dir, exist_ok=True)
    outputs, total, count, pngs = [], 0.0, 0, []
    for x, y in data_loader(dataset, batch_size=job.batch_size, collate_fn=job.collate):
        out = forward(x)
        outputs.append(out)
        n = batch_size(x)
        if job.metric is not None:
            total += float(job.metric(out, y)) * n
        for i in range(min(n, images - len(pngs))):
            image = panel(x[i], y[i], out[i]) if _is_image(x) and _is_image(out) else None
            if image is not None:
                path = os.path.join(out_dir, f"sample-{count + i:04d}.png")
                _save_png(image, path)
                pngs.append(path)
        count += n
    path = os.path.join(out_dir, "predictions.pt")
    torch.save(gather(outputs), path)
    return {"samples": count, "dataset": which, "predictions": path, "images": pngs, "metric_name": job.metric_name,
            "metric": total / count if job.metric is not None and count else None}


def panel(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> np.ndarray:
    """Input | truth | prediction as one RGB uint8 image. ``x``: (C, H, W); ``y``: a (1, H, W)
    mask, (H, W) class indices or (K, H, W) one-hot; ``out``: (K, H, W) logits, shown as
    sigmoid > 0.5 for K = 1 and argmax for more. Small images are scaled up to >= 128 px."""
    classes = out.shape[0] if out.dim() == 3 else 1
    parts = [_gray_or_rgb(_unit(x)), _gray_or_rgb(_labels(y, classes)), _gray_or_rgb(_labels(out, classes, logits=True))]
    h = max(p.shape[0] for p in parts)
    sep = np.full((h, 2, 3), 255, np.uint8)
    row = np.concatenate([parts[0], sep, parts[1], sep, parts[2]], axis=1)
    scale = max(1, 128 // h)
    return row.repeat(scale, 0).repeat(scale, 1)


def _is_image(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 4


def _unit(t: torch.Tensor) -> torch.Tensor:
    t = t.float()
    lo, hi = t.min(), t.max()
    return (t - lo) / (hi - lo) if hi > lo else torch.zeros_like(t)


def _labels(t: torch.Tensor, classes: int, logits: bool = False) -> torch.Tensor:
    """As a (1, H, W) image in [0, 1]: a mask or a sigmoid > 0.5 for one class; class
    indices, one-hot maps or argmax of logits over (classes - 1) for several."""
    t = t.float()
    if t.dim() == 2:  # (H, W) class indices
        return (t / max(classes - 1, 1))[None]
    if t.shape[0] == 1:
        if logits:
            return (torch.sigmoid(t) > 0.5).float()
        return t.clamp(0, 1) if classes == 1 else t / max(classes - 1, 1)
    return t.argmax(0, keepdim=True).float() / max(t.shape[0] - 1, 1)


def _gray_or_rgb(t: torch.Tensor) -> np.ndarray:
    t = t[:3] if t.shape[0] >= 3 else t[:1].expand(3, *t.shape[1:])
    return (t.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy()


def _save_png(image: np.ndarray, path: str) -> None:
    from PIL import Image
    Image.fromarray(image).save(path)
