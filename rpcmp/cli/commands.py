"""The ``rpcmp`` command line: ``run``, ``predict``, ``plan``, ``worker``, ``doctor``.

    rpcmp run examples/unet_split/job.py --local 3      # one machine, 3 processes
    rpcmp predict examples/unet_split/job.py -c runs/unet
    rpcmp plan examples/unet_split/job.py --world-size 3
"""
from __future__ import annotations

import functools
import sys

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import RpcmpError
from .options import job_options, report

__all__ = ["main", "job_options"]


@click.group()
@click.version_option(package_name="rpcmp")
def main():
    """rpcmp: train a model split into stages across processes and nodes over RPC."""


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--local", "nprocs", type=int, help="Start this many processes on this machine (master + workers).")
@click.option("--workers", type=int, help="Use this many worker daemons (`rpcmp worker`) instead.")
@click.option("--listen", default="127.0.0.1:29500", show_default=True,
              help="With --workers: HOST:PORT the master listens on (RPC on PORT, job offers on PORT+1).")
@click.option("--token-file", type=click.Path(dir_okay=False, readable=False), help="With --workers: the shared job token.")
@job_options
def run(job_file, nprocs, workers, listen, token_file, overrides):
    """Train JOB_FILE on --local N processes, or on --workers N daemons."""
    from ..launch.local import launch_local
    from ..train.stop import exit_status
    from ..train.trainer import fit
    if (nprocs is None) == (workers is None):
        raise click.BadParameter("give exactly one of --local N (processes here) or --workers N (daemons)")
    if workers is not None:
        from ..launch.daemon import run_master
        from ..launch.drain import DrainRequests
        result = run_master(job_file, workers, listen, token_file, overrides, fit, control=DrainRequests)
    elif nprocs < 2:
        raise click.BadParameter(f"--local needs at least 2 processes (a master and a worker), got {nprocs}")
    else:
        result = launch_local(job_file, nprocs, fit, overrides=overrides, fork_here=True)
    if exit_status(result):  # stopped by a signal: see [Note: stopping a run]
        sys.exit(exit_status(result))


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--checkpoint", "-c", required=True, type=click.Path(),
              help="A checkpoint file, or a checkpoint directory (its latest checkpoint).")
@click.option("--out", default="predictions", show_default=True, type=click.Path(file_okay=False),
              help="Where predictions.pt and the PNG panels go.")
@click.option("--images", default=4, show_default=True, help="PNG panels (input | truth | prediction) to write.")
@click.option("--local", "nprocs", type=int,
              help="Predict through the job's stages on this many processes (default: the unsplit model, here).")
@job_options
def predict(job_file, checkpoint, out, images, nprocs, overrides):
    """Predict JOB_FILE's held-out set with a trained checkpoint."""
    from ..train.predict import predict_local, predict_split
    if nprocs is None:
        from ..job import load_job
        result = predict_local(load_job(job_file, overrides=overrides), checkpoint, out, images)
    else:
        if nprocs < 2:
            raise click.BadParameter(f"--local needs at least 2 processes (a master and a worker), got {nprocs}")
        from ..launch.local import launch_local
        result = launch_local(job_file, nprocs, functools.partial(predict_split, checkpoint=checkpoint, out_dir=out,
                                                                  images=images), overrides=overrides, fork_here=True)
    console = Console()
    console.print(f"{result['samples']} samples of the {result['dataset']} set"
                  f"{' (the job has no held-out set)' if result['dataset'] == 'training' else ''} predicted with "
                  f"{result['checkpoint']}")
    if result["metric"] is not None:
        console.print(f"{result['metric_name']}: [bold]{result['metric']:.4f}[/]")
    console.print(f"outputs: {result['predictions']}" + (f"; {len(result['images'])} PNG panels "
                  f"(input | truth | prediction) in {out}" if result["images"] else ""))


@main.command()
@click.argument("checkpoint", type=click.Path())
@click.argument("out", type=click.Path(dir_okay=False))
def export(checkpoint, out):
    """Write CHECKPOINT's model (a file, or a folder's latest) as one plain state_dict file OUT.

    OUT loads into the unsplit model with ``model.load_state_dict(torch.load(OUT), strict=True)``.
    The checkpoint's parts are read memory-mapped and written key by key: no process holds the
    model in its own memory."""
    from ..core.checkpoint import export_model
    path, keys, size = export_model(checkpoint, out)
    Console().print(f"wrote {out}: {keys} tensors, {_mib(size)}, the model of {path}")


