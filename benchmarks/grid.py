"""Pipeline x data parallel against its neighbours: the same 4 processes (1 thread each, the same
cores) as 2 replicas x 2 stages, as 1 pipeline of 4 stages, and as DDP on 4 ranks, on the MLP
and the split Unet of bench.py, the same global batch. Part of ``make bench``.

    .venv/bin/python benchmarks/grid.py [--out FILE]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from functools import partial

import click
import torch
from rich.console import Console
from rich.table import Table

import rpcmp
from rpcmp.launch.local import launch_local

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "jobs"))
from bench import median_time, mlp_data, unet_data  # noqa: E402

ROUNDS = 3  # alternating launches of each layout

JOBS = {"mlp": os.path.join(HERE, "jobs", "mlp.py"), "unet": os.path.join(HERE, "jobs", "unet.py")}
DATA = {"mlp": mlp_data, "unet": unet_data}
LAYOUTS = {  # name -> overrides of the bench job, per model
    "2 replicas x 2 stages": {"mlp": {"replicas": 2, "placement": "auto"},
                              "unet": {"replicas": 2, "stages": rpcmp.SplitAt("decoder")}},
    "1 x 4 stages": {"mlp": {"stages": rpcmp.Split([4, 4, 4, 4]), "placement": "auto"},
                     "unet": {"stages": rpcmp.SplitAt("encoder.layer3", "decoder", "segmentation_head")}},
    "DDP on 4 ranks": {"mlp": {"mode": "ddp"}, "unet": {"mode": "ddp"}},
}


def _steps(kind, job, world_size):
    """Median step time of ``job`` (its mode and layout) on the model ``kind``'s bench batch."""
    x, y = DATA[kind]()
    if job.mode == "ddp":
        from rpcmp.train.ddp import DDPEngine
        engine = DDPEngine(job)
        rank = torch.distributed.get_rank()
        return median_time(lambda: engine.train_step([(x[rank::world_size], y[rank::world_size])]))
    from rpcmp.master.replicas import Replicated
    # the bench jobs have no data: SplitAt traces this batch
    pipe = (Replicated(job, world_size, rpcmp.Pipeline, sample=x) if job.replicas > 1
            else rpcmp.Pipeline(job, world_size, sample=x))
    seconds = median_time(lambda: pipe.train_step(x, y))
    if job.replicas > 1:  # how much of the averaging ran behind the backward (rpcmp/owner/reduce.py)
        stats = pipe.stats()
        took, waited = sum(s["reduce_s"] for s in stats), sum(s["reduce_wait_s"] for s in stats)
        print(f"{kind} 2 x 2: all_reduce {took * 1e3:.0f} ms in all, {waited * 1e3:.0f} ms of it waited for at the step's "
              f"end ({1 - waited / took:.0%} behind the backward)", flush=True)
    return seconds


@click.command()
@click.option("--out", default="bench-results/grid.json", show_default=True)
def main(out):
    console = Console()
    console.print(f"[bold]4 processes, 1 thread each, on this machine's cores: 2 replicas x 2 stages vs 1 x 4 stages vs "
                  f"DDP on 4; MLP batch 256, split Unet batch 16 of 1x128x128, M=4 (M=2 per replica); median step, "
                  f"{ROUNDS} alternating launches")
    res = {}
    for kind in ("mlp", "unet"):
        rounds = []
        for _ in range(ROUNDS):
            rounds.append({name: launch_local(JOBS[kind], 4, partial(_steps, kind), master_in_process=False,
                                              overrides={"threads": 1, "microbatches": 2 if "replicas" in o[kind] else 4,
                                                         **o[kind]})
                           for name, o in LAYOUTS.items()})
        res[kind] = {name: statistics.median(r[name] for r in rounds) for name in LAYOUTS}
        res[f"{kind}_rounds"] = rounds
    table = Table(title="pipeline x data parallel: ms per step, same 4 processes")
    table.add_column("layout")
    for kind in ("mlp", "unet"):
        table.add_column(kind, justify="right")
    for name in LAYOUTS:
        table.add_row(name, *(f"{res[k][name] * 1e3:.0f}" for k in ("mlp", "unet")))
    console.print(table)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
