"""Checkpoints: one file per save, the same format in every mode and under every split.

A checkpoint holds the **consolidated** state of the unsplit model (it loads into the
plain model with ``load_state_dict(strict=True)``), the optimizer state keyed by
parameter *name* (so it can be restored under another split or placement), the
training position (step, epoch, batch within the epoch, seed), every process's RNG state
(restored when each process holds the same stages again, so dropout resumes exactly)
and the fp16 loss scale.

In pipeline mode each stage's owner also writes ``step-NNNNNNNN.stage-K.pt`` beside it,
on its own node: that stage's parameters and buffers (keys of the stage module, loadable
into it with ``strict=True``), its optimizer state and the step. They are written
before the consolidated file, whose presence marks a complete checkpoint; resuming reads
the consolidated file, so it works under any split.

Writes are atomic: the file is written beside its final name, flushed to disk and then
renamed, so a crash or a full disk during a save never damages an earlier checkpoint.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
from typing import Any

import torch

from .errors import RpcmpError

__all__ = ["CheckpointError", "save_checkpoint", "save_stage_file", "load_checkpoint", "latest_checkpoint",
           "check_model_keys"]

FORMAT = "rpcmp-checkpoint/1"
STAGE_FORMAT = "rpcmp-stage/1"
_NAME = re.compile(r"step-(\d+)\.pt$")


class CheckpointError(RpcmpError, ValueError):
    """A checkpoint cannot be written, read, or does not fit the model."""


def save_checkpoint(directory: str, payload: dict[str, Any], step: int, keep_last: int = 2) -> str:
    """Write ``payload`` as ``directory/step-NNNNNNNN.pt`` atomically; keep the newest ``keep_last``."""
    path = _atomic_save(directory, f"step-{step:08d}.pt", {"format": FORMAT, **payload})
    for old in _checkpoints(directory)[:-keep_last] if keep_last > 0 else []:
        os.remove(old)
    return path


def save_stage_file(directory: str, index: int, payload: dict[str, Any], step: int, keep_last: int = 2) -> str:
    """Write one stage's ``directory/step-NNNNNNNN.stage-K.pt`` (on its owner); keep the newest ``keep_last``."""
    path = _atomic_save(directory, f"step-{step:08d}.stage-{index}.pt", {"format": STAGE_FORMAT, **payload})
    pattern = re.compile(rf"step-(\d+)\.stage-{index}\.pt$")
    found = sorted((int(m.group(1)), p) for p in glob.glob(os.path.join(directory, f"step-*.stage-{index}.pt"))
                   if (m := pattern.search(p)))
    for _, old in found[:-keep_last] if keep_last > 0 else []:
        os.remove(old)
    return path


def _atomic_save(directory: str, name: str, payload: dict[str, Any]) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        free = shutil.disk_usage(directory).free
        if os.path.exists(tmp):
            os.remove(tmp)
        previous = latest_checkpoint(directory)
        raise CheckpointError(
            f"writing checkpoint {path} failed after {written / 2**20:.1f} MiB with {free / 2**20:.1f} MiB "
            f"left on that disk: {type(exc).__name__}: {exc}; the previous checkpoint "
            f"{previous or '(none)'} is intact. Free space in {directory} or point --checkpoint-dir "
            f"elsewhere, then resume"
        ) from exc
    return path


def latest_checkpoint(directory: str) -> str | None:
    found = _checkpoints(directory)
    return found[-1] if found else None


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read a checkpoint file (or the latest one in a directory) with clear errors."""
    if os.path.isdir(path):
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"no checkpoint (step-*.pt) in {path}: train with --checkpoint-dir {path} first")
        path = latest
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise CheckpointError(
            f"checkpoint {path} is truncated or not a checkpoint ({type(exc).__name__}: {exc}); "
            f"delete it to resume from the one before"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an rpcmp checkpoint (expected format {FORMAT!r})")
    payload["path"] = path
    return payload


def check_model_keys(checkpoint: dict[str, Any], model_keys, what: str = "the model") -> None:
    """Raise unless the checkpoint's model state has exactly ``model_keys``, with the difference."""
    have, want = set(checkpoint["model"]), set(model_keys)
    if have != want:
        missing, unexpected = sorted(want - have), sorted(have - want)
        raise CheckpointError(
            f"checkpoint {checkpoint.get('path', '')} is from another model than {what}: "
            f"{len(missing)} missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"{len(unexpected)} unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    mismatched = [k for k in want if checkpoint["model"][k].shape != model_keys[k].shape] \
        if isinstance(model_keys, dict) else []
    if mismatched:
        raise CheckpointError(f"checkpoint {checkpoint.get('path', '')} has other shapes for {sorted(mismatched)[:5]}")


def _checkpoints(directory: str) -> list[str]:
    paths = [p for p in glob.glob(os.path.join(directory, "step-*.pt")) if _NAME.search(p)]
    return sorted(paths, key=lambda p: int(_NAME.search(p).group(1)))