@main.command()
@click.option("--master", required=True, help="HOST:PORT of the job's master (`rpcmp run --workers N --listen HOST:PORT`).")
@click.option("--rank", type=int, required=True, help="The rank to drain (1..N).")
@click.option("--token-file", type=click.Path(dir_okay=False, readable=False), help="The shared job token (or env RPCMP_TOKEN).")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for the master's answer.")
def drain(master, rank, token_file, timeout):
    """Move the stages of RANK to spares while the job trains, and let its daemon finish (a node to reboot)."""
    _control(master, rank, token_file, timeout, "drain")


def _control(master: str, rank: int, token_file, timeout: float, action: str) -> None:
    from ..launch.daemon import read_token
    from ..launch.drain import request_drain
    try:
        ok, message = request_drain(master, rank, read_token(None, token_file), timeout, action)
    except RpcmpError as exc:
        report(exc)
        sys.exit(2)
    Console(stderr=not ok).print(escape(message))
    sys.exit(0 if ok else 1)


@main.command()
@click.option("--master", required=True, help="HOST:PORT of the job's master (`rpcmp run --workers N --listen HOST:PORT`).")
@click.option("--token-file", type=click.Path(dir_okay=False, readable=False), help="The shared job token (or env RPCMP_TOKEN).")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for the master's answer.")
def rebalance(master, token_file, timeout):
    """Measure the stages of a running daemon job once and re-cut it if that pays (a Split or SplitAt pipeline)."""
    _control(master, 0, token_file, timeout, "rebalance")


@main.command()
@click.option("--master", required=True, help="HOST:PORT of the master (`rpcmp run --workers N --listen HOST:PORT`).")
@click.option("--rank", type=int, required=True, help="This daemon's rank (1..N).")
@click.option("--token-file", type=click.Path(dir_okay=False, readable=False), help="The shared job token (or env RPCMP_TOKEN).")
@click.option("--iface", envvar="RPCMP_IFACE", help="Network interface for RPC and gloo (env RPCMP_IFACE).")
@click.option("--preload", metavar="MODULES", default=None,
              help="Comma-separated model libraries the daemon imports once, before the first job (default: every one "
                   "of segmentation_models_pytorch, transformers, torchvision and timm that is installed, and what "
                   "torch.export's tracing imports; '' for none: a job then imports its own, a few seconds at its start).")
def worker(master, rank, token_file, iface, preload):
    """Run a worker daemon: serve jobs from MASTER one after another, until SIGTERM."""
    from ..launch.network import select_interface
    from ..launch.daemon import read_token, serve_forever
    libraries = None if preload is None else [m.strip() for m in preload.split(",") if m.strip()]
    missing = [m for m in libraries or () if not _importable(m)]
    if missing:  # the fork server would skip them without a word
        raise click.BadParameter(f"no module named {', '.join(missing)} in this environment: name each library as "
                                 f"imported (e.g. segmentation_models_pytorch), or install it", param_hint="--preload")
    try:
        select_interface(iface)
        serve_forever(master, rank, read_token(None, token_file), libraries=libraries)
    except RpcmpError as exc:
        report(exc)
        sys.exit(2)


def _importable(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or an empty name
        return False


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--world-size", "-n", type=int, default=None,
              help="Processes the job will run on (default: stages + 1).")
@click.option("--nproc-per-node", type=int, default=None,
              help="With --replicas: processes per node (torchrun's), to show the grid by node.")
@click.option("--check", is_flag=True,
              help="Also build the unsplit model and every stage here and compare them on one batch: every tensor "
                   "by name, and the output (needs memory for the whole model, twice).")
