"""Draining a rank of a daemon job while it trains: `rpcmp drain` moves its stage to the spare, its
daemon finishes the job (exit 0) and waits for the next, and the model is an undisturbed run's. A
request without the token is ignored; a drain with no spare left is refused, the job going on.
`rpcmp rebalance` on the same job measures once and says what it decided. The job then ends by
SIGTERM between two steps (its checkpoint written), however far it got, so that no request can
come too late on a busy machine; the undisturbed run trains as many steps. The drained run is paced
(tests/jobs/paced.py): about four steps a second, not the hundreds it would train meanwhile."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import assert_close_f32, fit_steps, job_path, metric_steps, run_command, run_ranks
from rpcmp.core.checkpoint import load_checkpoint
from test_daemons import free_port

pytestmark = pytest.mark.integration
RPCMP = os.path.join(os.path.dirname(sys.executable), "rpcmp")
STEPS = ["--epochs", "200", "--threads", "1", "--spares", "1"]


# `rpcmp drain` and `rpcmp rebalance` start from the suite's fork server (helpers.Command); the daemons and the master
# are the console script itself.
def _drain(port, rank, token, timeout=120):
    return run_command("drain", "--master", f"127.0.0.1:{port}", "--rank", str(rank), "--token-file", str(token),
                       "--timeout", str(timeout), timeout=timeout + 60)


def _rebalance(port, token, timeout=120):
    return run_command("rebalance", "--master", f"127.0.0.1:{port}", "--token-file", str(token), "--timeout", str(timeout),
                       timeout=timeout + 60)


@pytest.mark.timeout(420)
def test_a_drained_rank_hands_its_stage_to_the_spare_and_its_daemon_finishes(tmp_path):
    port = free_port()
    token, wrong = tmp_path / "token", tmp_path / "wrong"
    token.write_text("s3cret\n")
    wrong.write_text("guess\n")
    logs = [open(tmp_path / f"worker{r}.log", "w") for r in (1, 2, 3)]
    daemons = [subprocess.Popen([RPCMP, "worker", "--master", f"127.0.0.1:{port}", "--rank", str(r), "--token-file",
                                 str(token), "--preload", ""], stdout=logs[r - 1], stderr=subprocess.STDOUT, start_new_session=True)
               for r in (1, 2, 3)]
    master = subprocess.Popen([RPCMP, "run", job_path("paced"), "--workers", "3", "--listen", f"127.0.0.1:{port}",
                               "--token-file", str(token), *STEPS, "--checkpoint-dir", str(tmp_path / "drained"),
                               "--metrics", str(tmp_path / "m.jsonl")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200", "PACED_STEP_S": "0.25"})
    try:
        deadline = time.monotonic() + 120
        while metric_steps(tmp_path / "m.jsonl") < 20:
            assert master.poll() is None and time.monotonic() < deadline, master.communicate()[0]
            time.sleep(0.05)
        stranger = _drain(port, 1, wrong, timeout=3)  # no proof of the token: the master does nothing
        assert stranger.returncode == 1 and "no answer from the master" in stranger.stdout + stranger.stderr
        once = _rebalance(port, token)  # measured once over the next steps; re-cut only if it pays
        assert once.returncode == 0, once.stdout + once.stderr
        assert "re-cut after step" in once.stdout or "kept balance [3, 4]" in once.stdout, once.stdout
        done = _drain(port, 1, token)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "drained worker1: stage 0 moved to worker3" in done.stdout, done.stdout
        refused = _drain(port, 2, token)  # the spare is taken now
        assert refused.returncode == 1 and "no spare process is free" in refused.stderr, refused.stdout + refused.stderr
        master.send_signal(signal.SIGTERM)  # see [Note: stopping a run]
        out, _ = master.communicate(timeout=240)
        deadline = time.monotonic() + 60
        while not all("ended (" in open(tmp_path / f"worker{r}.log").read() for r in (1, 2, 3)):
            assert time.monotonic() < deadline  # every daemon's job process ends after the master's
            time.sleep(0.1)
    finally:
        if master.poll() is None:
            master.kill()
        for d in daemons:
            d.terminate()
        for d in daemons:
            d.wait(30)
    assert master.returncode == 128 + signal.SIGTERM, out
    stopped = re.search(r"stopped by SIGTERM after step (\d+): checkpoint in", out)
    assert "drained worker1" in out and stopped, out
    steps = int(stopped.group(1))  # the same run undisturbed and unpaced, started by rpcmp's launcher
    assert run_ranks("paced", 4, fit_steps, {"epochs": 200, "threads": 1, "spares": 1, "max_steps": steps,
                                        "checkpoint_dir": str(tmp_path / "clean")}, timeout=300) == steps
    text = open(tmp_path / "worker1.log").read()
    assert "ended (exit 0)" in text and "worker daemon stopped" in text, text
    assert "ended (exit 0)" in open(tmp_path / "worker3.log").read()
    assert_close_f32(load_checkpoint(str(tmp_path / "drained"))["model"], load_checkpoint(str(tmp_path / "clean"))["model"])


def _step_times(metrics, answered: float) -> str:
    """When each step ended, against when `rpcmp drain` returned: a drain answers only once its snapshot has
    landed, 2 s or more after the step it followed here (the new buddy's slow keep)."""
    rows = [json.loads(line) for line in open(metrics) if '"kind": "step"' in line]
    return "\nsteps ended (s from `rpcmp drain`'s return): " + ", ".join(f"{r['step']}: {r['time'] - answered:+.2f}"
                                                                     for r in rows[-12:])


@pytest.mark.timeout(420)
def test_an_owner_lost_just_after_a_drain_is_replaced_from_the_snapshot_of_the_drained_layout(tmp_path):
    """Two spares: worker1 is drained (its stage 0 to worker3), and the node of worker2 (stage 1) is SIGKILLed
    as soon as `rpcmp drain` has its answer. The buddy of stage 1 is now worker3, which takes 2 s to keep a
    copy (tests/jobs/paced_slow_keep.py); the copy of stage 1 before the drain left with worker1. The drain
    answers once that snapshot has landed, so the loss is replaced from it (worker4) and the model is an
    undisturbed run's; before, the drain answered first and the run ended ("no snapshot holds the lost stages")."""
    port = free_port()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    logs = [open(tmp_path / f"worker{r}.log", "w") for r in (1, 2, 3, 4)]
    daemons = [subprocess.Popen([RPCMP, "worker", "--master", f"127.0.0.1:{port}", "--rank", str(r), "--token-file",
                                 str(token), "--preload", ""], stdout=logs[r - 1], stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "SLOW_KEEP_S": "2" if r == 3 else "0"})
               for r in (1, 2, 3, 4)]
    master = subprocess.Popen([RPCMP, "run", job_path("paced_slow_keep"), "--workers", "4", "--listen",
                               f"127.0.0.1:{port}", "--token-file", str(token), "--epochs", "200", "--threads", "1",
                               "--spares", "2", "--checkpoint-dir", str(tmp_path / "run"), "--metrics",
                               str(tmp_path / "m.jsonl")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "COLUMNS": "200", "PACED_STEP_S": "0.25"})
    try:
        deadline = time.monotonic() + 120
        while metric_steps(tmp_path / "m.jsonl") < 12:
            assert master.poll() is None and time.monotonic() < deadline, master.communicate()[0]
            time.sleep(0.05)
        done = _drain(port, 1, token)
        answered = time.time()
        os.killpg(daemons[1].pid, signal.SIGKILL)  # worker2's daemon and its job process: the node is gone
        assert done.returncode == 0, done.stdout + done.stderr
        assert "drained worker1: stage 0 moved to worker3" in done.stdout, done.stdout
        at = metric_steps(tmp_path / "m.jsonl")
        while metric_steps(tmp_path / "m.jsonl") < at + 8:
            assert master.poll() is None and time.monotonic() < deadline + 120, (
                master.communicate()[0] + _step_times(tmp_path / "m.jsonl", answered))
            time.sleep(0.05)
        master.send_signal(signal.SIGTERM)
        out, _ = master.communicate(timeout=240)
    finally:
        if master.poll() is None:
            master.kill()
        for d in daemons:
            if d.poll() is None:
                d.terminate()
        for d in daemons:
            d.wait(30)
    assert master.returncode == 128 + signal.SIGTERM, out
    assert "recovered: worker2 was lost" in out and "rebuilt on worker4" in out, out
    steps = int(re.search(r"stopped by SIGTERM after step (\d+): checkpoint in", out).group(1))
    assert run_ranks("paced", 5, fit_steps, {"epochs": 200, "threads": 1, "spares": 2, "max_steps": steps,
                                        "checkpoint_dir": str(tmp_path / "clean")}, timeout=300) == steps
    assert_close_f32(load_checkpoint(str(tmp_path / "run"))["model"], load_checkpoint(str(tmp_path / "clean"))["model"])
