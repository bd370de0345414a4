"""Start-up of a local run: from the command's start to the end of its first training step.

    .venv/bin/python benchmarks/startup.py . --rounds 3                   # spawned vs a warm server vs this process
    .venv/bin/python benchmarks/startup.py /tmp/before . --method forkserver  # two trees

Each launch is a fresh interpreter (as ``rpcmp run JOB --local 3`` is) with ``PYTHONPATH``
set to the tree (benchmarks/trees.py): it imports rpcmp, starts the 2 stage processes with the master in itself,
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

from trees import tree_env

# The master's part, in a module of its own (benchmarks/trees.py puts it on PYTHONPATH) so that
# both kinds of launcher can hand it to their processes by reference.
_MAIN = r'''
import time
import bench
import rpcmp


def main(job, world):
    if "unet" in (job.source or ""):
        x, y = bench.unet_data()
    else:  # another job: its first batch
        from torch.utils.data import default_collate
        data = job.data()[0]
        x, y = default_collate([data[i] for i in range(job.batch_size)])
    pipe = rpcmp.Pipeline(job, world, microbatches=4, sample=x)
    built = time.time()
    pipe.train_step(x, y)
    return built, time.time()
'''

_LAUNCH = r'''
import os, sys
t0 = float(sys.argv[3])
tree = sys.argv[1]
sys.path[:0] = [os.path.join(tree, "benchmarks"), tree]
here = os.environ.pop("BENCH_FORK_HERE", "") == "1"
try:  # the fork server imports while this process does (as `rpcmp run --local` did before it forked from itself)
    from rpcmp.launch.server import start_server
    if not here:
        start_server(sys.argv[2])
except ImportError:  # trees from before it
    pass
try:
    from rpcmp.launch.local import launch_local
except ImportError:  # trees from before the subpackages (rpcmp/launch/)
    from rpcmp.local import launch_local
from rpcmp_startup import main

if __name__ == "__main__":
    built, first = launch_local(sys.argv[2], 3, main, **({"fork_here": True} if here else {}))
    print("RESULT", built - t0, first - t0)
'''


@click.command()
@click.argument("trees", nargs=-1, required=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--job", default="examples/unet_split/job.py", show_default=True, help="The job file, relative to each tree.")
@click.option("--method", "methods", multiple=True, default=("spawn", "forkserver", "fork-here"), show_default=True,
              help="How the launcher starts the ranks (RPCMP_START_METHOD, or fork-here: from the launching "
                   "process, as `rpcmp run --local` does); each is measured.")
def main(trees, rounds, job, methods):
    """Time to the first step of a 3-process local run, for each source tree and start method."""
    runs = [(tree, method) for tree in trees for method in methods]
    times = {run: [] for run in runs}
    for _ in range(rounds):
        for tree, method in runs:
            env = {**tree_env(tree, {"rpcmp_startup.py": _MAIN}), "RPCMP_START_METHOD": method.replace("fork-here", "forkserver"),
                   "BENCH_FORK_HERE": "1" if method == "fork-here" else "0"}
            start = time.time()
            out = subprocess.run([sys.executable, "-c", _LAUNCH, os.path.abspath(tree), os.path.join(os.path.abspath(tree), job), str(start)],
                                 capture_output=True, text=True, env=env, cwd=os.path.abspath(tree), check=False)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
            if line is None:
                raise SystemExit(f"{tree} ({method}) failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
            built, first = map(float, line.split()[1:])
            times[(tree, method)].append((built, first))
            print(f"{tree} ({method}): pipeline built at {built:.2f} s, first step done at {first:.2f} s", flush=True)
    for (tree, method), ts in times.items():
        print(f"{tree} ({method}): median time to the first step {statistics.median(f for _, f in ts):.2f} s "
              f"(pipeline built at {statistics.median(b for b, _ in ts):.2f} s) over {len(ts)} launches")


if __name__ == "__main__":
    main()
