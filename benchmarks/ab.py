"""Two or more settings of the same job against each other, in alternating launches.

    .venv/bin/python benchmarks/ab.py schedule=overlap schedule=1f1b --rounds 5
    .venv/bin/python benchmarks/ab.py transport=uv transport=shm --job unet

Each argument is one arm: comma-separated Job overrides (``key=value``; numbers and
true/false are converted). Launch-to-launch noise on a small shared machine is larger
than most effects worth measuring, so the arms alternate, launch after launch, and the
median over launches of each launch's median step time is reported.
"""
from __future__ import annotations

import os
import statistics

import click
from rich.console import Console

from bench import JOBS, mlp_data, median_time, unet_data

import rpcmp
from rpcmp.launch.local import launch_local

WORLD = {"mlp": 2, "unet": 3}


def _value(text: str):
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _arm(text: str) -> dict:
    return {k: _value(v) for k, v in (item.split("=", 1) for item in text.split(",") if item)}


def _step_time(job, world):
    x, y = mlp_data() if world == WORLD["mlp"] else unet_data()
    pipe = rpcmp.Pipeline(job, world, sample=x)
    return median_time(lambda: pipe.train_step(x, y), warmup=3, steps=15)


@click.command()
@click.argument("arms", nargs=-1, required=True)
@click.option("--job", "job_name", type=click.Choice(sorted(WORLD)), default="mlp", show_default=True)
@click.option("--rounds", default=4, show_default=True, help="Launches of each arm.")
def main(arms, job_name, rounds):
    console = Console()
    times = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in arms:
            t = launch_local(os.path.join(JOBS, f"{job_name}.py"), WORLD[job_name], _step_time,
                             master_in_process=False, overrides=_arm(arm))
            times[arm].append(t * 1e3)
            console.print(f"round {r + 1}/{rounds}  {arm}: {t * 1e3:.1f} ms")
    for arm, ts in times.items():
        console.print(f"[bold]{arm}[/]: median {statistics.median(ts):.1f} ms over {rounds} launches "
                      f"({', '.join(f'{t:.0f}' for t in ts)})")


if __name__ == "__main__":
    main()
