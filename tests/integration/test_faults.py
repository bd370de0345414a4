"""Fault injection with real processes: a worker killed (SIGKILL) or frozen (SIGSTOP)
mid-training ends the run within a bound, with an error naming the worker, its stage
and the step; no process is left; the last checkpoint loads."""
import contextlib
import os
import signal
import subprocess
import time

import pytest
import torch

from helpers import Command, assert_close_f32, job_path, metric_steps, run_command
from rpcmp.core.checkpoint import latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.integration


def _workers(session):
    """The run's worker processes, worker1 first (each local rank names itself rpcmp-workerN)."""
    out = subprocess.run(["pgrep", "-s", str(session), "-l", "^rpcmp-worker"], capture_output=True, text=True).stdout
    named = [line.split() for line in out.splitlines()]
    return [int(pid) for pid, _ in sorted(named, key=lambda n: int(n[1].removeprefix("rpcmp-worker")))]


def _started(pid) -> tuple[str, str] | None:
    """Process ``pid``'s state and start time (clock ticks since boot), or None where there is none: with its pid,
    the start time tells it from a later process given the same pid (the kernel reuses them within seconds on a busy
    machine)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], fields[19]


def _alive(pid, started) -> bool:
    """Process ``pid``, started at ``started``, still runs (a zombie does not)."""
    now = _started(pid)
    return now is not None and now[1] == started and now[0] != "Z"


@contextlib.contextmanager
def _rpcmp_run(*args, **env):
    """``rpcmp run ARGS`` in a session of its own, with ``env`` added; every process of it killed at the end."""
    proc = Command("run", *args, env={**os.environ, **env})
    try:
        yield proc
    finally:
        proc.kill()


def _described(pids, command) -> str:
    """Each of ``pids`` still alive: its name, state and parent (the command's pid: ``command``)."""
    out = subprocess.run(["ps", "-o", "pid=,ppid=,stat=,comm=", "-p", ",".join(map(str, pids))], capture_output=True,
                         text=True).stdout
    return f"command {command}:\n{out}"


def _kill_worker2(proc, timeout):
    """SIGKILL worker2 (owner of stage 1); return the run's stderr and the seconds it took to end after the kill."""
    os.kill(_workers(proc.pid)[1], signal.SIGKILL)
    start = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return err, time.monotonic() - start

MODES = {"pipeline": (["--local", "3"], 2, "worker1 (stage 0 layers[0:3])"),
         "ddp": (["--local", "2", "--mode", "ddp"], 1, "worker1 (DDP replica)"),
         # 2 replicas x 2 stages: the copy of stage 0 in replica 1 waits in its all_reduce for the lost one
         "replicas": (["--local", "5", "--replicas", "2"], 4, "worker1 (replica 0 stage 0 layers[0:3])")}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", sorted(MODES))
# The bounds stay under the 60 s a collective or an RPC may wait (the hang this guards against) with room for a
# busy machine: --hang-timeout 10, not 5 (under three parallel test files a run of 5 processes once ended itself
# with exit 3 before its first checkpoint, no process touched: a worker's answer late by 5 s is not a hang), and
# for a busy machine's teardown: a DDP rank killed under three parallel test files took 20 s to end, 2-3 s alone.
@pytest.mark.parametrize("sig,bound", [(signal.SIGKILL, 30.0), (signal.SIGSTOP, 10.0 + 25.0)])
def test_lost_worker_ends_the_run_clearly(tmp_path, sig, bound, mode):
    launch, nworkers, named = MODES[mode]
    ckpt_dir = str(tmp_path / "ckpt")
    proc = Command("run", job_path("mlp"), *launch, "--epochs", "200", "--checkpoint-dir", ckpt_dir, "--checkpoint-every",
                   "40", "--hang-timeout", "10")
    try:
        deadline = time.monotonic() + 120
        while latest_checkpoint(ckpt_dir) is None:
            assert proc.poll() is None and time.monotonic() < deadline, ("no checkpoint was written", proc.communicate())
            time.sleep(0.2)
        workers = _workers(proc.pid)
        assert len(workers) == nworkers
        everyone = {p: (_started(p) or (None, None))[1] for p in [proc.pid] + workers}
        os.kill(workers[0], sig)  # worker1, owner of stage 0
        start = time.monotonic()
        _, err = proc.communicate(timeout=bound + 30)
        waited = time.monotonic() - start
    finally:
        proc.kill()
    # a dead worker is the master's failed call to report (exit 1); a frozen one, the watchdog's (exit 3)
    assert proc.returncode == (1 if sig == signal.SIGKILL else 3), err
    assert waited < bound, f"took {waited:.1f}s"
    assert "WorkerLostError" in err and named in err and "at step" in err, err
    assert "--resume" in err
    gone_by = time.monotonic() + 15  # a worker's exit under load (imports torn down, sockets closed) takes seconds
    while [p for p, t in everyone.items() if _alive(p, t)] and time.monotonic() < gone_by:
        time.sleep(0.2)
    left = [p for p, t in everyone.items() if _alive(p, t)]
    assert not left, ("processes were left behind", _described(left, proc.pid))
    assert load_checkpoint(ckpt_dir)["step"] % 40 == 0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["step", "evaluation"])
