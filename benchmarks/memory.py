"""Peak memory of a model split so that no process holds it whole (issue: split any model exactly).

    .venv/bin/python benchmarks/memory.py [--width 7168]     # also run by `make bench`

The model (benchmarks/jobs/big.py): 308 M parameters, ~4.6 GiB with gradients and Adam state in
one process. One process trains it 2 steps and saves a checkpoint (model + optimizer state); then
rpcmp trains it in 3 stages (master + 3 workers, one micro-batch) 2 steps with a checkpoint, and
again resumed from it for a 3rd step; then with 2 and 4 micro-batches: each further micro-batch
costs a transient of the size of the stage's weight gradients, as gradient accumulation in one
backward does, and the "overlap" schedule's per-micro-batch contexts one more. Peak RSS (``ru_maxrss``: the process's high-water mark, file pages it
mapped included) of every process, master included, against the one-process peak.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import click
import torch
import torch.distributed.rpc as rpc
from rich.console import Console

from bench import JOBS, _run, peak_rss_mib
from rpcmp.launch.local import launch_local


def _one_process(path, queue):
    sys.path.insert(0, JOBS)
    import big
    torch.set_num_threads(1)
    torch.manual_seed(big.job.seed)
    model = big.Big()
    cls, kwargs = big.job.optimizer
    opt = cls(model.parameters(), **kwargs)
    x, y = big.data()[0][:8]
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    queue.put(peak_rss_mib())


def _split(job, world):
    from rpcmp.train.trainer import fit
    fit(job, world)
    return {"master": peak_rss_mib(), **{f"worker{r}": rpc.rpc_sync(f"worker{r}", peak_rss_mib) for r in range(1, world)}}


@click.command()
@click.option("--width", type=int, default=7168, show_default=True, help="Layer width (7168: 308 M parameters).")
@click.option("--out", default="bench-results/memory.json", show_default=True)
def main(width, out):
    os.environ["RPCMP_BIG_WIDTH"] = str(width)
    console = Console()
    params = 6 * (width * width + width)
    console.print(f"[bold]peak memory, 6 x Linear({width}, {width}): {params / 1e6:.0f} M parameters, "
                  f"{params * 16 / 2**30:.2f} GiB with gradients and Adam state")
    folder = tempfile.mkdtemp(prefix="rpcmp-memory-")
    try:
        one = _run(_one_process, os.path.join(folder, "one.pt"))
        console.print(f"one process, 2 steps + checkpoint: {one:.0f} MiB")
        job = os.path.join(JOBS, "big.py")
        overrides = {"checkpoint_dir": os.path.join(folder, "split")}
        trained = launch_local(job, 4, _split, overrides=overrides, master_in_process=False)
        resumed = launch_local(job, 4, _split, overrides={**overrides, "resume": True, "max_steps": 3},
                               master_in_process=False)
        more = {(m, sched): launch_local(job, 4, _split, overrides={"microbatches": m, "schedule": sched,
                                                                    "checkpoint_dir": None}, master_in_process=False)
                for m, sched in ((2, "gpipe"), (2, "overlap"), (4, "gpipe"))}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    res = {"params": params, "one_process_mib": one, "split_mib": trained, "resumed_mib": resumed,
           **{f"m{m}_{sched}_mib": peaks for (m, sched), peaks in more.items()}}
    rows = [("3 stages, M=1, 2 steps + checkpoint", trained), ("resumed, 1 more step + checkpoint", resumed)]
    rows += [(f"M={m}, schedule {sched}, 2 steps", peaks) for (m, sched), peaks in more.items()]
    for label, peaks in rows:
        largest = max(peaks.values())
        console.print(f"{label}: " + ", ".join(f"{p} {v:.0f}" for p, v in peaks.items())
                      + f" MiB; largest / one process = [bold]{largest / one:.2f}[/]"
                      + (" (target <= 0.45)" if "M=1" in label or "resumed" in label else ""))
        res[label] = largest / one
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
