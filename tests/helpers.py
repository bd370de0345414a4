"""Toy models, the one helper every integration test uses to start real processes, and the `rpcmp` command
line started as a real process from the suite's warm fork server."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile

import torch
import torch.utils._pytree as pytree
from torch import nn

from rpcmp.job import load_job

from rpcmp.launch.local import launch_local
from rpcmp.launch.server import process_context

JOBS = os.path.join(os.path.dirname(__file__), "jobs")


def job_path(name: str) -> str:
    return os.path.join(JOBS, name + ".py")


def load(name: str):
    return load_job(job_path(name))


def run_ranks(job: str, nprocs: int, main, overrides: dict | None = None, timeout: float = 180):
    """Start ``nprocs`` fresh processes (master included) for ``job``; return ``main``'s result.

    Every process is killed if the run outlives ``timeout``: a hang is a failure.
    """
    return launch_local(job_path(job), nprocs, main, overrides=overrides, timeout=timeout, master_in_process=False)


def fit_steps(job, world_size) -> int:
    """A ``run_ranks`` main: the job trained as ``rpcmp run`` trains it; the steps it took."""
    from rpcmp.train.trainer import fit
    return fit(job, world_size)["steps"]


def assert_close_f32(actual, expected, **kwargs) -> None:
    """``torch.testing.assert_close`` for float32 results, with float32 tolerances.

    A float32 loss read with ``.item()`` becomes a Python float, which ``assert_close``
    compares at float64 tolerances (rtol 1e-7): one float32 ulp apart fails, and whether two
    sums round alike depends on the CPU's kernels. Every Python float here (a loss, a norm, a
    metric computed in float32) is compared as a float32 tensor instead. Pass ``rtol=0,
    atol=0`` where equality must be exact (the same operations in the same order).
    """
    def f32(x):
        return torch.tensor(x, dtype=torch.float32) if isinstance(x, float) else x
    torch.testing.assert_close(pytree.tree_map(f32, actual), pytree.tree_map(f32, expected), **kwargs)


def batches(steps: int, size: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 16, generator=g), torch.randn(size, 8, generator=g)) for _ in range(steps)]


def train_reference(model: nn.Module, optimizer: tuple, loss_fn, data, groups=None) -> tuple[list[float], dict]:
    """The same training in one process with plain PyTorch: the yardstick of transparency."""
    cls, kwargs = optimizer
    opt = cls(torch_groups(model, groups) if groups else model.parameters(), **kwargs)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def no_decay(model: nn.Module) -> list[dict]:
    """``Job.param_groups`` as nanoGPT's configure_optimizers: no weight decay, and here a learning rate of
    its own, off every parameter that is not a matrix (given by name, where the first group gives tensors)."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [n for n, p in model.named_parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 0.03}]


def torch_groups(model: nn.Module, groups=no_decay) -> list[dict]:
    """``groups(model)`` as torch.optim takes them: parameters, not names."""
    named = dict(model.named_parameters())
    return [{**g, "params": [named[p] if isinstance(p, str) else p for p in g["params"]]} for g in groups(model)]


def metric_steps(path) -> int:
    """How many step records a run's metrics file (``--metrics``) holds so far."""
    import json
    try:
        return sum(1 for line in open(path) if json.loads(line).get("kind") == "step")
    except (OSError, ValueError):  # not written yet, or a line being written
        return 0


class Control:
    """What `rpcmp drain` / `rpcmp rebalance` requests look like to the engine (rpcmp.launch.drain.DrainRequests):
    ``Control((number, "drain", rank, nonce), ...)`` as ``current().control``; the answers are kept."""

    def __init__(self, *requests):
        self.requests, self.answers = list(requests), []

    def pending(self):
        out, self.requests = self.requests, []
        return out

    def answer(self, number, nonce, ok, message):
        self.answers.append((number, ok, message))