def test_an_owner_lost_while_the_stage_before_it_computes_ends_the_step_at_once(tmp_path, where):
    """worker2 (stage 1) is SIGKILLed while worker1's forward of stage 0 stalls for 90 s, in a training step or
    in the held-out evaluation before the first step: nothing is in flight to worker2, yet the master learns of
    the loss at once (a call it keeps pending on every owner fails with EOF), and the step's (or the
    evaluation's) own failure ends the run (exit 1, naming worker2). Without that call the master waited for
    worker1, and only the watchdog's backstop ended the run, 10 s later (exit 3)."""
    flag, metrics = str(tmp_path / "stall"), str(tmp_path / "m.jsonl")
    if where == "evaluation":
        open(flag, "w").close()  # the first forward of stage 0 stalls: the evaluation before training
    with _rpcmp_run(job_path("stalls"), "--local", "3", "--metrics", metrics, STALL_FLAG=flag) as proc:
        deadline = time.monotonic() + 90
        while where == "step" and metric_steps(metrics) < 2:  # some steps train
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        open(flag, "w").close()
        while not os.path.exists(flag + ".stalled"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        err, waited = _kill_worker2(proc, 120)
    assert proc.returncode == 1, err
    assert "WorkerLostError" in err and "worker2" in err, err
    assert ("before the first step" in err) == (where == "evaluation"), err
    assert waited < 45, f"the run ended {waited:.1f} s after the kill"


@pytest.mark.timeout(120)
def test_a_worker_killed_in_the_final_shutdown_leaves_the_run_complete(tmp_path):
    """worker2 is SIGKILLed after it heard the run end, inside the shutdown's barrier: the run ends 0 within
    seconds with its checkpoint, naming worker2. It used to end 1 ("local processes exited with errors:
    [('worker2', -9)]"), after the barriers' 30 s and 60 s of waiting."""
    flag = str(tmp_path / "ended")
    with _rpcmp_run(job_path("ends_slowly"), "--local", "3", "--max-steps", "4", "--checkpoint-dir", str(tmp_path / "run"),
                    ENDS_FLAG=flag) as proc:
        deadline = time.monotonic() + 90
        while not os.path.exists(flag):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        err, waited = _kill_worker2(proc, 90)
    assert proc.returncode == 0, err
    assert "worker2 exited with -9 after the run had ended normally" in err and "Traceback" not in err, err
    assert load_checkpoint(str(tmp_path / "run"))["step"] == 4
    assert waited < 40, f"the run ended {waited:.1f} s after the kill"
    assert not subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).stdout, "a process was left"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_worker_lost_during_held_out_evaluation_is_named_too(mode):
    # worker1 ends itself in the evaluation at the end of epoch 1 (step 32), between training steps.
    launch, _, named = MODES[mode]
    named = named.replace("layers[0:3]", "layers[0:4]")
    proc = run_command("run", job_path("dies_in_eval"), *launch, timeout=90)
    assert proc.returncode != 0
    assert "WorkerLostError" in proc.stderr and named in proc.stderr and "at step 32" in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
