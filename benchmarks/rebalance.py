"""``--rebalance`` against the best balance, measured in one run of this script.

    make bench            # or: .venv/bin/python benchmarks/rebalance.py [--steps 40]

The bench MLP as 8 equal blocks (benchmarks/jobs/uneven_mlp.py), three launches of ``rpcmp run``
with one thread per process: the uneven cut with ``--rebalance``, the same without, and the
balance ``rpcmp plan`` calls best for it (``Split(parts=3, by="params")``). Figures: the median
step time of the last 10 steps of each, the re-cuts, and whether each run's final parameters
equal the uneven run's without a re-cut (float32 tolerance: moves do not change the math).

A cut only matters when each stage has a core of its own (with fewer cores the processes share
them and every cut runs at the speed of the total work): with 4 usable cores or more the cuts are
[1, 5, 2] and [2, 3, 3]. With fewer, ``--core-share F`` (by default 0.5, where this user may make
cgroups with the cpu controller: root) caps each stage process at F of a core in a cgroup of its
own, made for the run and removed after it, so that three stages have a (slower) core each on 2
cores, and the cuts are the same; without cgroups they are [1, 7] and [4, 4] on 2 stages. Writes
bench-results/rebalance.json.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
import uuid

import click
import torch
from rich.console import Console
from rich.table import Table

from recovery import descendant  # benchmarks/recovery.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "jobs", "uneven_mlp.py")
RPCMP = os.path.join(os.path.dirname(sys.executable), "rpcmp")


_CPU_V1 = "/sys/fs/cgroup/cpu"


def _can_cap() -> bool:
    """Whether this user may make cpu cgroups (cgroup v1's cpu controller)."""
    probe = os.path.join(_CPU_V1, f"rpcmp-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
        return True
    except OSError:
        return False


def _cap(pid: int, share: float, groups: list[str]) -> None:
    """Put process ``pid`` (all its threads) in a cgroup of its own capped at ``share`` of a core."""
    group = os.path.join(_CPU_V1, f"rpcmp-bench-{uuid.uuid4().hex[:8]}")
    os.mkdir(group)
    groups.append(group)
    period = 10_000  # 10 ms: throttled in slices much shorter than a step
    open(os.path.join(group, "cpu.cfs_period_us"), "w").write(str(period))
    open(os.path.join(group, "cpu.cfs_quota_us"), "w").write(str(int(share * period)))
    open(os.path.join(group, "cgroup.procs"), "w").write(str(pid))


def _stage_processes(root: int, count: int) -> list[int]:
    """The processes rpcmp-worker1 .. rpcmp-worker{count} of the run started as ``root``, once all are there."""
    try:
        return [descendant(root, f"worker{r}") for r in range(1, count + 1)]
    except RuntimeError:  # not all started yet
        return []


def _run(balance: str, steps: int, metrics: str, *extra: str, share: float = 0.0) -> tuple[list[dict], str]:
    stages = balance.count(",") + 1
    proc = subprocess.Popen([RPCMP, "run", JOB, "--local", str(stages + 1), "--threads", "1", "--max-steps", str(steps),
                             "--metrics", metrics, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "BALANCE": balance, "COLUMNS": "200"})
    groups: list[str] = []
    try:
        if share:
            deadline = time.monotonic() + 120
            while len(pids := _stage_processes(proc.pid, stages)) < stages:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the stage processes did not start: {proc.communicate()}")
                time.sleep(0.01)
            for pid in pids:
                _cap(pid, share, groups)
        out, err = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for group in groups:
            try:
                os.rmdir(group)  # empty once its process has exited
            except OSError as exc:
                print(f"cgroup {group} not removed: {exc}", file=sys.stderr)
    if proc.returncode:
        raise SystemExit(out[-3000:] + err[-3000:])
    return [r for r in map(json.loads, open(metrics)) if r.get("kind") == "step"], out


@click.command()
@click.option("--steps", default=40, show_default=True)
@click.option("--out", default=os.path.join(ROOT, "bench-results", "rebalance.json"), show_default=True)
@click.option("--core-share", type=float, default=None,
              help="cap each stage process at this share of a core (default: 0.5 with fewer than 4 cores, where "
                   "cgroups can be made; 0: no cap)")
def main(steps: int, out: str, core_share: float | None) -> None:
    work = os.path.join(ROOT, "bench-results", f"rebalance-{uuid.uuid4().hex[:8]}")
    os.makedirs(work)
    from rpcmp.core.checkpoint import load_checkpoint
    from rpcmp.job import load_job
    from rpcmp.launch.runtime import usable_cpus
    from rpcmp.plan.balance import balance_by_params
    cores = usable_cpus()
    share = (0.5 if cores < 4 and _can_cap() else 0.0) if core_share is None else core_share
    uneven = "1,5,2" if cores >= 4 or share else "1,7"
    best = ",".join(map(str, balance_by_params(load_job(JOB).model(), uneven.count(",") + 1)))  # what plan calls best
    runs = {f"[{uneven}] --rebalance": (uneven, ["--rebalance"]), f"[{uneven}]": (uneven, []),
            f"[{best}] (best)": (best, [])}
    capped = f"; each stage process capped at {share:g} of a core" if share else ""
    result = {}
    table = Table(title=f"re-cut while training: median step time of steps {steps - 9}-{steps}{capped}")
    for col in ("run", "median step s", "vs best", "re-cuts", f"parameters vs [{uneven}]"):
        table.add_column(col, justify="right")
    models = {}
    for name, (balance, extra) in runs.items():
        tag = f"{balance}{''.join(extra)}"
        ckpt = os.path.join(work, tag)
        steps_, log = _run(balance, steps, ckpt + ".jsonl", "--checkpoint-dir", ckpt, *extra, share=share)
        cuts = re.findall(r"re-cut after step \d+: balance \[[\d, ]+\] -> \[[\d, ]+\]", log)
        result[name] = {"median_step_s": statistics.median(r["step_s"] for r in steps_[-10:]), "re_cuts": cuts}
        models[name] = load_checkpoint(ckpt)["model"]
    best = result[f"[{best}] (best)"]["median_step_s"]
    plain = models[f"[{uneven}]"]
    for name, r in result.items():
        r["vs_best"] = r["median_step_s"] / best
        # moves do not change the math: the same parameters as the run without a re-cut, at float32 tolerance
        r["max_abs_diff"] = max((models[name][k] - plain[k]).abs().max().item() for k in plain)
        r["params_equal"] = all(torch.allclose(models[name][k], plain[k], rtol=1e-5, atol=1e-6) for k in plain)
        table.add_row(name, f"{r['median_step_s']:.3f}", f"{r['vs_best']:.2f}x", "; ".join(r["re_cuts"]) or "-",
                      f"{'equal' if r['params_equal'] else 'DIFFERENT'} (max |diff| {r['max_abs_diff']:.1e})")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    json.dump({"core_share": share, "runs": result}, open(out, "w"), indent=2)
    Console(width=200).print(table)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