class Command:
    """``rpcmp ARGS`` in a process and a session of its own, as ``subprocess.Popen([rpcmp, *ARGS], stdout=PIPE,
    stderr=PIPE (or STDOUT with ``merged``), text=True, start_new_session=True, env=env)`` gives it: ``pid``,
    ``poll``, ``wait``, ``communicate``, ``returncode``, its process group killed by ``os.killpg(pid)``.

    The process is forked from the suite's fork server (conftest.py), which has torch, rpcmp, the model libraries
    and tracing's imports loaded, and runs the console script's own function (``rpcmp.cli.console``): the command
    line, its launch and its ranks are what a user's ``rpcmp`` runs, without a fresh interpreter's 3-5 s of CPU of
    imports. The console script itself (its interpreter, its entry point) is what test_launch.py, the daemons of
    test_daemons.py and test_drain.py, test_drain.py's masters, the first `rpcmp predict` of test_predict.py and the
    stopped run of test_checkpoint_resume.py's Ctrl-C test start."""

    def __init__(self, *args: str, env: dict | None = None, merged: bool = False):
        folder = tempfile.mkdtemp(prefix="rpcmp-command-")
        self._out = os.path.join(folder, "stdout")
        self._err = self._out if merged else os.path.join(folder, "stderr")
        self._merged = merged
        environ = dict(os.environ if env is None else env)
        self._process = process_context().Process(target=_command_main, name="rpcmp-command",
                                                  args=([str(a) for a in args], environ, os.getcwd(), self._out, self._err))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["rpcmp"], timeout)
        return self._process.exitcode

    def output(self) -> str:
        """Standard output so far (with the errors too where ``merged``)."""
        return _read(self._out)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        return self.output(), None if self._merged else _read(self._err)

    def kill(self) -> None:
        """Kill the command and every process of its session (its ranks)."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet in a session of its own: it has started nothing
                self._process.kill()
            self._process.join(30)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:  # the command has not opened it yet
        return ""


def _command_main(args, environ, cwd, out, err) -> None:
    os.setsid()
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    sys.argv = [os.path.join(os.path.dirname(sys.executable), "rpcmp"), *args]
    from rpcmp.cli import console
    console()


def run_command(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``subprocess.run([rpcmp, *args], capture_output=True, text=True, timeout=timeout, env=env)`` through
    :class:`Command`; a command that outlives ``timeout`` is killed and raises ``subprocess.TimeoutExpired``."""
    command = Command(*args, env=env)
    try:
        out, err = command.communicate(timeout)
    finally:
        command.kill()
    return subprocess.CompletedProcess(["rpcmp", *args], command.returncode, out, err)


def descendant(root: int, comm: str) -> int | None:
    """The pid of a process named ``comm`` (a local rank names itself rpcmp-NAME) under process ``root``."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        parents[int(pid)] = (name, int(rest[1]))
    for pid, (name, _) in parents.items():
        if name != comm:
            continue
        up = pid
        while up in parents and up > 1:
            up = parents[up][1]
            if up == root:
                return pid
    return None



def half_open(pid: int) -> None:
    """Connect to each TCP port process ``pid`` listens on and close the connection before saying anything, as a
    peer killed while it connected does (a worker's one port: its RPC listener's)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = []
    for line in open(f"/proc/{pid}/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: listening
            ip, port = fields[1].split(":")
            ports.append((socket.inet_ntoa(bytes.fromhex(ip)[::-1]), int(port, 16)))
    assert ports, f"process {pid} listens on no TCP port"
    for address in ports:
        socket.create_connection(address, timeout=5).close()


def same_built_graphs(job, specs) -> bool:
    """Whether the graphs each traced spec carries (rpcmp/plan/shipped.py) are those the trace gave, node for node
    (every graph of pipelining's modules within modules: their code), over the same meta tensors."""
    from rpcmp.plan.export import traces
    from rpcmp.plan.graphs import graphs
    from rpcmp.plan.shipped import unship_stage
    from rpcmp.plan.traced import graph_copy

    def code(module):
        return {name: (type(m).__name__, graph.python_code("self").src) for name, m, graph in graphs(module)}

    def tensors(module):
        return {k: (v.shape, v.dtype, v.device, type(v)) for k, v in module.state_dict(keep_vars=True).items()}
    pipes = traces(job, specs[0].example, eval_too=not specs[0].one_graph)
    for spec in specs:
        _, modules = unship_stage(spec.graphs)
        for shipped, pipe in zip(modules, pipes):
            traced = graph_copy(pipe, spec.index)
            if code(shipped) != code(traced) or tensors(shipped) != tensors(traced):
                return False
    return True


_STEPS_TAKEN: list[int] = []


class RecordingSGD(torch.optim.SGD):
    """``torch.optim.SGD`` that notes, for each step that has a gradient to apply, whether it ran inside a backward
    pass: the autograd engine's graph task id then, -1 outside one (not the steps without any: rpcmp's scheduler
    drives one on the master, on no parameter of the model). Read (and cleared) on a process with
    :func:`steps_taken`."""

    def step(self, closure=None):
        if any(p.grad is not None for group in self.param_groups for p in group["params"]):
            _STEPS_TAKEN.append(torch._C._current_graph_task_id())
        return super().step(closure)


def steps_taken() -> list[int]:
    taken = list(_STEPS_TAKEN)
    _STEPS_TAKEN.clear()
    return taken