def test_a_worker_lost_in_the_final_evaluation_or_in_split_prediction_is_named(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # 4 steps, the checkpoint at the end, then the final held-out evaluation loses worker1
    train = run_command("run", job_path("dies_in_eval"), "--local", "3", "--max-steps", "4", "--checkpoint-dir", ckpt,
                        timeout=90)
    assert train.returncode != 0
    assert "WorkerLostError: at step 4: worker1 (stage 0 layers[0:4])" in train.stderr, train.stderr
    assert "The last checkpoint is" in train.stderr and load_checkpoint(ckpt)["step"] == 4
    predict = run_command("predict", job_path("dies_in_eval"), "-c", ckpt, "--local", "3", "--out", str(tmp_path / "pred"),
                          timeout=90, env={**os.environ, "DIE_UNTRAINED": "1"})
    assert predict.returncode != 0
    assert "error: WorkerLostError: predicting with " in predict.stderr, predict.stderr  # not a traceback
    assert "worker1 (stage 0 layers[0:4]) stopped answering" in predict.stderr and "--resume" not in predict.stderr


@pytest.mark.timeout(120)
def test_a_worker_lost_while_its_stage_is_built_is_named(tmp_path):
    """With the folder it was given: the message told a run with --checkpoint-dir to pass --checkpoint-dir."""
    proc = run_command("run", job_path("dies_in_eval"), "--local", "3", "--checkpoint-dir", str(tmp_path / "ckpt"),
                       timeout=90, env={**os.environ, "DIE_AT_BUILD": "1", "COLUMNS": "400"})
    assert proc.returncode != 0
    said = " ".join(proc.stderr.split())
    assert "error: WorkerLostError: before the first step: worker1 (stage 0 layers[0:4]) stopped answering" in said, said
    assert f"No checkpoint was written in {tmp_path / 'ckpt'} yet" in said, said


@pytest.mark.timeout(240)
@pytest.mark.parametrize("snapshots", ["5", "0"], ids=["snapshot", "checkpoint"])
def test_with_a_spare_a_worker_lost_during_held_out_evaluation_is_replaced_and_the_run_goes_on(tmp_path, snapshots):
    """worker1 ends itself in the evaluation at the end of epoch 1: the spare takes its stage from a snapshot
    of that very step (taken before the evaluation), the evaluation runs again, and the run ends as one where
    nobody died. Without snapshots (--snapshot-every 0) the last checkpoint is older: the run ends as before."""
    def run(folder, **env):
        return run_command("run", job_path("dies_in_eval"), "--local", "4", "--spares", "1", "--max-steps", "40",
                           "--checkpoint-dir", str(tmp_path / folder), "--snapshot-every", snapshots, timeout=150,
                           env={**os.environ, "COLUMNS": "200", **env})
    hit = run("hit")
    if snapshots == "0":
        assert hit.returncode != 0 and "WorkerLostError" in hit.stderr and "at step 32" in hit.stderr, hit.stderr
        return
    assert hit.returncode == 0, hit.stdout + hit.stderr
    assert "recovered: worker1 was lost" in hit.stdout and "every stage rolled back to step 32" in hit.stdout, hit.stdout
    assert "epoch 1: held-out -MSE" in hit.stdout
    clean = run("clean", NEVER_DIE="1")
    assert clean.returncode == 0 and "recovered" not in clean.stdout, clean.stdout + clean.stderr
    a, b = load_checkpoint(str(tmp_path / "hit")), load_checkpoint(str(tmp_path / "clean"))
    assert a["step"] == b["step"] == 40
    torch.testing.assert_close(a["model"], b["model"], rtol=0, atol=0)


def _stop_each_at(runs: dict, steps: int) -> float:
    """Stop every process of each run (as Ctrl-Z does a terminal's job) once ``steps`` steps are in its metrics;
    ``runs``: {name: (proc, metrics)}. Returns when the last was stopped."""
    deadline, waiting = time.monotonic() + 120, dict(runs)
    while waiting:
        for name, (proc, metrics) in list(waiting.items()):
            assert proc.poll() is None and time.monotonic() < deadline, (name, proc.communicate())
            if metric_steps(metrics) >= steps:
                os.killpg(proc.pid, signal.SIGSTOP)
                del waiting[name]
        time.sleep(0.02)
    return time.monotonic()


@pytest.mark.timeout(300)
def test_a_job_stopped_for_longer_than_a_minute_and_continued_goes_on_as_if_never_stopped(tmp_path):
    """Every process of a run stopped mid-training for 65 s (Ctrl-Z, a frozen container), then continued: the run
    ends 0 with the model of a run never stopped. Every call in flight had run past its deadline when the processes
    ran again; with 60 s for every call the step failed ("RPC ran for more than set timeout"), exit 1; in DDP mode a
    collective's 60 s ran out the same way. Both modes' runs are stopped over the same minute; a run of each left
    alone trains meanwhile, on the cores the stopped ones leave free."""
    modes = {"pipeline": "4", "ddp": "2"}

    def common(mode):
        return [job_path("three"), "--local", modes[mode], "--mode", mode, "--max-steps", "120", "--hang-timeout", "10"]

    with contextlib.ExitStack() as stack:
        runs = {mode: (stack.enter_context(_rpcmp_run(*common(mode), "--checkpoint-dir", str(tmp_path / f"stopped-{mode}"),
                                                      "--metrics", str(tmp_path / f"{mode}.jsonl"))),
                       str(tmp_path / f"{mode}.jsonl")) for mode in modes}
        stopped = _stop_each_at(runs, 40)
        alone = {mode: run_command("run", *common(mode), "--checkpoint-dir", str(tmp_path / f"alone-{mode}"), timeout=120)
                 for mode in modes}
        time.sleep(max(0.0, 65 - (time.monotonic() - stopped)))
        for proc, _ in runs.values():
            os.killpg(proc.pid, signal.SIGCONT)
        ended = {mode: proc.communicate(timeout=120) for mode, (proc, _) in runs.items()}
    for mode, (proc, _) in runs.items():
        assert alone[mode].returncode == 0, (mode, alone[mode].stderr)
        assert proc.returncode == 0, (mode, ended[mode][1])
        a, b = load_checkpoint(str(tmp_path / f"alone-{mode}")), load_checkpoint(str(tmp_path / f"stopped-{mode}"))
        assert a["step"] == b["step"] == 120, mode
        assert_close_f32(b["model"], a["model"])


@pytest.mark.timeout(150)
def test_ddp_rank_0_stopped_past_the_hang_timeout_ends_the_other_ranks_naming_it(tmp_path):
    """Rank 0 (the master) frozen in DDP mode: nothing pings it, and the other ranks waited in their collective for
    60 s and died of a raw gloo error. Every rank now watches rank 0's heartbeats and ends itself after --hang-timeout,
    naming it; the master, continued, finds its peers gone and ends too; no process is left."""
    metrics = str(tmp_path / "m.jsonl")
    with _rpcmp_run(job_path("mlp"), "--local", "3", "--mode", "ddp", "--batch-size", "12", "--epochs", "200", "--hang-timeout", "10",
                    "--metrics", metrics) as proc:
        deadline = time.monotonic() + 90
        while metric_steps(metrics) < 5:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        workers = {p: (_started(p) or (None, None))[1] for p in _workers(proc.pid)}
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        while [p for p, t in workers.items() if _alive(p, t)] and time.monotonic() - start < 60:
            time.sleep(0.2)
        waited = time.monotonic() - start
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    assert waited < 10 + 25, f"the other ranks took {waited:.1f}s to end"
    assert proc.returncode != 0, err
    assert "master (DDP replica) did not answer for 10s" in err, err


@pytest.mark.timeout(120)
def test_a_call_past_its_rpc_timeout_with_every_process_answering_says_so_and_where_to_resume(tmp_path):
    """worker1's forward stalls for 90 s with --rpc-timeout 5 (as a job stopped and continued after longer than that
    finds its calls): the step fails, and the error says that every process answers, that the job was stopped for
    longer than its calls may take or a call waited that long, and which option to raise (a raw "RPC ran for more
    than set timeout" traceback before); no process is left. (Stopping the processes from here is no test of it: a
    stop that lands between two calls costs nothing, as it should.)"""
    flag, metrics, ckpt = str(tmp_path / "stall"), str(tmp_path / "m.jsonl"), str(tmp_path / "run")
    with _rpcmp_run(job_path("stalls"), "--local", "3", "--rpc-timeout", "5", "--checkpoint-dir", ckpt,
                    "--checkpoint-every", "2", "--metrics", metrics, STALL_FLAG=flag) as proc:
        deadline = time.monotonic() + 90
        while metric_steps(metrics) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        open(flag, "w").close()
        _, err = proc.communicate(timeout=60)
        gone_by = time.monotonic() + 15
        while subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).stdout and time.monotonic() < gone_by:
            time.sleep(0.2)
        left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout
    assert proc.returncode == 1, err
    assert "CallTimeoutError" in err and "ran past its timeout (5 s, Job.rpc_timeout), yet every process answers" in err, err
    assert "--resume" in err and latest_checkpoint(ckpt) is not None, err
    assert not left, f"processes were left: {left}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["warns", "ends-with-stall-timeout", "ends-once-a-stop-is-asked"])
