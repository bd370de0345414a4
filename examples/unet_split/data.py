"""A synthetic segmentation set: bright and dark shapes on noisy, shaded backgrounds.

The mask is the union of the shapes, so a network must learn shape, not just
brightness (some shapes are darker than the background). Deterministic per seed.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["make_shapes", "datasets"]


def make_shapes(n: int, size: int = 64, seed: int = 0) -> TensorDataset:
    """``n`` images of shape (1, size, size) in [0, 1] and their (1, size, size) masks."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    images = np.empty((n, 1, size, size), np.float32)
    masks = np.zeros((n, 1, size, size), np.float32)
    for i in range(n):
        gx, gy = rng.uniform(-0.3, 0.3, 2)
        img = 0.5 + gx * (xx - 0.5) + gy * (yy - 0.5)
        mask = np.zeros((size, size), bool)
        for _ in range(rng.integers(1, 4)):
            cx, cy = rng.uniform(0.15, 0.85, 2)
            r = rng.uniform(0.07, 0.2)
            if rng.random() < 0.5:
                shape = (xx - cx) ** 2 + (yy - cy) ** 2 < r ** 2
            else:
                shape = (abs(xx - cx) < r) & (abs(yy - cy) < r * rng.uniform(0.4, 1.0))
            img = np.where(shape, img + rng.choice([-1, 1]) * rng.uniform(0.25, 0.45), img)
            mask |= shape
        img += rng.normal(0, 0.12, (size, size))
        images[i, 0] = np.clip(img, 0, 1)
        masks[i, 0] = mask
    return TensorDataset(torch.from_numpy(images), torch.from_numpy(masks))


def datasets(train: int = 512, heldout: int = 128, size: int = 64):
    """(train, held-out) sets drawn with different seeds."""
    return make_shapes(train, size, seed=1), make_shapes(heldout, size, seed=2)
