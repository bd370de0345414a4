"""What benchmarks/families.py and benchmarks/vision.py share: train the unsplit model as a job's pipeline trains
it, compare the two, and run each model's comparison in a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch


def split_run(job, world, batches, recut, output=lambda out: out):
    """The job's pipeline trained one step, re-cut at ``recut`` (a SplitAt's points), trained on the other
    ``batches``: (the losses, its state, its eval-mode ``output`` on the first batch)."""
    import rpcmp
    pipe = rpcmp.Pipeline(job, world, sample=batches[0][0])
    losses = [pipe.train_step(*batches[0]).item()]
    pipe.recut(rpcmp.SplitAt(*recut))
    losses += [pipe.train_step(x, y).item() for x, y in batches[1:]]
    pipe.eval()
    out = torch.tensor(losses), pipe.state_dict(), output(pipe.predict(batches[0][0]))
    pipe.close()
    return out


def train(job, make, optimizer, batches, loss, output=lambda out: out):
    """The unsplit model, ``make()`` under the job's seed, trained one step per batch by ``optimizer(model)``: (the
    losses, its state, its eval-mode ``output`` on the first batch)."""
    torch.set_num_threads(1)
    torch.manual_seed(job.seed)
    model = make()
    opt, losses = optimizer(model), []
    for x, y in batches:
        opt.zero_grad()
        value = loss(model(x), y)
        value.backward()
        opt.step()
        losses.append(value.item())
    model.eval()
    with torch.no_grad():
        return torch.tensor(losses), model.state_dict(), output(model(batches[0][0]))


def compare(job_file: str, split_run, unsplit_run, **tolerance) -> str:
    """``split_run`` on 4 fresh processes loading ``job_file``, against ``unsplit_run()`` here: 'equal', or what
    differs (float32's tolerance, or ``rtol`` and ``atol``)."""
    from rpcmp.launch.local import launch_local
    split = launch_local(os.path.abspath(job_file), 4, split_run, timeout=400, master_in_process=False)
    try:
        torch.testing.assert_close(split, unsplit_run(), **tolerance)
    except AssertionError as exc:
        return "differs: " + " ".join(str(exc).split())
    return "equal"


def one(script: str, env: dict) -> str:
    """``script --one`` in a fresh interpreter with ``env`` added: the result it prints."""
    proc = subprocess.run([sys.executable, os.path.abspath(script), "--one"], capture_output=True, text=True,
                          timeout=900, env={**os.environ, **env})
    found = [line.removeprefix("RESULT ") for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return found[-1] if found else "failed: " + (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]


def each(script: str, names, env_of) -> None:
    """:func:`one` for each name, printed as it ends; exits 1 if any is not equal."""
    bad = 0
    for name in names:
        start = time.time()
        result = one(script, env_of(name))
        bad += result != "equal"
        print(f"{name:18s} {result}  ({time.time() - start:.0f} s)", flush=True)
    sys.exit(1 if bad else 0)
