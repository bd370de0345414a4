"""``--rebalance`` against the best balance, measured in one run of this script.

    make bench            # or: .venv/bin/python benchmarks/rebalance.py [--steps 40]

The bench MLP as 8 equal blocks (benchmarks/jobs/uneven_mlp.py), three launches of ``rpcmp run``
with one thread per process: the uneven cut with ``--rebalance``, the same without, and the balance
``rpcmp plan`` calls best for it (by parameters). Figures: the median step time of the last 10 steps
of each, and the re-cuts. A cut only matters when each stage has a core of its own (with fewer
cores the processes share them and every cut runs at the speed of the total work): with 4 usable
cores or more the cuts are [1, 5, 2] and [3, 3, 2] on 3 stages, with fewer [1, 7] and [4, 4] on 2.
Writes bench-results/rebalance.json.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import uuid

import click
from rich.console import Console
from rich.table import Table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "jobs", "uneven_mlp.py")
RPCMP = os.path.join(os.path.dirname(sys.executable), "rpcmp")


def _run(balance: str, steps: int, metrics: str, *extra: str) -> tuple[list[dict], str]:
    local = str(balance.count(",") + 2)  # the master and one process per stage
    done = subprocess.run([RPCMP, "run", JOB, "--local", local, "--threads", "1", "--max-steps", str(steps),
                           "--metrics", metrics, *extra],
                          capture_output=True, text=True, env={**os.environ, "BALANCE": balance, "COLUMNS": "200"},
                          timeout=1800)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    return [r for r in map(json.loads, open(metrics)) if r.get("kind") == "step"], done.stdout


@click.command()
@click.option("--steps", default=40, show_default=True)
@click.option("--out", default=os.path.join(ROOT, "bench-results", "rebalance.json"), show_default=True)
def main(steps: int, out: str) -> None:
    work = os.path.join(ROOT, "bench-results", f"rebalance-{uuid.uuid4().hex[:8]}")
    os.makedirs(work)
    from rpcmp.launch.runtime import usable_cpus
    uneven, best = ("1,5,2", "3,3,2") if usable_cpus() >= 4 else ("1,7", "4,4")
    runs = {f"[{uneven}] --rebalance": (uneven, ["--rebalance"]), f"[{uneven}]": (uneven, []),
            f"[{best}] (best)": (best, [])}
    result, table = {}, Table(title=f"re-cut while training: median step time of steps {steps - 9}-{steps}")
    for col in ("run", "median step s", "vs best", "re-cuts"):
        table.add_column(col, justify="right")
    for name, (balance, extra) in runs.items():
        steps_, log = _run(balance, steps, os.path.join(work, f"{balance}{''.join(extra)}.jsonl"), *extra)
        cuts = re.findall(r"re-cut after step \d+: balance \[[\d, ]+\] -> \[[\d, ]+\]", log)
        result[name] = {"median_step_s": statistics.median(r["step_s"] for r in steps_[-10:]), "re_cuts": cuts}
    best = result[f"[{best}] (best)"]["median_step_s"]
    for name, r in result.items():
        r["vs_best"] = r["median_step_s"] / best
        table.add_row(name, f"{r['median_step_s']:.3f}", f"{r['vs_best']:.2f}x", "; ".join(r["re_cuts"]) or "-")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    json.dump(result, open(out, "w"), indent=2)
    Console(width=200).print(table)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
