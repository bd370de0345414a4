"""Checkpoints: one file per save, the same format in every mode and under every split.

A checkpoint holds the **consolidated** state of the unsplit model (it loads into the
plain model with ``load_state_dict(strict=True)``), the optimizer state keyed by
parameter *name* (so it can be restored under another split or placement), the
training position (step, epoch, batch within the epoch, seed), every process's RNG state
(restored when each process holds the same stages again, so dropout resumes exactly)
and the fp16 loss scale.

Every run has an id (``Job`` runs get a fresh one; ``--resume`` continues the run it
resumes), written into the file name, ``step-NNNNNNNN.RUN.pt``, and the payload with the
model's key fingerprint. ``keep_last`` prunes the current run's files only, so a folder
reused by another run keeps that run's checkpoints; "the latest checkpoint" of a folder
is the one written last, whatever its run.

[Note: a checkpoint nobody holds whole]
In pipeline mode no process holds the whole model (see [Note: each owner materializes
only its part]), so none writes it whole: each stage's owner writes its part,
``step-NNNNNNNN.RUN.stage-K.pt`` (that stage's parameters and buffers, keys of the stage
module with the ``prefix`` that makes them the unsplit model's, its optimizer state keyed
by the unsplit parameter names), from its live tensors, without a copy. Then the master
writes ``step-NNNNNNNN.RUN.pt``, the *index*: everything of the format above except the
tensors, plus the names of the parts. The index is written last, so its presence marks a
complete checkpoint. :func:`load_checkpoint` reads an index and its parts as one
consolidated checkpoint, memory-mapped (``torch.load(mmap=True)``: pages are read when
touched), so a reader that wants some keys reads those only: on ``--resume`` each owner
reads its own keys from the parts of any split, and the master reads none. Parts are
written on each owner's node, in the same folder: the folder must be shared between the
nodes (or the parts copied into one) to resume under another placement or to
``rpcmp export`` the whole model as one plain ``torch.save`` file. ``torch.distributed.checkpoint``
solves the same problem for collectives-based training (one process group, a planner,
resharding); its loader needs every rank in one group, which RPC stages are not, so
rpcmp keeps its own small format of plain ``torch.save`` files.

Writes are atomic: the file is written beside its final name, flushed to disk, renamed,
and the directory is flushed before any older file is pruned, so a crash or a full disk
during a save never damages an earlier checkpoint. Files are read with
``torch.load(weights_only=True)``: a file planted in the folder cannot run code.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import uuid
from typing import Any

import torch

from ..errors import CheckpointError, CheckpointWriteError

__all__ = ["CheckpointError", "CheckpointWriteError", "save_checkpoint", "save_stage_file", "load_checkpoint",
           "read_part", "read_state_file", "export_model", "latest_checkpoint", "check_model_keys", "new_run_id",
           "model_fingerprint", "complete_stems", "remove_incomplete", "fill_tied"]

FORMAT = "rpcmp-checkpoint/1"
STAGE_FORMAT = "rpcmp-stage/1"
# step-NNNNNNNN[.RUN].pt and step-NNNNNNNN[.RUN].stage-K.pt (files of rpcmp before run ids have no RUN)
_NAME = re.compile(r"^step-(\d+)(?:\.([0-9a-f]+))?\.pt$")
_STAGE_NAME = re.compile(r"^step-(\d+)(?:\.([0-9a-f]+))?\.stage-(\d+)\.pt$")


def new_run_id() -> str:
    """A fresh run id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def model_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """A digest of a state dict's keys, shapes and dtypes: equal for the same model, whatever its values."""
    text = "\n".join(f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in sorted(state.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _stem(step: int, run: str | None) -> str:
    return f"step-{step:08d}" + (f".{run}" if run else "")


def save_checkpoint(directory: str, payload: dict[str, Any], step: int, keep_last: int = 2,
                    run: str | None = None) -> str:
    """Write ``payload`` as ``directory/step-NNNNNNNN.RUN.pt`` atomically; keep run ``run``'s newest ``keep_last``."""
    path = _atomic_save(directory, _stem(step, run) + ".pt", {"format": FORMAT, "run": run, **payload})
    _prune([p for s, r, p in _checkpoints(directory) if r == run], keep_last)
    return path


def save_stage_file(directory: str, index: int, payload: dict[str, Any], step: int, keep_last: int = 2,
                    run: str | None = None) -> str:
    """Write one stage's ``directory/step-NNNNNNNN.RUN.stage-K.pt`` (on its owner); keep run ``run``'s newest ``keep_last``."""
    path = _atomic_save(directory, f"{_stem(step, run)}.stage-{index}.pt",
                        {"format": STAGE_FORMAT, "run": run, **payload})
    found = sorted((int(m.group(1)), os.path.join(directory, f)) for f in os.listdir(directory)
                   if (m := _STAGE_NAME.match(f)) and m.group(2) == run and int(m.group(3)) == index)
    _prune([p for _, p in found], keep_last)
    return path


def _prune(paths: list[str], keep_last: int) -> None:
    for old in paths[:-keep_last] if keep_last > 0 else []:
        os.remove(old)


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
        _fsync_dir(directory)  # the rename is on disk before any older checkpoint is pruned
    except BaseException as exc:
        written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        free = shutil.disk_usage(directory).free  # before the partial file is removed: what the write left
        if os.path.exists(tmp):
            os.remove(tmp)
        cause = _os_error(exc)
        if cause is None:
            raise  # a pickling error, Ctrl-C: reported as what it is
        previous = latest_checkpoint(directory)
        full = cause.errno in (errno.ENOSPC, errno.EDQUOT)
        raise CheckpointWriteError(
            f"writing checkpoint {path} failed after {written / 2**20:.1f} MiB with {free / 2**20:.1f} MiB "
            f"left on that disk: {type(cause).__name__}: {cause}; the previous checkpoint {previous or '(none)'} is intact. "
            + (f"Free space in {directory} or point --checkpoint-dir elsewhere, then resume" if full
               else "Check that the directory is writable and its device healthy, then resume")
        ) from exc
    return path


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``, if any (torch.save's zip writer re-raises a failed write as
    a RuntimeError while closing the file)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(directory: str, run: str | None = None) -> str | None:
    """The consolidated checkpoint written last in ``directory`` (of run ``run`` if given, else of
    whichever run), or None."""
    found = [f for f in _checkpoints(directory) if run is None or f[1] == run]
    if not found:
        return None
    return max(found, key=lambda f: (os.stat(f[2]).st_mtime_ns, f[0]))[2]


def complete_stems(directory: str) -> set[str]:
    """The names (without ``.pt``) of the complete checkpoints in ``directory``: those whose index exists."""
    return {os.path.basename(p)[:-3] for _, _, p in _checkpoints(directory)}


def remove_incomplete(directory: str, complete: set[str]) -> list[tuple[str, int]]:
    """Remove what an interrupted save left in ``directory``: files written half (``*.pt.tmp``) and
    stage parts of a checkpoint whose index is not among ``complete`` (the stems of the master's
    folder, which holds every index, also when this folder is another node's). Returns (name, bytes)
    of each file removed. [Note: what a killed save leaves] A process killed while it saves leaves
    its ``.tmp``; a master killed between the parts and the index leaves parts that no index names
    (a part can be hundreds of MiB), and nothing would ever read or prune them (pruning counts the
    parts of complete steps). A run removes them when it starts, before its first save; two jobs
    writing into one folder at the same time are not supported."""
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in sorted(os.listdir(directory)):
        part = _STAGE_NAME.match(name)
        stale = (name.endswith(".pt.tmp") and name.startswith("step-")) or (
            part is not None and name[:name.rindex(".stage-")] not in complete)
        if stale:
            path = os.path.join(directory, name)
            try:
                size = os.path.getsize(path)
                os.remove(path)
            except FileNotFoundError:
                continue
            removed.append((name, size))
    return removed


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read a checkpoint file (or the latest one in a directory) with clear errors; an index
    comes back with its parts' model and optimizer state, memory-mapped (see [Note: a checkpoint
    nobody holds whole]). ``files`` lists the files that hold its tensors."""
    if os.path.isdir(path):
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"no checkpoint (step-*.pt) in {path}: train with --checkpoint-dir {path} first")
        path = latest
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    payload = _read(path)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an rpcmp checkpoint (expected format {FORMAT!r})")
    payload["path"] = path
    payload["files"] = [path]
    if "parts" in payload:
        _join_parts(payload)
    return payload


def export_model(checkpoint: str, out: str) -> tuple[str, int, int]:
    """Write the model of ``checkpoint`` (an index's parts, memory-mapped) to ``out`` as a plain
    ``torch.save(state_dict)`` file, atomically; returns (checkpoint read, tensors, bytes)."""
    ckpt = load_checkpoint(checkpoint)
    folder, name = os.path.split(os.path.abspath(out))
    _atomic_save(folder, name, ckpt["model"])
    return ckpt["path"], len(ckpt["model"]), sum(t.nbytes for t in ckpt["model"].values())


def read_state_file(path: str) -> dict[str, torch.Tensor]:
    """A model's values from ``path``, memory-mapped: a plain ``state_dict`` file (``torch.save(model.state_dict())``)
    or an rpcmp checkpoint (its model)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"initial values file {path} does not exist: give a torch.save(model.state_dict()) file")
    payload = _read(path)
    if payload.get("format") == FORMAT:
        return load_checkpoint(path)["model"]
    if not payload or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in payload.items()):
        raise CheckpointError(f"{path} is not a state_dict (a dict of names to tensors) nor an rpcmp checkpoint: "
                              f"write it with torch.save(model.state_dict(), path)")
    return payload