@job_options
def plan(job_file, world_size, nproc_per_node, check, overrides):
    """Print how JOB_FILE is cut into stages and placed, and its schedule's plan, without starting any process."""
    from ..job import load_job
    from ..core.microbatch import tensors
    from ..plan.partition import build_stage, cached_meta, has_batch_state, plan_stages
    from ..plan.traced import stage_flow
    from ..plan.topology import Topology
    from ..data import first_batch, needs_sample
    from ..core.microbatch import scatter
    from ..core.groups import plan_groups
    job = load_job(job_file, overrides=overrides)
    batch = first_batch(job)
    specs = plan_stages(job, batch if needs_sample(job) else None)
    flow = scatter(batch, job.microbatches)[0] if batch is not None else None  # one micro-batch, through the stages
    world_size = world_size or job.replicas * len(specs) + 1 + job.spares
    nodes = [f"node {q // nproc_per_node}" for q in range(world_size)] if nproc_per_node else None
    topology = Topology.of(job, world_size, len(specs), nodes)
    grid = topology.grid if topology.replicated else None
    places = topology.grid[0]
    cls, kwargs = job.optimizer
    states = _optimizer_states(cls, kwargs)
    table = Table(title=f"{job_file}: {len(specs)} stages on {world_size} processes, "
                        f"{job.microbatches} micro-batches of a {job.batch_size}-sample batch")
    for col in ("stage", "modules", "ops", "parameters", "est. memory", "out / micro-batch", "placement"):
        table.add_column(col, justify="left" if col in ("stage", "modules", "ops", "placement") else "right")
    modules = [build_stage(job, spec, meta=True) for spec in specs]  # structure and shapes only: nothing is allocated
    bn = any(has_batch_state(m, spec) for m, spec in zip(modules, specs))
    total = 0
    for (sent, _), spec, module, place in zip(stage_flow(modules, flow, _on_meta), specs, modules, places):
        n = sum(p.numel() for p in module.parameters())
        bytes_ = sum(p.numel() * p.element_size() * (2 + states) for p in module.parameters())
        bytes_ += sum(b.numel() * b.element_size() for b in module.buffers())
        total += n
        crosses = "?" if sent is None else _mib(sum(t.numel() * t.element_size() for t in tensors(sent)))
        table.add_row(str(spec.index), spec.name, _ops(module), f"{n:,}", _mib(bytes_), crosses, str(place))
    table.caption = (f"{total:,} parameters; memory = weights + gradients + {states} optimizer "
                     f"state(s) per parameter ({cls.__name__}) + buffers, activations excluded; out / micro-batch: "
                     f"what the stage sends on (its gradient comes back the same size), shapes from the meta device")
    console = Console()
    Console(width=max(console.width, 140)).print(table)  # a piped plan keeps whole stage names
    if grid:
        Console(width=max(console.width, 140)).print(_grid_table(job, specs, grid, nodes))
    Console(width=max(console.width, 140)).print(_schedule_table(job, len(specs), bn and job.batchnorm == "batch",
                                                                specs[0]))
    if job.param_groups is not None:
        console.print(f"optimizer: {cls.__name__} over {plan_groups(job, cached_meta(job)).describe()}")
    if topology.spares:
        console.print(f"spares: {', '.join(topology.spares)} (hold no stage; each takes over the stage of a lost owner)")
    for line in _model_notes(specs):
        console.print(line)
    if check and not _check(job, specs, batch):
        sys.exit(1)


def _model_notes(specs) -> list[str]:
    """What is shared by stages, kept without being read, and which input sizes may change."""
    from ..master.tied import describe
    lines = [f"shared: {line}" for line in describe(specs)]
    lines += [f"kept on stage {s.index} (no graph reads them): {', '.join(s.unused)}" for s in specs if s.unused]
    if specs and specs[0].kind == "traced":
        from ..plan.lengths import describe_sizes
        lines.append(f"inputs: {describe_sizes(specs[0].sizes, specs[0].example)}")
    return lines


def _check(job, specs, batch) -> bool:
    """``rpcmp plan --check``: print the comparison; True if the stages are the unsplit model."""
    from .check import check_stages
    checks, diff, why = check_stages(job, specs, batch)
    table = Table(title="the stages against the unsplit model (eval mode, one micro-batch)")
    for col in ("stage", "tensors compared", "differences"):
        table.add_column(col)
    for c in checks:
        table.add_row(f"{c.index} {c.name}", str(c.tensors), "\n".join(c.wrong[:6]) or "none")
    console = Console(width=max(Console().width, 140))
    console.print(table)
    if why:
        console.print(f"output: not compared ({why})")
    else:
        console.print(f"output: largest difference from the unsplit model's {diff:.3g}")
    return not why and all(not c.wrong for c in checks) and diff <= 1e-4