def test_a_step_no_process_works_on_is_said_and_with_a_stall_timeout_ends_the_run(how):
    """tests/jobs/blocks.py: stage 1's third training forward waits forever on an event, as a forward blocked on a
    lock or a queue would; every process answers the watchdog's pings, so the run waited without a word. Now no
    process working for 3 x --hang-timeout in a step is said once, with each process's id; --stall-timeout S ends
    the run after S idle seconds, exit 3 (see [Note: a stalled step] in rpcmp/core/stall.py). A SIGTERM waits for
    the step in flight, which never ends: once one is asked, 5 idle seconds end the run (a second signal was
    needed)."""
    ends = how == "ends-with-stall-timeout"
    proc = Command("run", job_path("blocks"), "--local", "3", "--max-steps", "10", "--hang-timeout", "2",
                   *(["--stall-timeout", "4"] if ends else []), merged=True)
    try:
        said = "at step 3: no process has worked for " + ("4s" if ends else "6s")
        deadline = time.monotonic() + 100
        while said not in proc.output():
            assert time.monotonic() < deadline and (ends or proc.poll() is None), proc.output()
            time.sleep(0.1)
        if ends:
            assert proc.wait(30) == 3
            assert "rpcmp: error: StallError: " + said in proc.output()
        elif how == "warns":
            time.sleep(3)
            assert proc.poll() is None, proc.output()  # a warning: the run goes on waiting
            assert proc.output().count("rpcmp: warning: " + said) == 1, proc.output()
        else:
            os.kill(proc.pid, signal.SIGTERM)  # the master: stop after the step in flight, which never ends
            assert proc.wait(30) == 3, proc.output()
            assert "SIGTERM: stopping after the step in flight" in proc.output()
            assert "rpcmp: error: StallError: at step 3: no process has worked for 5s" in proc.output()
            assert "a stop was asked (SIGTERM)" in proc.output()
    finally:
        proc.kill()
    for name in ("master", "worker1", "worker2"):
        assert f"{name} pid " in proc.output()
