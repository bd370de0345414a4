"""rpcmp against what a user would otherwise run, same stages, data and cores, in one run.

    make bench            # or: .venv/bin/python benchmarks/bench.py [--out FILE]

Every figure is the median step time of several steps after warm-up; every process
sets its intra-op thread count explicitly; ratios compare figures from this one run.
Writes bench-results/bench.json and prints a rich table.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time

import click
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from rich.console import Console
from rich.table import Table

import rpcmp
from rpcmp.launch.local import launch_local
from rpcmp.launch.runtime import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = os.path.join(HERE, "jobs")
sys.path.insert(0, JOBS)
import bench_models as bm  # noqa: E402

WARMUP, STEPS = 3, 9
# Step times of the same configuration can differ by 10-20% from one launch to the next, more
# than the rpcmp / pipelining difference; those comparisons (MLP and split Unet) alternate
# ROUNDS launches of each (--rounds) and take the median over them.
ROUNDS = 5
MEMORY_BATCH = (16, 256)  # samples, image side: model and activations, not the runtime, dominate


def median_time(step, warmup=WARMUP, steps=STEPS) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def mlp_data(batch=256):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g)


def unet_data(batch=16, size=128):
    g = torch.Generator().manual_seed(0)
    return torch.rand(batch, 1, size, size, generator=g), (torch.rand(batch, 1, size, size, generator=g) > 0.5).float()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- rpcmp -----------------------------------------------------------------------
def _rpcmp_mlp(job, world):
    """Step times by M with the job's schedule (``{m: s}``); on ``uv`` with the default schedule, also rpcmp's GPipe
    and 1F1B at M = 4 and 8 (``{"gpipe_m4": s, ...}``), the two schedules pipelining runs in each of its launches."""
    x, y = mlp_data()
    out = {}
    full = job.transport == "uv" and job.schedule == "overlap"
    runs = [(m, None) for m in ((1, 4, 8) if full else (4,))]
    runs += [(m, s) for m in (4, 8) for s in ("gpipe", "1f1b")] if full else []
    for m, schedule in runs:
        pipe = rpcmp.Pipeline(job, world, microbatches=m, schedule=schedule)
        out[m if schedule is None else f"{schedule}_m{m}"] = median_time(lambda: pipe.train_step(x, y))
        pipe.close()
    return out


def _mlp_side_by_side(job, world, blocks=6, block=5):
    """rpcmp and pipelining's GPipe and 1F1B take turns in the same two processes (pipelining's rank 0 on worker1,
    which holds rpcmp's first stage, rank 1 here), ``blocks`` times ``block`` steps each, at M = 1, 4 and 8: one
    launch to the next moves a step by a tenth or more, and each launch of its own also had each system's allocator
    as it ships (rpcmp's settings: [Note: one malloc arena]); here both run on the same cores, memory and settings.
    ``{m: (rpcmp's median, pipelining's best median)}``, seconds."""
    x, y = mlp_data()
    port = free_port()
    rank0 = rpc.rpc_async("worker1", bm.pipelining_mlp_init, args=(0, port, x, y))
    bm.pipelining_mlp_init(1, port, x, y)
    rank0.wait()

    def pipelining(key, n):
        other = rpc.rpc_async("worker1", bm.pipelining_mlp_steps, args=(key, n))
        times = bm.pipelining_mlp_steps(key, n)
        other.wait()
        return times
    out = {}
    for m in (1, 4, 8):
        pipe = rpcmp.Pipeline(job, world, microbatches=m)
        peers = [f"gpipe_m{m}"] + ([f"1f1b_m{m}"] if m > 1 else [])
        steps = {"rpcmp": lambda n: [_timed(pipe.train_step, x, y) for _ in range(n)],
                 **{k: (lambda n, k=k: pipelining(k, n)) for k in peers}}
        times = {k: [] for k in steps}
        for k, run in steps.items():
            run(WARMUP)
        for _ in range(blocks):
            for k, run in steps.items():
                times[k] += run(block)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[m] = (med["rpcmp"], min(med[k] for k in peers))
        pipe.close()
    rpc.rpc_sync("worker1", bm.pipelining_mlp_end)
    bm.pipelining_mlp_end()
    return out


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _rpcmp_unet(job, world):
    x, y = unet_data()
    pipe = rpcmp.Pipeline(job, world, sample=x)  # the job has no data: the names are checked on this batch
    return median_time(lambda: pipe.train_step(x, y))


def _rpcmp_hops(job, world, blocks=20, block=10):
    """Per hop, forward + backward: rpcmp's step, the bare chain (nested async RPCs and distributed autograd, nothing
    else) and its floor (the bare chain forward, no autograd: one message per hop), in this launch's processes,
    taking turns ``blocks`` times ``block`` steps each; medians. One launch to the next moves each of them by a tenth
    to a half (the floor too), so they are measured side by side in one launch, not in launches of their own."""
    pipe = rpcmp.Pipeline(job, world)
    x = torch.ones(1, 4, requires_grad=True)
    last = len(pipe.specs)  # master -> worker1 -> ... -> worker{last} -> master: last + 1 hops each way

    def bare():
        with dist_autograd.context() as ctx:
            bm.CHAIN["out"] = torch.futures.Future()
            rpc.rpc_async("worker1", bm.chain_forward, args=(1, last, x))
            dist_autograd.backward(ctx, [bm.CHAIN["out"].wait().sum()])

    def one_message_per_hop():  # forward only, no autograd: the least any pipeline sends
        bm.CHAIN["out"] = torch.futures.Future()
        rpc.rpc_async("worker1", bm.chain_forward, args=(1, last, x.detach()))
        bm.CHAIN["out"].wait()
    steps = {"rpcmp": lambda: pipe.train_step(x, None), "bare": bare, "one_message": one_message_per_hop}
    times = {k: [] for k in steps}
    for step in steps.values():
        for _ in range(20):
            step()
    for _ in range(blocks):
        for name, step in steps.items():
            for _ in range(block):
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) / (last + 1) for k, v in times.items()}


def _rpcmp_unet_memory(job, world):
    x, y = unet_data(*MEMORY_BATCH)
    pipe = rpcmp.Pipeline(job, world, sample=x)
    for _ in range(2):
        pipe.train_step(x, y)
    procs = [f"worker{r}" for r in range(1, world)]
    return {"master": peak_rss_mib(), **{p: rpc.rpc_sync(p, peak_rss_mib) for p in procs}}


def _rpcmp_ddp(job, world):
    from rpcmp.train.ddp import DDPEngine
    engine = DDPEngine(job)
    x, y = mlp_data()
    rank = torch.distributed.get_rank()
    local = slice(rank * engine.local_batch, (rank + 1) * engine.local_batch)
    return median_time(lambda: engine.train_step([(x[local], y[local])]))


def _ddp_handwritten(rank, port, queue):
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(bm.mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = mlp_data()
    x, y = x[rank * 128:(rank + 1) * 128], y[rank * 128:(rank + 1) * 128]

    def step():
        opt.zero_grad()
        bm.mse(model(x), y).backward()
        opt.step()
    t = median_time(step)
    if rank == 0:
        queue.put(t)
    dist.destroy_process_group()


# -- one process ----------------------------------------------------------------------
def _one_process(kind, threads, queue):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = bm.mlp() if kind == "mlp" else bm.unet()
    loss_fn = bm.mse if kind == "mlp" else bm.bce
    x, y = mlp_data() if kind == "mlp" else unet_data(*MEMORY_BATCH) if kind == "unet-memory" else unet_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    if kind == "unet-memory":
        step(), step()
        queue.put(peak_rss_mib())
    else:
        queue.put(median_time(step))


# -- what no 2-stage pipeline of one thread per stage can beat: its compute alone --------------
def _compute_bound(m, queue):
    """The MLP's two stages, 1 thread, one micro-batch of 256 / m rows at a time, no communication:
    a GPipe-ordered pipeline of them takes at least sum over stages of (F + B) + (m - 1) x the
    slowest stage's F + B, plus the slower stage's optimizer step."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    full = bm.mlp()
    x, y = mlp_data()
    x, y = x[:len(x) // m], y[:len(y) // m]
    per_stage = []
    for part in (full[:8], full[8:]):
        inp = x.clone().requires_grad_()
        opt = torch.optim.SGD(part.parameters(), lr=0.01)
        fwd = median_time(lambda: part(inp))
        out = part(inp)
        bwd = median_time(lambda: part(inp).backward(torch.ones_like(out))) - fwd
        per_stage.append((fwd + bwd, median_time(opt.step)))
    work = [fb for fb, _ in per_stage]
    queue.put(sum(work) + (m - 1) * max(work) + max(o for _, o in per_stage))


# -- torch.distributed.pipelining -----------------------------------------------------
PIPELINING = {  # model: (processes, micro-batch counts)
    "mlp": (2, (1, 4, 8)),
    "unet": (3, (4,)),
}


def _pipelining(rank, port, queue, kind, addr="127.0.0.1", iface="lo", timer=None):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=iface)
    world, counts = PIPELINING[kind]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if kind == "mlp":
        torch.manual_seed(0)
        full = bm.mlp()
        module, loss_fn, (x, y) = (full[:8] if rank == 0 else full[8:]), bm.mse, mlp_data()
    else:  # the same three parts rpcmp's Unet job declares, with the same seeded weights
        module = bm.UnetStage(["encoder", "decoder", "segmentation_head"][rank])
        loss_fn, (x, y) = bm.bce, unet_data()
    out = {key: (timer or median_time)(step)
           for key, step in bm.pipelining_steps(module, rank, world, counts, loss_fn, x, y).items()}
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