def _grid_table(job, specs, grid, nodes) -> Table:
    """Which process (and node) holds each copy of each stage (``Job(replicas=R)``)."""
    table = Table(title=f"{job.replicas} replicas x {len(specs)} stages: each replica trains on "
                        f"{job.batch_size // job.replicas} samples of every {job.batch_size}-sample batch")
    table.add_column("replica")
    for spec in specs:
        table.add_column(f"stage {spec.index} {spec.name}")
    for r, row in enumerate(grid):
        table.add_row(str(r), *(f"{p} ({nodes[p.rank]})" if nodes else str(p) for p in row))
    table.caption = ("the copies of a stage (a column) average their gradients in one process group every step; "
                     "under torchrun the grid follows the nodes the ranks report" + ("" if nodes else
                     " (--nproc-per-node K shows it)"))
    return table


def _schedule_table(job, stages: int, whole_batch: bool, spec) -> Table:
    """The schedule's plan for one optimizer step (``--schedule S -m M`` to see another)."""
    from ..plan.schedule import Loss, make_plan
    from ..plan.writes import whole_batch_note
    step = make_plan(job.schedule, 1 if whole_batch else job.microbatches, stages)
    table = Table(title=f"schedule {step.name.value!r}: one step of {step.microbatches} micro-batches over {stages} stages")
    for col in ("micro-batch", "enters", "backward", "gradients"):
        table.add_column(col)
    for row in step.rows():
        table.add_row(*row)
    loss = "on the gathered batch" if step.loss is Loss.GATHERED else "per micro-batch, weighted by its share"
    table.caption = (f"a distributed-autograd context per micro-batch; loss {loss}; "
                     f"at most {step.in_flight} micro-batches hold activations on a stage"
                     + ("; " + whole_batch_note(spec.writes, job.microbatches, spec.mixes) if whole_batch else ""))
    return table


@main.command()
@click.option("--master", help="HOST:PORT of the master (or rendezvous) to check reachability.")
@click.option("--iface", envvar="RPCMP_IFACE", help="The interface rpcmp should use (env RPCMP_IFACE).")
@click.option("--nodes", type=int, default=1, show_default=True, help="Nodes the job will span.")
def doctor(master, iface, nodes):
    """Check this node before a job: interfaces, hostname, master port, backends, GPUs."""
    from ..launch.doctor import diagnose, render
    sys.exit(0 if render(diagnose(master, iface, nodes), Console(width=160)) else 1)


def _on_meta(module, x):
    """The stage's output for input ``x``, computed on the meta device (shapes and dtypes, no data); None if unknown."""
    import torch
    from ..core.microbatch import map_tensors
    if x is None:
        return None
    try:
        with torch.no_grad():
            # sizes (0-dim tensors a traced stage turns into ints) keep their values
            return module.eval().to("meta")(map_tensors(x, lambda t: t.to("meta") if t.dim() else t))
    except Exception:  # noqa: BLE001 - an op without a meta kernel: the size stays unknown
        return None


def _ops(module, top: int = 6) -> str:
    """What a stage computes, most frequent first: the operations of a traced stage's graph (into
    its submodules), or the layer types of a stage of modules."""
    import collections
    import torch

    def walk(m) -> list[str]:
        graph = getattr(m, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            return [type(leaf).__name__ for leaf in m.modules() if not list(leaf.children())]
        found = []
        for n in graph.nodes:
            if n.op == "call_module":
                found += walk(m.get_submodule(n.target))
            elif n.op == "call_function" and "getitem" not in str(n.target):
                found.append(str(getattr(n.target, "__name__", n.target)).split(".")[0])
        return found
    counts = collections.Counter(walk(module)).most_common()
    text = ", ".join(f"{name} x{count}" for name, count in counts[:top])
    return text + (f", +{len(counts) - top} more kinds" if len(counts) > top else "")


def _optimizer_states(cls, kwargs) -> int:
    name = cls.__name__.lower()
    if "adam" in name:
        return 2
    return 1 if kwargs.get("momentum") else 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 or n == 0 else f"{n / 2**10:.1f} KiB"
