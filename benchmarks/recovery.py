"""A lost owner: recovery in place (a spare and snapshots) against a full restart and resume,
on the demo's split Unet (examples/unet_split/job.py), in one run of this script.

    make bench            # or: .venv/bin/python benchmarks/recovery.py [--kill-at 12] [--every 5] [--rounds 3]

Both runs snapshot / checkpoint every ``--every`` steps and lose the owner of stage 1 (the
decoder, worker2) to a SIGKILL sent from here once step ``--kill-at`` is in the metrics file:

* in place: ``rpcmp run --local 5 --spares 1 --snapshot-every N``; the master rebuilds the
  stage on the spare and rolls back to the last snapshot;
* restart: ``rpcmp run --local 4 --checkpoint-every N``, which ends (exit 1), then the same
  command with ``--resume``: new processes, imports, RPC, builds, the checkpoint read back.

Recovery time = death to the first step completed after it (the metrics' wall-clock
stamps); "back at step k" = death to the step the run had reached when it was hit. The
step time with snapshots (the first run, before the kill) against without (the second) is
their cost. ``--rounds`` pairs of runs take turns (one pair's ratio moves by a point or more with the
machine); the table holds the medians. Writes bench-results/recovery.json and prints a table.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid

import click
from rich.console import Console
from rich.table import Table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "examples", "unet_split", "job.py")
RPCMP = os.path.join(os.path.dirname(sys.executable), "rpcmp")


def _records(path: str) -> list[dict]:
    try:
        return [json.loads(line) for line in open(path) if line.strip()]
    except (OSError, ValueError):
        return []


def _steps(path: str) -> list[dict]:
    return [r for r in _records(path) if r.get("kind") == "step"]


def descendant(root: int, name: str) -> int:
    """The process of the run started as ``root`` that names itself ``rpcmp-NAME`` (``root`` itself, the master of a
    local run, or a descendant of it)."""
    def parent(pid: str) -> int:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{pid}/comm").read().strip() != f"rpcmp-{name}":
                continue
            up = int(pid)
            while up > 1 and up != root:
                up = parent(str(up))
            if up == root:
                return int(pid)
        except OSError:
            pass
    raise RuntimeError(f"no process {name} of this run")


def _run(args: list[str], metrics: str, kill_at: int | None) -> tuple[int, float | None, str]:
    """Run ``rpcmp run JOB args``; SIGKILL worker2 once step ``kill_at`` is logged. (exit code, kill time, output)."""
    proc = subprocess.Popen([RPCMP, "run", JOB, *args, "--metrics", metrics], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "160"})
    killed = None
    while kill_at is not None and killed is None and proc.poll() is None:
        if len(_steps(metrics)) >= kill_at:
            os.kill(descendant(proc.pid, "worker2"), signal.SIGKILL)
            killed = time.time()
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=1800)
    return proc.returncode, killed, out


def _after(steps: list[dict], t: float, k: int) -> tuple[float, float]:
    """Seconds from ``t`` to the first step completed after it, and to step ``k`` completed again."""
    later = [r for r in steps if r["time"] > t]
    return later[0]["time"] - t, next(r["time"] for r in later if r["step"] == k) - t


def _round(work: str, kill_at: int, every: int, common: list[str]) -> dict:
    """One in-place run and one restart + resume, each hit after step ``kill_at``."""
    inplace = os.path.join(work, "inplace.jsonl")
    code, t_in, log_in = _run(["--local", "5", "--spares", "1", "--snapshot-every", str(every), *common], inplace, kill_at)
    open(os.path.join(work, "inplace.log"), "w").write(log_in)
    assert code == 0 and "recovered: worker2" in log_in, log_in[-3000:]
    folder, restart = os.path.join(work, "ckpt"), os.path.join(work, "restart.jsonl")
    code, t_re, log_re = _run(["--local", "4", "--checkpoint-dir", folder, "--checkpoint-every", str(every), *common],
                              restart, kill_at)
    assert code != 0, log_re[-3000:]
    code, _, log_re2 = _run(["--local", "4", "--checkpoint-dir", folder, "--checkpoint-every", str(every), "--resume",
                             *common], restart, None)
    assert code == 0 and "resumed run" in log_re2, log_re2[-3000:]
    first_in, back_in = _after(_steps(inplace), t_in, kill_at)
    first_re, back_re = _after(_steps(restart), t_re, kill_at)
    with_snap = [r["step_s"] for r in _steps(inplace) if 1 < r["step"] <= kill_at and r["time"] < t_in]
    without = [r["step_s"] for r in _steps(restart) if 1 < r["step"] <= kill_at and r["time"] < t_re]
    return {"in_place": {"first_step_s": first_in, "back_at_kill_step_s": back_in},
            "restart": {"first_step_s": first_re, "back_at_kill_step_s": back_re},
            "ratio_first_step": first_in / first_re, "ratio_back": back_in / back_re,
            "step_s_with_snapshots": statistics.median(with_snap), "step_s_without": statistics.median(without),
            "recovery_line": next(line for line in log_in.splitlines() if "recovered:" in line).strip()}


@click.command()
@click.option("--kill-at", default=12, show_default=True, help="SIGKILL the owner of stage 1 after this step.")
@click.option("--every", default=5, show_default=True, help="Steps between snapshots / checkpoints.")
@click.option("--steps", default=20, show_default=True, help="Steps of each run.")
@click.option("--rounds", default=3, show_default=True,
              help="In-place and restart runs, taking turns; the figures are the medians (one run moves by a point or more).")
@click.option("--out", default=os.path.join(ROOT, "bench-results", "recovery.json"), show_default=True)
def main(kill_at: int, every: int, steps: int, rounds: int, out: str) -> None:
    common = ["--max-steps", str(steps), "--epochs", "100"]
    runs = []
    for _ in range(rounds):
        work = os.path.join(ROOT, "bench-results", f"recovery-{uuid.uuid4().hex[:8]}")
        os.makedirs(work)
        runs.append(_round(work, kill_at, every, common))
    med = {k: statistics.median(r[k] for r in runs) for k in ("ratio_first_step", "ratio_back", "step_s_with_snapshots",
                                                              "step_s_without")}
    first_in, first_re = (statistics.median(r[w]["first_step_s"] for r in runs) for w in ("in_place", "restart"))
    back_in, back_re = (statistics.median(r[w]["back_at_kill_step_s"] for r in runs) for w in ("in_place", "restart"))
    result = {"kill_at": kill_at, "every": every, "rounds": runs, **med}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    json.dump(result, open(out, "w"), indent=2)
    table = Table(title=f"a lost owner of the split Unet (SIGKILL after step {kill_at}; snapshots / checkpoints "
                        f"every {every} steps; medians of {rounds} rounds)")
    for col in ("", "death -> first step after", f"death -> step {kill_at} again"):
        table.add_column(col, justify="right")
    table.add_row("in place (spare + snapshot)", f"{first_in:.2f} s", f"{back_in:.2f} s")
    table.add_row("restart + --resume", f"{first_re:.2f} s", f"{back_re:.2f} s")
    table.add_row("in place / restart", f"{med['ratio_first_step']:.1%}", f"{med['ratio_back']:.1%}")
    console = Console()
    console.print(table)
    console.print("in place / restart per round: " + ", ".join(f"{r['ratio_first_step']:.1%} ({r['in_place']['first_step_s']:.2f}"
                                                              f" s against {r['restart']['first_step_s']:.2f} s)" for r in runs))
    for r in runs:
        console.print(r["recovery_line"])
    console.print(f"step time (steps 2-{kill_at}, median of the rounds' medians): with snapshots every {every} "
                  f"{med['step_s_with_snapshots']:.3f} s, without {med['step_s_without']:.3f} s")
    console.print(f"written to {out}")


if __name__ == "__main__":
    main()
