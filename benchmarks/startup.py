"""Start-up of a local run: from the command's start to the end of its first training step.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/startup.py /tmp/before . --rounds 3

Each launch is a fresh interpreter (as ``rpcmp run JOB --local 3`` is) with ``PYTHONPATH``
set to the tree: it imports rpcmp, starts the 2 stage processes with the master in itself,
builds the demo Unet split and runs one training step (M=4). The launches of the trees
alternate; the median per tree is reported, with the time at which the pipeline was built
(workers started, RPC joined, stages built) beside it.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import click

_LAUNCH = r'''
import os, sys, time
t0 = float(sys.argv[3])
tree = sys.argv[1]
sys.path[:0] = [os.path.join(tree, "benchmarks"), tree]
import rpcmp, bench
try:
    from rpcmp.launch.local import launch_local
except ImportError:  # trees from before the subpackages (rpcmp/launch/)
    from rpcmp.local import launch_local

def main(job, world):
    x, y = bench.unet_data()
    pipe = rpcmp.Pipeline(job, world, microbatches=4, sample=x)
    built = time.time()
    pipe.train_step(x, y)
    return built, time.time()

if __name__ == "__main__":
    built, first = launch_local(sys.argv[2], 3, main)
    print("RESULT", built - t0, first - t0)
'''


@click.command()
@click.argument("trees", nargs=-1, required=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--job", default="examples/unet_split/job.py", show_default=True)
def main(trees, rounds, job):
    """Time to the first step of a 3-process local run, for each source tree."""
    times = {t: [] for t in trees}
    for _ in range(rounds):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            start = time.time()
            out = subprocess.run([sys.executable, "-c", _LAUNCH, os.path.abspath(tree), os.path.abspath(job), str(start)],
                                 capture_output=True, text=True, env=env, check=False)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
            if line is None:
                raise SystemExit(f"{tree} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
            built, first = map(float, line.split()[1:])
            times[tree].append((built, first))
            print(f"{tree}: pipeline built at {built:.2f} s, first step done at {first:.2f} s", flush=True)
    for tree, ts in times.items():
        print(f"{tree}: median time to the first step {statistics.median(f for _, f in ts):.2f} s "
              f"(pipeline built at {statistics.median(b for b, _ in ts):.2f} s) over {len(ts)} launches")


if __name__ == "__main__":
    main()