def fill_tied(state: dict[str, torch.Tensor], aliases: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """``state`` with each name of ``aliases`` it lacks taken from another name of the same tensor that it holds: a
    tied weight written once, as Hugging Face's ``save_pretrained`` writes ``lm_head.weight`` (under its embedding's)."""
    out = dict(state)
    out.update({k: out[next(a for a in others if a in out)] for k, others in aliases.items()
                if k not in out and any(a in out for a in others)})
    return out


def read_part(path: str) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The model state (keyed as in the unsplit model) and optimizer state (by parameter name)
    that one checkpoint file holds, memory-mapped: a consolidated file, or a stage's part."""
    payload = _read(path)
    if payload.get("format") == STAGE_FORMAT:
        prefix = payload.get("prefix", "")
        return {prefix + k: v for k, v in payload["model"].items()}, payload.get("optimizer") or {}
    if payload.get("format") == FORMAT and "model" in payload:
        return payload["model"], payload["optimizer"]["state"]
    raise CheckpointError(f"{path} is neither an rpcmp checkpoint nor one of its parts")


def _join_parts(index: dict[str, Any]) -> None:
    folder = os.path.dirname(index["path"])
    index["model"], index["optimizer"]["state"], index["files"] = {}, {}, []
    for part in index["parts"]:
        path = os.path.join(folder, part["file"])
        if not os.path.isfile(path):
            raise CheckpointError(
                f"checkpoint {index['path']} is incomplete here: its part {part['file']} (stage {part['stage']}) was "
                f"written by {part['owner']} on that process's node and is not in {folder}. Copy the parts into one "
                f"folder (or give every node one shared --checkpoint-dir), then read it again")
        model, optim = read_part(path)
        index["model"].update(model)
        index["optimizer"]["state"].update(optim)
        index["files"].append(path)


def _read(path: str) -> Any:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same to the user
        if "Weights only load failed" in str(exc):
            raise CheckpointError(
                f"{path} holds objects other than tensors and plain values, which rpcmp refuses to load: loading "
                f"them could run any code the file carries. rpcmp writes no such checkpoint; if you wrote this "
                f"file yourself and trust it, load it with torch.load(weights_only=False)"
            ) from None
        raise CheckpointError(
            f"checkpoint {path} is truncated or not a checkpoint ({type(exc).__name__}: {exc}); "
            f"delete it to resume from the one before"
        ) from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path} is not an rpcmp checkpoint (expected format {FORMAT!r})")
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


def _checkpoints(directory: str) -> list[tuple[int, str | None, str]]:
    """``(step, run, path)`` of every consolidated checkpoint in ``directory``, by step."""
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), m.group(2), os.path.join(directory, f)) for f in os.listdir(directory)
             if (m := _NAME.match(f))]
    return sorted(found, key=lambda f: f[0])
