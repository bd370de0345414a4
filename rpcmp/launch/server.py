"""The fork server local ranks and a daemon's jobs start from (see [Note: forked from a warm server]).

This module imports nothing heavy: a worker daemon starts the server before it imports torch itself.
"""
from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import os
import threading
from typing import Any, Sequence

from ..errors import LaunchError

__all__ = ["process_context", "preload", "start_server"]


# Third-party libraries worth importing once in the fork server when the job imports them.
_HEAVY = ("segmentation_models_pytorch", "transformers", "torchvision", "timm")
_EXTRA: list[str] = []
# What a process's first torch.export trace imports (dynamo, AOT autograd, pipelining's tracer; sympy and networkx
# through them): imported once before the forks for a job that traces (a SplitAt), by a daemon with its default
# preload, and by a server told to (a test suite), rather than by every rank that traces: a rank forked from a process
# that had them loaded tests/jobs/hf_gpt2.py and traced it in 1.0 + 2.1 s, without them in 1.6 + 2.8 s. A server
# that runs no traced job would only pay their 1.6 s of imports.
TRACING = ("torch._dynamo", "torch._functorch.aot_autograd", "torch.export._trace", "torch.distributed.pipelining")


def preload(*modules: str) -> None:
    """Also import ``modules`` in the fork server when it starts (a test suite or a notebook
    that will launch several jobs); no effect on a server already running."""
    _EXTRA.extend(modules)


def process_context(job_path: str | None = None, fork_here: bool = False) -> Any:
    """The multiprocessing context local ranks and a daemon's jobs start from; with ``fork_here``
    (the command line, before it has loaded the job), this process itself when it can be.

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

    ``rpcmp run --local`` and ``rpcmp predict --local`` are such a server themselves: before the
    command has loaded the job or computed anything (no thread started, so no intra-op thread
    pool to break in the children, and no CUDA), it imports what the server would and forks the
    ranks from itself. The server's imports were a second interpreter's worth of CPU per run,
    paid beside the command's own (measured: benchmarks/startup.py, method ``fork-here``).
    Anything else (a script or notebook that launches, a second launch in one process, a daemon)
    uses the server, and so does the command when a thread already runs.
    """
    method = os.environ.get("RPCMP_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise LaunchError(f"RPCMP_START_METHOD must be 'forkserver' (the default) or 'spawn', got {method!r}")
    if method == "spawn":
        return mp.get_context("spawn")
    modules = ["torch", "torch.distributed.rpc", "torch.distributed.autograd", "torch.distributed.optim",
               "torch.export", *_rpcmp_modules(), *_EXTRA]
    if job_path is not None:
        modules += [m for m in _HEAVY if m in _imported_by(job_path)]
    if _traced(job_path):
        modules += TRACING
    here = fork_here and threading.active_count() == 1
    modules = list(dict.fromkeys(modules))
    if here:
        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError:  # as the server does: the job's own import says what is missing
                pass
        gc.freeze()  # see [Note: what a fork inherits, frozen]
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(modules)
    return ctx


# [Note: what a fork inherits, frozen]
# A rank forked from a warm process inherits its imports: torch, rpcmp, the model libraries, tracing's (about
# 400,000 objects that live as long as the process). The garbage collector's full passes walk every one of them:
# 0.16 s of CPU each with GPT-2's libraries loaded, and writing to each object's header un-shares the pages the
# fork shared. A stage's build runs one (rpcmp.plan.materialize.build_part frees its scratch buffer at once) and
# Python runs more by itself. So the command freezes what it has before it forks its ranks, and each forked rank
# freezes what it inherited as its first step (``gc.freeze``: moved to a generation no pass walks; the objects
# stay alive as they would anyway); a pass then takes microseconds. Measured (`rpcmp run tests/jobs/three.py
# --local 5 --max-steps 60 --spares 1`, three alternating launches, user + system CPU of the command and its
# ranks): 5.3-5.7 s before, 5.0-5.4 s after; GPT-2 (`tests/jobs/hf_gpt2.py --local 4 --max-steps 12`): 23.4-24.1 s
# before, 22.0-23.3 s after; that job's four processes at its step 8 (smaps_rollup, two launches each) held
# 1335 MiB of proportional memory (Pss) before, 1174 MiB after, the same 2336-2341 MiB resident.


def start_server(job_path: str | None = None, every_library: bool = False, libraries: Sequence[str] = ()) -> None:
    """Start the fork server now, so that it imports while this process does its own imports (call it
    before importing torch: a worker daemon at start, which preloads ``every_library`` it may need, or the
    ``libraries`` it was told). Later launches find it running."""
    from multiprocessing import forkserver
    if os.environ.get("RPCMP_START_METHOD", "forkserver") != "forkserver":
        return
    preload(*(_HEAVY + TRACING if every_library else ()), *libraries)
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


def _traced(job_path: str | None) -> bool:
    """Whether the job file cuts its model on the traced graph (read, not run: it names ``SplitAt``)."""
    try:
        return job_path is not None and "SplitAt" in open(job_path).read()
    except (OSError, ValueError):
        return False


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
