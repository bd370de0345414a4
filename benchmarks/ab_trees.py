"""Two source trees of rpcmp against each other (a commit before and after a change), in
alternating launches of the bench's own MLP or split-Unet step (M=4 unless ``--microbatches``).

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/ab_trees.py /tmp/before . --rounds 4 [--job unet] [--replicas 2] [--schedule 1f1b]

Each launch runs in a fresh interpreter with ``PYTHONPATH`` set to its tree (benchmarks/trees.py), so the tree's
own ``rpcmp`` is the one imported (and the tree's own ``benchmarks/bench.py`` measures).
The median over launches of each launch's median step time is reported. ``--replicas 2``:
the grid bench's 2 replicas x 2 stages layout instead (4 processes, 1 thread each; the grid bench has M=2).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile

import click

from trees import tree_env

_LAUNCH = r'''
import os, sys
tree = sys.argv[1]
sys.path[:0] = [os.path.join(tree, "benchmarks"), tree]
import rpcmp, bench
try:
    from rpcmp.launch.local import launch_local
except ImportError:  # trees from before the subpackages (rpcmp/launch/)
    try:
        from rpcmp.local import launch_local
    except ImportError:  # trees from before rpcmp/local.py
        from rpcmp.runtime import launch_local

def main(job, world):
    x, y = bench.mlp_data() if sys.argv[2] == "mlp" else bench.unet_data()
    if job.replicas > 1:
        from functools import partial
        try:
            from rpcmp.master.replicas import Replicated
        except ImportError:  # trees from before the subpackages
            from rpcmp.replicas import Replicated
        try:
            pipe = Replicated(job, world, rpcmp.Pipeline, sample=x)
        except TypeError:  # trees whose Replicated took a pipeline factory
            pipe = Replicated(job, world, partial(rpcmp.Pipeline, sample=x))
        return bench.median_time(lambda: pipe.train_step(x, y))
    try:
        pipe = rpcmp.Pipeline(job, world, microbatches=int(sys.argv[4]), sample=x)  # SplitAt traces on it
    except TypeError:  # trees from before Pipeline(sample=...)
        pipe = rpcmp.Pipeline(job, world, microbatches=int(sys.argv[4]))
    seconds = bench.median_time(lambda: pipe.train_step(x, y))
    pipe.close()
    return seconds

if __name__ == "__main__":
    overrides = {"schedule": os.environ["AB_SCHEDULE"]} if os.environ.get("AB_SCHEDULE") else {}
    world = 2 if sys.argv[2] == "mlp" else 3
    if len(sys.argv) > 5:  # the grid bench's 2 x 2 layout
        world, overrides = 4, {"replicas": int(sys.argv[5]), "threads": 1, "microbatches": int(sys.argv[4])}
        overrides.update({"placement": "auto"} if sys.argv[2] == "mlp" else {"stages": rpcmp.SplitAt("decoder")})
    print("RESULT", launch_local(sys.argv[3], world, main, overrides=overrides, master_in_process=False))
'''


@click.command()
@click.argument("trees", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--job", type=click.Choice(["mlp", "unet", "unet_cut"]), default="mlp", show_default=True,
              help="A job of this tree's benchmarks/jobs (unet_cut: the Unet cut inside its encoder, SplitAt).")
@click.option("--rounds", type=int, default=4, show_default=True)
@click.option("--replicas", type=int, default=1, show_default=True, help="2: 2 replicas x 2 stages on 4 processes.")
@click.option("--microbatches", type=int, default=4, show_default=True)
@click.option("--schedule", type=click.Choice(["overlap", "1f1b", "gpipe"]), default=None,
              help="The jobs' own schedule unless given.")
def main(trees, job, rounds, replicas, microbatches, schedule):
    times = {t: [] for t in trees}
    launcher = os.path.join(tempfile.mkdtemp(), "launch.py")  # a file: spawned children re-import the main module
    with open(launcher, "w") as f:
        f.write(_LAUNCH)
    for r in range(rounds):
        for tree in trees:
            tree_abs = os.path.abspath(tree)
            job_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", job + ".py")  # same in both
            grid = [str(replicas)] if replicas > 1 else []
            out = subprocess.run([sys.executable, launcher, tree_abs, "mlp" if job == "mlp" else "unet", job_file, str(microbatches), *grid],
                                 capture_output=True, text=True,
                                 cwd=tree_abs, timeout=600, env={**tree_env(tree_abs), "AB_SCHEDULE": schedule or ""})
            found = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
            if not found:
                raise click.ClickException(f"{tree}: no result\n{out.stderr[-2000:]}")
            times[tree].append(float(found[0].split()[1]) * 1000)
            print(f"round {r + 1} {tree}: {times[tree][-1]:.1f} ms", flush=True)
    for tree, ts in times.items():
        print(f"{tree}: median {statistics.median(ts):.1f} ms over {len(ts)} launches ({', '.join(f'{t:.1f}' for t in ts)})")


if __name__ == "__main__":
    main()
