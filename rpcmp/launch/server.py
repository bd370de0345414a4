"""The fork server local ranks and a daemon's jobs start from (see [Note: forked from a warm server]).

This module imports nothing heavy: ``rpcmp run`` starts the server before it imports torch itself.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

from ..errors import LaunchError

__all__ = ["process_context", "preload", "start_server"]


# Third-party libraries worth importing once in the fork server when the job imports them.
_HEAVY = ("segmentation_models_pytorch", "transformers", "torchvision", "timm")
_EXTRA: list[str] = []


def preload(*modules: str) -> None:
    """Also import ``modules`` in the fork server when it starts (a test suite or a notebook
    that will launch several jobs); no effect on a server already running."""
    _EXTRA.extend(modules)


def process_context(job_path: str | None = None) -> Any:
    """The multiprocessing context local ranks and a daemon's jobs start from.

    [Note: forked from a warm server]
    Every rank imports torch, rpcmp and the job's model library before it can join the RPC
    world: 3-5 s of CPU each, paid by every process of every run (with ``spawn``, N processes
    on 2 cores paid it side by side). A ``forkserver`` imports them once, in a server
    started at the first launch of this process, and forks each rank from it, so a rank
    starts with its imports done (measured: benchmarks/startup.py). What the server holds is
    fixed when it starts: the modules below (torch, every rpcmp module, and the heavy model
    libraries the job file imports, never the job's own code, which might touch CUDA or
    start threads), and its environment; each child is handed the launcher's current
    environment (:func:`_local_child`), so a variable set after the server started still
    reaches it. The server exits with its launcher; a forked rank watches both.
    ``RPCMP_START_METHOD=spawn`` starts every rank from a fresh interpreter instead (as before
    the server; for a job whose libraries cannot be imported before a fork).
    """
    method = os.environ.get("RPCMP_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise LaunchError(f"RPCMP_START_METHOD must be 'forkserver' (the default) or 'spawn', got {method!r}")
    if method == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    modules = ["torch", "torch.distributed.rpc", "torch.distributed.autograd", "torch.distributed.optim",
               "torch.export", *_rpcmp_modules(), *_EXTRA]
    if job_path is not None:
        modules += [m for m in _HEAVY if m in _imported_by(job_path)]
    ctx.set_forkserver_preload(list(dict.fromkeys(modules)))
    return ctx


def start_server(job_path: str | None = None, every_library: bool = False) -> None:
    """Start the fork server now, so that it imports while this process does its own imports (call it
    before importing torch: ``rpcmp run --local``, a worker daemon at start, which preloads
    ``every_library`` it may need). Later launches find it running."""
    from multiprocessing import forkserver
    if os.environ.get("RPCMP_START_METHOD", "forkserver") != "forkserver":
        return
    if every_library:
        preload(*_HEAVY)
    process_context(job_path)
    forkserver.ensure_running()


def _rpcmp_modules() -> list[str]:
    """Every module of rpcmp but the entry points, found on disk (importing them is the server's work)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = []
    for folder, _, files in os.walk(root):
        package = ".".join(["rpcmp", *[p for p in os.path.relpath(folder, root).split(os.sep) if p != "."]])
        names += [f"{package}.{f[:-3]}" for f in sorted(files) if f.endswith(".py") and f not in ("__init__.py", "__main__.py")]
    return names


def _imported_by(job_path: str) -> set[str]:
    """The top-level packages a job file imports (read, not run)."""
    import ast
    try:
        tree = ast.parse(open(job_path).read())
    except (OSError, SyntaxError, ValueError):
        return set()  # load_job says what is wrong with it
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names