# -- hand-written RPC: RemoteModules called one after the other from the master ----
def _hand_rpc(rank, port, queue, addr="127.0.0.1", iface="lo", timer=None):
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), TP_SOCKET_IFNAME=iface, GLOO_SOCKET_IFNAME=iface)
    opts = rpc.TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])
    rpc.init_rpc("master" if rank == 0 else f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
    if rank == 0:
        enc = RemoteModule("worker1/cpu", bm.Part, args=("encoder",))
        dec = RemoteModule("worker2/cpu", bm.Part, args=("decoder",))
        head = bm.Part("segmentation_head")
        params = enc.remote_parameters() + dec.remote_parameters() + [rpc.RRef(p) for p in head.parameters()]
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
        x, y = unet_data()

        def step():
            with dist_autograd.context() as ctx:
                loss = bm.bce(head(dec.forward(enc.forward(x))), y)
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
        queue.put((timer or median_time)(step))
    rpc.shutdown()


def spawn(target, nprocs, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, queue) + args) for r in range(nprocs)]
    for p in procs:
        p.start()
    result = queue.get(timeout=900)
    for p in procs:
        p.join(120)
    return result


def _run(target, *args):
    """``target(*args, queue)`` in a fresh process; its result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, queue))
    p.start()
    result = queue.get(timeout=900)
    p.join(60)
    return result


def one_process(kind, threads):
    return _run(_one_process, kind, threads)


def mlp_rounds(console, res, rounds):
    """rpcmp, pipelining, one process and the compute floor, ``rounds`` launches each, taking turns."""
    console.print(f"[bold]MLP 8x Linear(1024,1024)+ReLU, batch 256, 2 stages on 2 processes, 1 thread each; "
                  f"rpcmp, pipelining, one process and the compute floor alternate, {rounds} launches each")
    pairs, alone = [], []
    for _ in range(rounds):
        ours = launch_local(os.path.join(JOBS, "mlp.py"), 2, _rpcmp_mlp, master_in_process=False)
        pairs.append((ours, spawn(_pipelining, 2, "mlp")))
        # One process and the compute floor anchor the "vs one process" rows: a launch can
        # lose the second core to the host (2 threads read 153 ms once, 88-106 ms otherwise).
        alone.append({**{t: one_process("mlp", t) for t in (1, 2)},
                      **{f"bound_m{m}": _run(_compute_bound, m) for m in (1, 4, 8)}})
    res["rpcmp_mlp"] = {m: statistics.median(r[0][m] for r in pairs) for m in (1, 4, 8)}
    res["rpcmp_mlp_schedules"] = {k: statistics.median(r[0][k] for r in pairs) for k in pairs[0][0] if isinstance(k, str)}
    res["pipelining_mlp"] = {k: statistics.median(r[1][k] for r in pairs) for k in pairs[0][1]}
    res["mlp_ratio_per_round"] = {m: [ours[m] / _best(peer, m) for ours, peer in pairs] for m in (1, 4, 8)}
    res["mlp_like_ratio_per_round"] = {m: [_best(ours, m) / _best(peer, m) for ours, peer in pairs] for m in (1, 4, 8)}
    res["mlp_rounds"] = [{"rpcmp": ours, "pipelining": peer} for ours, peer in pairs]
    res["one_process_mlp"] = {t: statistics.median(a[t] for a in alone) for t in (1, 2)}
    res["mlp_compute_bound"] = {m: statistics.median(a[f"bound_m{m}"] for a in alone) for m in (1, 4, 8)}
    res["mlp_alone_rounds"] = alone


def hops(console, res, rounds):
    """rpcmp's hops, the bare chain and its floor, on uv and shm, ``rounds`` launches each (all three measured side by
    side in each: :func:`_rpcmp_hops`); medians over the launches."""
    console.print(f"[bold]overhead per hop: 1x4 tensor through 3 identity stages on 3 workers; rpcmp, the bare chain "
                  f"and its floor take turns in the same processes, {rounds} launches per transport")
    hops_job = os.path.join(JOBS, "hops.py")
    runs = []
    for _ in range(rounds):
        one = {}
        for t in ("uv", "shm"):
            measured = launch_local(hops_job, 4, _rpcmp_hops, master_in_process=False, overrides={"transport": t})
            one.update({f"{k}_{t}": v for k, v in measured.items()})
        runs.append(one)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    res["hop_s"], res["hop_s_shm"] = med["rpcmp_uv"], med["rpcmp_shm"]
    res["bare_hop_s"] = {t: med[f"bare_{t}"] for t in ("uv", "shm")}
    res["one_message_hop_s"] = {t: med[f"one_message_{t}"] for t in ("uv", "shm")}
    res["hop_floor_ratio_per_round"] = {t: [r[f"rpcmp_{t}"] / (2 * r[f"one_message_{t}"]) for r in runs]
                                        for t in ("uv", "shm")}
    res["hop_rounds"] = runs


def mlp_side_by_side(console, res, rounds):
    console.print(f"[bold]MLP as above, rpcmp and pipelining's GPipe / 1F1B taking turns in the same 2 processes, "
                  f"{rounds} launches")
    runs = [launch_local(os.path.join(JOBS, "mlp.py"), 2, _mlp_side_by_side, master_in_process=False)
            for _ in range(rounds)]
    res["mlp_side_by_side_rounds"] = runs
    res["mlp_side_by_side_ratio_per_round"] = {m: [r[m][0] / r[m][1] for r in runs] for m in (1, 4, 8)}


def report_side_by_side(console, res):
    for m, ratios in res["mlp_side_by_side_ratio_per_round"].items():
        ours = statistics.median(r[m][0] for r in res["mlp_side_by_side_rounds"])
        peer = statistics.median(r[m][1] for r in res["mlp_side_by_side_rounds"])
        console.print(f"MLP M={m}, same processes: rpcmp {ours * 1e3:.1f} ms vs pipelining's best {peer * 1e3:.1f} ms; "
                      f"ratio per launch " + ", ".join(f"{r:.3f}" for r in ratios)
                      + f" (median {statistics.median(ratios):.3f})")


def _best(run: dict, m: int) -> float:
    """The faster of a launch's GPipe and 1F1B steps at M = ``m`` (pipelining runs no 1F1B below M = 2; rpcmp's
    M = 1 step is every schedule's)."""
    return min(run[k] for k in (f"gpipe_m{m}", f"1f1b_m{m}") if k in run) if m > 1 or m not in run else run[m]


