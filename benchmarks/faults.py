"""A process of a run killed or stopped from outside, against the same run left alone.

    .venv/bin/python benchmarks/faults.py MODEL STEP[+SECONDS] PROCESS SIGNAL [...] [rpcmp run options]
    .venv/bin/python benchmarks/faults.py qwen3 12 worker3 SIGKILL --local 5 --spares 1
    .venv/bin/python benchmarks/faults.py qwen2 12 worker2 SIGSTOP --local 5 --spares 1 --hang-timeout 20
    .venv/bin/python benchmarks/faults.py llama 6 worker4 SIGSTOP 8 worker2 SIGKILL --local 5 --spares 1
    .venv/bin/python benchmarks/faults.py llama 8 worker2 SIGKILL 8+0.1 worker4 SIGKILL --local 6 --spares 2
    .venv/bin/python benchmarks/faults.py hf_beit 30 worker2 SIGKILL --local 5 --spares 1

MODEL is a Hugging Face family of ``benchmarks/families.py`` (a 4-block model from a tiny config, 3 stages) or a
model of ``benchmarks/vision.py`` (cut as there), trained on 40 batches an epoch for 2 epochs (``--epochs`` to
change). Two runs of ``rpcmp run``: one left alone, one whose PROCESS (``worker2``: the rank's name) gets SIGNAL
once STEP steps are in its metrics file (SECONDS later with ``+SECONDS``; each hit in turn, when several are
given). It prints what the hit run said of the loss (its recovery line, or its error), both exit codes and times,
and the largest difference between the two runs' final parameters (0.0: the recovery changed nothing of the math),
and exits 1 where a run failed or the difference is above 1e-5. This file is also the job each run loads
(``FAMILY`` or ``VISION`` in the environment says which).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("VISION"):  # a run's processes, of a model of benchmarks/vision.py
    import vision as source  # noqa: E402
else:
    import families as source  # noqa: E402


class Samples(torch.utils.data.Dataset):
    """The batches of families.py (or vision.py), one sample each."""

    def __init__(self, steps: int = 40):
        self.items = [(x[i] if isinstance(x, torch.Tensor) else {k: v[i] for k, v in x.items()}, y[i])
                      for x, y in source.batches(steps=steps, size=8) for i in range(8)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


job = dataclasses.replace(source.job, data=lambda: (Samples(), None), epochs=2)


def _steps(metrics: str) -> int:
    try:
        return sum('"kind": "step"' in line for line in open(metrics))
    except OSError:
        return 0


def run(folder: str, options: list[str], hits: tuple = ()) -> tuple[int, str, float]:
    """``rpcmp run`` of this job, checkpoints in ``folder``; ``hits``: (step, process, signal, seconds after the
    step) each, in turn. (exit, output, s)."""
    metrics, start = folder + ".jsonl", time.time()
    rpcmp = os.path.join(os.path.dirname(sys.executable), "rpcmp")
    proc = subprocess.Popen([rpcmp, "run", os.path.abspath(__file__), "--checkpoint-dir", folder, "--metrics", metrics,
                             *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200"}, start_new_session=True)
    try:
        for hit in hits:
            _hit(proc, metrics, *hit)
        out, _ = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:  # a failure here, or a run that hangs: none of its processes is left behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, out, time.time() - start


def _hit(proc, metrics: str, step: int, name: str, signum: int, after: float = 0.0) -> None:
    from recovery import descendant  # the rank of this run by its process name (benchmarks/recovery.py)
    while _steps(metrics) < step and proc.poll() is None:
        time.sleep(0.002)
    time.sleep(after)
    if proc.poll() is not None:
        sys.exit(f"the run ended (exit {proc.returncode}) before step {step}:\n{proc.communicate()[0][-3000:]}")
    try:  # the master of a local run is the `rpcmp run` process itself
        pid = proc.pid if name == "master" else descendant(proc.pid, name)
    except RuntimeError:
        sys.exit(f"no process {name} in the run (its processes are master, worker1, worker2, ...)")
    os.kill(pid, signum)
    print(f"{signal.Signals(signum).name} to {name} (pid {pid}) after step {_steps(metrics)}", flush=True)


def _hits(args: list[str]) -> tuple[list[tuple[int, str, int, float]], list[str]]:
    """The hits (step, process, signal, seconds after the step) at the start of ``args``, and the options after them."""
    hits = []
    while len(args) >= 3 and not args[0].startswith("-"):
        step, name, signame = args[:3]
        at, _, after = step.partition("+")
        if not at.isdigit() or (after and not after.replace(".", "", 1).isdigit()):
            sys.exit(f"a hit is STEP[+SECONDS] PROCESS SIGNAL: {step!r} is not a step number (and seconds after it)")
        if signame not in signal.Signals.__members__:
            sys.exit(f"unknown signal {signame!r}: give its name, as SIGKILL or SIGSTOP")
        hits.append((int(at), name, signal.Signals[signame], float(after or 0)))
        args = args[3:]
    if not hits or (args and not args[0].startswith("-")):
        sys.exit(__doc__)
    return hits, args


def main(family: str, *args: str) -> int:
    from rpcmp.core.checkpoint import load_checkpoint
    import families
    import vision
    if family not in {**families.FAMILIES, **vision.MODELS}:
        sys.exit(f"unknown model {family!r}; known: {', '.join(families.FAMILIES)}, and vision's "
                 f"{', '.join(vision.MODELS)}")
    hits, options = _hits(list(args))
    os.environ["VISION" if family in vision.MODELS else "FAMILY"] = family
    root = tempfile.mkdtemp(prefix="rpcmp-faults-")
    try:
        code0, out0, s0 = run(os.path.join(root, "alone"), list(options))
        code1, out1, s1 = run(os.path.join(root, "hit"), list(options), hits)
        said = [line for line in out1.splitlines() if line.startswith(("recovered", "rpcmp:", "error"))]
        print("\n".join(f"  | {line[:400]}" for line in said))
        print(f"left alone: exit {code0}, {s0:.1f} s; hit: exit {code1}, {s1:.1f} s")
        if code0 or code1:
            print((out1 if code1 else out0)[-3000:])
            return 1
        a, b = load_checkpoint(os.path.join(root, "alone")), load_checkpoint(os.path.join(root, "hit"))
        diff = max((a["model"][k].float() - b["model"][k].float()).abs().max().item() for k in a["model"])
        print(f"steps {a['step']} and {b['step']}; largest parameter difference {diff:.3g} over {len(a['model'])} tensors")
        return 0 if a["step"] == b["step"] and diff <= 1e-5 else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