@click.command()
@click.option("--out", default="bench-results/bench.json", show_default=True)
@click.option("--rounds", default=ROUNDS, show_default=True, help="Alternating launches of rpcmp and its peer.")
@click.option("--only", type=click.Choice(["all", "mlp", "mlp-same", "hops"]), default="all", show_default=True,
              help="mlp: the loopback MLP comparison alone (rpcmp vs pipelining at M = 1, 4, 8, in launches of their "
                   "own and taking turns in the same processes); mlp-same: the latter alone; hops: the per-hop rows alone (rpcmp against its "
                   "floors, uv and shm).")
def main(out, rounds, only):
    console = Console()
    res = {}
    if only in ("hops", "mlp-same"):
        (hops if only == "hops" else mlp_side_by_side)(console, res, rounds)
        (report_hops if only == "hops" else report_side_by_side)(console, res)
        _write(console, res, out)
        return
    mlp_rounds(console, res, rounds)
    mlp_side_by_side(console, res, rounds)
    if only == "mlp":
        report_mlp(console, res)
        report_side_by_side(console, res)
        _write(console, res, out)
        return
    res["rpcmp_mlp_shm"] = launch_local(os.path.join(JOBS, "mlp.py"), 2, _rpcmp_mlp, master_in_process=False,
                                        overrides={"transport": "shm"})
    console.print("[bold]DDP mode: the same MLP, 2 ranks x 128 samples, gloo, 1 thread each")
    res["rpcmp_ddp_mlp"] = launch_local(os.path.join(JOBS, "mlp.py"), 2, _rpcmp_ddp, master_in_process=False,
                                        overrides={"mode": "ddp"})
    res["handwritten_ddp_mlp"] = spawn(_ddp_handwritten, 2)
    console.print("[bold]split Unet (resnet34), batch 16 of 1x128x128, 3 stages on 3 processes, M = 4; "
                  f"rpcmp and pipelining alternate, {rounds} launches each")
    unet = [(launch_local(os.path.join(JOBS, "unet.py"), 3, _rpcmp_unet, master_in_process=False),
             spawn(_pipelining, 3, "unet")) for _ in range(rounds)]
    res["rpcmp_unet"] = statistics.median(ours for ours, _ in unet)
    res["pipelining_unet"] = {k: statistics.median(peer[k] for _, peer in unet) for k in unet[0][1]}
    res["unet_ratio_per_round"] = [ours / min(peer.values()) for ours, peer in unet]
    res["unet_rounds"] = [{"rpcmp": ours, "pipelining": peer} for ours, peer in unet]
    res["rpcmp_unet_shm"] = launch_local(os.path.join(JOBS, "unet.py"), 3, _rpcmp_unet, master_in_process=False,
                                         overrides={"transport": "shm"})
    res["rpcmp_unet_recompute"] = launch_local(os.path.join(JOBS, "unet.py"), 3, _rpcmp_unet, master_in_process=False,
                                               overrides={"recompute": True})
    res["hand_rpc_unet"] = spawn(_hand_rpc, 3)
    hops(console, res, rounds)
    console.print(f"[bold]peak memory: split Unet vs one process, batch {MEMORY_BATCH[0]} of 1x{MEMORY_BATCH[1]}^2, SGD "
                  f"(M = 4; and M = 8, overlap vs 1f1b)")
    # The largest process's peak moves by up to ~7% from one launch of the same code to the
    # next (1762-1884 MiB seen): report the launch with the median one, of the rounds.
    peaks = [launch_local(os.path.join(JOBS, "unet.py"), 3, _rpcmp_unet_memory, master_in_process=False)
             for _ in range(rounds)]
    res["unet_memory_mib"] = sorted(peaks, key=lambda procs: max(procs.values()))[len(peaks) // 2]
    res["unet_memory_largest_per_round"] = [max(procs.values()) for procs in peaks]
    res["unet_memory_recompute_mib"] = launch_local(os.path.join(JOBS, "unet.py"), 3, _rpcmp_unet_memory,
                                                    master_in_process=False, overrides={"recompute": True})
    for sched in ("overlap", "1f1b"):
        res[f"unet_memory_m8_{sched}_mib"] = launch_local(os.path.join(JOBS, "unet.py"), 3, _rpcmp_unet_memory,
                                                          master_in_process=False,
                                                          overrides={"microbatches": 8, "schedule": sched})
    res["one_process_unet_memory_mib"] = one_process("unet-memory", 1)
    report(console, res)
    _write(console, res, out)


def _write(console, res, out):
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2, default=str)
    console.print(f"wrote {out}")


def report(console, res):
    pipe = res["pipelining_mlp"]
    one = min(res["one_process_mlp"].values())
    table = Table(title="rpcmp benchmarks (median step time; ratio < 1 means rpcmp is faster)")
    for col in ("comparison", "rpcmp", "peer", "ratio rpcmp/peer"):
        table.add_column(col, justify="left" if col == "comparison" else "right")
    for m in (1, 4, 8):
        ours = res["rpcmp_mlp"][m]
        best = _best(pipe, m)
        table.add_row(f"MLP M={m} vs best of pipelining GPipe/1F1B", f"{ours * 1e3:.0f} ms", f"{best * 1e3:.0f} ms", f"{ours / best:.2f}")
        table.add_row(f"MLP M={m} vs one process (best of 1, 2 threads)", f"{ours * 1e3:.0f} ms", f"{one * 1e3:.0f} ms", f"{ours / one:.2f}")
        bound = res["mlp_compute_bound"][m]
        table.add_row("  its floor: 2-stage compute alone, no communication, vs one process", f"{bound * 1e3:.0f} ms",
                      f"{one * 1e3:.0f} ms", f"{bound / one:.2f}")
    for label, ours in (("uv, gpipe schedule", res["rpcmp_mlp_schedules"]["gpipe_m4"]),
                        ("uv, 1f1b schedule", res["rpcmp_mlp_schedules"]["1f1b_m4"]), ("shm transport", res["rpcmp_mlp_shm"][4])):
        table.add_row(f"MLP M=4, {label} vs default (uv, overlap)", f"{ours * 1e3:.0f} ms",
                      f"{res['rpcmp_mlp'][4] * 1e3:.0f} ms", f"{ours / res['rpcmp_mlp'][4]:.2f}")
    table.add_row("split Unet M=4, shm vs uv transport", f"{res['rpcmp_unet_shm'] * 1e3:.0f} ms",
                  f"{res['rpcmp_unet'] * 1e3:.0f} ms", f"{res['rpcmp_unet_shm'] / res['rpcmp_unet']:.2f}")
    ours, hand = res["rpcmp_ddp_mlp"], res["handwritten_ddp_mlp"]
    table.add_row("DDP mode vs a hand-written DDP loop (MLP, 2 ranks)", f"{ours * 1e3:.0f} ms", f"{hand * 1e3:.0f} ms",
                  f"{ours / hand:.3f}")
    ours, (kind, best) = res["rpcmp_unet"], min(res["pipelining_unet"].items(), key=lambda kv: kv[1])
    table.add_row(f"split Unet M=4 vs best of pipelining GPipe/1F1B ({kind})", f"{ours * 1e3:.0f} ms",
                  f"{best * 1e3:.0f} ms", f"{ours / best:.2f}")
    ours, hand = res["rpcmp_unet"], res["hand_rpc_unet"]
    table.add_row("split Unet M=4 vs hand-written RemoteModule RPC", f"{ours * 1e3:.0f} ms", f"{hand * 1e3:.0f} ms",
                  f"{ours / hand:.2f} (throughput x{hand / ours:.2f})")
    _hop_rows(table, res)
    table.add_row("split Unet M=4, recompute vs not", f"{res['rpcmp_unet_recompute'] * 1e3:.0f} ms",
                  f"{res['rpcmp_unet'] * 1e3:.0f} ms", f"{res['rpcmp_unet_recompute'] / res['rpcmp_unet']:.2f}")
    one = res["one_process_unet_memory_mib"]
    for label, key in (("", "unet_memory_mib"), (", recompute", "unet_memory_recompute_mib")):
        largest = max(res[key].values())
        table.add_row(f"peak RSS, largest split-Unet process{label} vs one process", f"{largest:.0f} MiB",
                      f"{one:.0f} MiB", f"{largest / one:.2f}")
    overlap, capped = (max(res[f"unet_memory_m8_{s}_mib"].values()) for s in ("overlap", "1f1b"))
    table.add_row("peak RSS, largest split-Unet process, M=8: 1f1b vs overlap schedule", f"{capped:.0f} MiB",
                  f"{overlap:.0f} MiB", f"{capped / overlap:.2f}")
    console.print(table)
    report_mlp(console, res)
    report_side_by_side(console, res)
    report_hop_rounds(console, res)
    console.print(f"split Unet M=4 vs pipelining, medians over {len(res['unet_ratio_per_round'])} alternating "
                  "launches; ratio per launch: " + ", ".join(f"{r:.2f}" for r in res["unet_ratio_per_round"]))
    console.print(f"largest split-Unet process over {len(res['unet_memory_largest_per_round'])} launches: "
                  + ", ".join(f"{v:.0f} MiB" for v in res["unet_memory_largest_per_round"]))
    for key in ("unet_memory_mib", "unet_memory_recompute_mib"):
        console.print(f"{key} per process: " + ", ".join(f"{k} {v:.0f}" for k, v in res[key].items()))


def _hop_rows(table, res):
    for t, key in (("uv", "hop_s"), ("shm", "hop_s_shm")):
        table.add_row(f"overhead per hop, forward + backward ({t}) vs bare nested RPC + dist autograd",
                      f"{res[key] * 1e3:.3f} ms", f"{res['bare_hop_s'][t] * 1e3:.3f} ms",
                      f"{res[key] / res['bare_hop_s'][t]:.2f}")
        floor = 2 * res["one_message_hop_s"][t]
        table.add_row(f"  its floor ({t}): 2 one-way messages (bare forward chain, no autograd, x2)",
                      f"{res[key] * 1e3:.3f} ms", f"{floor * 1e3:.3f} ms", f"{res[key] / floor:.2f}")


def report_hops(console, res):
    table = Table(title="rpcmp per hop (median step time / hops; ratio < 1 means rpcmp is faster)")
    for col in ("comparison", "rpcmp", "peer", "ratio rpcmp/peer"):
        table.add_column(col, justify="left" if col == "comparison" else "right")
    _hop_rows(table, res)
    console.print(table)
    report_hop_rounds(console, res)


def report_hop_rounds(console, res):
    for t, per in res["hop_floor_ratio_per_round"].items():
        console.print(f"per hop ({t}) against its floor, medians over {len(per)} launches; ratio per "
                      f"launch: " + ", ".join(f"{r:.2f}" for r in per))


def report_mlp(console, res):
    """The loopback MLP against pipelining's best schedule at each M: ratios of the medians and per launch."""
    mine = {**res["rpcmp_mlp_schedules"], 1: res["rpcmp_mlp"][1]}
    for m, per in res["mlp_ratio_per_round"].items():
        ours, best = res["rpcmp_mlp"][m], _best(res["pipelining_mlp"], m)
        like = res["mlp_like_ratio_per_round"][m]
        console.print(f"MLP M={m}: rpcmp (overlap) {ours * 1e3:.1f} ms vs pipelining's best {best * 1e3:.1f} ms, ratio of "
                      f"the medians over {len(per)} alternating launches {ours / best:.2f}; per launch: "
                      + ", ".join(f"{r:.2f}" for r in per) + f" (median {statistics.median(per):.2f})")
        if m > 1:
            console.print(f"  best of GPipe / 1F1B in each: rpcmp {_best(mine, m) * 1e3:.1f} ms vs {best * 1e3:.1f} ms, "
                          f"{_best(mine, m) / best:.2f}; per launch: " + ", ".join(f"{r:.2f}" for r in like)
                          + f" (median {statistics.median(like):.2f})")


if __name__ == "__main__":
    main()
