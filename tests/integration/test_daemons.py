"""Worker daemons serve job after job: two jobs in a row, a master killed mid-job, a
third job, a stranger's job refused, and SIGTERM stops them cleanly."""
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import Command, fit_steps, job_path
from rpcmp.launch.runtime import free_port as rpcmp_free_port

pytestmark = pytest.mark.integration
RPCMP = os.path.join(os.path.dirname(sys.executable), "rpcmp")


def free_port() -> int:
    """A port free together with the next one: the master takes PORT for RPC and PORT+1 for job offers,
    seconds after this picks them (the daemons start first)."""
    return rpcmp_free_port(count=2)


def _master(port, token_file, *args, workers=2, env=None):
    """`rpcmp run --workers` as the console script runs it, started from the suite's fork server (helpers.Command);
    the daemons are the console script itself, and test_drain.py's masters too."""
    return Command("run", job_path("mlp"), "--workers", str(workers), "--listen", f"127.0.0.1:{port}", "--token-file",
                   str(token_file), *args, env=env, merged=True)


@pytest.mark.timeout(300)
def test_daemons_serve_jobs_survive_a_dead_master_and_refuse_strangers(tmp_path):
    port = free_port()
    token, wrong = tmp_path / "token", tmp_path / "wrong"
    token.write_text("s3cret\n")
    wrong.write_text("guess\n")
    logs = [open(tmp_path / f"worker{r}.log", "w") for r in (1, 2)]
    daemons = [subprocess.Popen([RPCMP, "worker", "--master", f"127.0.0.1:{port}", "--rank", str(r),
                                 "--token-file", str(token)], stdout=logs[r - 1], stderr=subprocess.STDOUT,
                                start_new_session=True) for r in (1, 2)]
    try:
        out, _ = _master(port, token, "--max-steps", "20").communicate(timeout=120)
        assert "steps 20" in out, out
        served = open(tmp_path / "worker1.log").read().count("serving rank 1")
        doomed = _master(port, token, "--epochs", "200")
        deadline = time.monotonic() + 60
        while open(tmp_path / "worker1.log").read().count("serving rank 1") == served:  # the doomed job started
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(3)
        os.killpg(doomed.pid, signal.SIGKILL)  # the master dies mid-job
        doomed.wait(10)
        out, _ = _master(port, token, "--max-steps", "20").communicate(timeout=120)
        assert "steps 20" in out, out  # the daemons served a third job without a restart
        stranger = _master(port, wrong, "--max-steps", "5", env={**os.environ, "RPCMP_CONNECT_TIMEOUT": "6"})
        out, _ = stranger.communicate(timeout=60)
        assert stranger.returncode != 0 and "did not join within 6s" in out
        assert all(d.poll() is None for d in daemons)
        for d in daemons:
            d.send_signal(signal.SIGTERM)
        for d in daemons:
            assert d.wait(20) == 0
    finally:
        for d in daemons:
            if d.poll() is None:
                os.killpg(d.pid, signal.SIGKILL)
    text = open(tmp_path / "worker1.log").read()
    assert text.count("serving rank 1 of 3") == 3  # a job, the one whose master died, the next
    assert text.count("ended (exit 0)") >= 2
    assert "wrong job token or an altered offer, refused" in text and "worker daemon stopped" in text


def _daemon(port, token_file, log):
    return subprocess.Popen([RPCMP, "worker", "--master", f"127.0.0.1:{port}", "--rank", "1", "--token-file",
                             str(token_file), "--preload", ""], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=log.name.rsplit("/", 1)[0])


def _wait_log(path, text, count=1, timeout=30):
    deadline = time.monotonic() + timeout
    while open(path).read().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged: {open(path).read()}"
        time.sleep(0.1)


def _offer(files, job="job.py", **fields):
    import base64
    import json
    return json.dumps({"id": "ab" * 16, "world_size": 2, "job": job, "rpc_port": 1234, "overrides": {},
                       "files": {n: base64.b64encode(c.encode()).decode() for n, c in files.items()}, **fields})


def _wait_offer(port, master):
    import json
    from datetime import timedelta

    import torch.distributed as dist
    deadline = time.monotonic() + 60
    while True:
        try:
            client = dist.TCPStore("127.0.0.1", port + 1, is_master=False, timeout=timedelta(seconds=2))
            return client, json.loads(client.get("rpcmp/job"))
        except Exception:  # noqa: BLE001 - the master is not up yet
            assert time.monotonic() < deadline and master.poll() is None
            time.sleep(0.05)


@pytest.mark.timeout(300)
def test_a_daemon_refuses_every_forged_offer_stays_up_and_then_serves_an_honest_job(tmp_path):
    """Attacks from a plain TCPStore client that reaches PORT + 1 but lacks the token."""
    import base64
    import json
    from datetime import timedelta

    import torch.distributed as dist
    port = free_port()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    marker = tmp_path / "pwned"
    evil = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n"
    work = tmp_path / "daemon"
    work.mkdir()
    log_path = work / "worker1.log"
    log = open(log_path, "w")
    # 1: a real master's offer, whose job file a stranger swaps under the same job id, and a forged `ready`. The
    # daemon is started first and stopped once it waits (so that its start, slow on a busy machine, does not outlast
    # the master's 8 s), and let go once the offer is swapped: it reads the swapped one.
    daemon, master = _daemon(port, token, log), None
    try:
        _wait_log(log_path, "waiting for jobs", timeout=120)
        daemon.send_signal(signal.SIGSTOP)
        master = _master(port, token, "--max-steps", "5", workers=1, env={**os.environ, "RPCMP_CONNECT_TIMEOUT": "8"})
        client, real = _wait_offer(port, master)
        real["files"][real["job"]] = base64.b64encode(evil.encode()).decode()
        client.set("rpcmp/job", json.dumps(real))
        client.set(f"{real['id']}/ready/1", "1")
        daemon.send_signal(signal.SIGCONT)
        out, _ = master.communicate(timeout=60)
        assert master.returncode != 0 and "did not join within 8s" in out, out  # the forged ready did not count
        _wait_log(log_path, "wrong job token or an altered offer, refused")
        # 2: a stranger hosts the offer port himself (no master is up) and offers junk
        fake = dist.TCPStore("127.0.0.1", port + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        attacks = [
            ("{}", "field 'id' must be a str"),
            (_offer({"../x.py": evil}, job="../x.py"), "'../x.py' is not a plain .py base name"),
            (_offer({"/tmp/x.py": evil}, job="/tmp/x.py"), "'/tmp/x.py' is not a plain .py base name"),
            (b"\xff\xfe not json", "not JSON"),
            (_offer({"job.py": evil}, id="cd" * 16), "job cdcdcdcd from 127.0.0.1: wrong job token"),  # a non-ASCII answer
        ]
        for i, (offer, said) in enumerate(attacks):
            fake.set("rpcmp/job", offer)
            if i == len(attacks) - 1:
                deadline = time.monotonic() + 20
                while not fake.check([f"{'cd' * 16}/challenge/1"]):
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                fake.set(f"{'cd' * 16}/response/1", "é" * 64)
            _wait_log(log_path, said)
            assert daemon.poll() is None, open(log_path).read()
        del fake
        time.sleep(1.5)
        # 3: the same daemon is still up and serves an honest job
        out, _ = _master(port, token, "--max-steps", "5", workers=1).communicate(timeout=120)
        assert "steps 5" in out, out
        assert daemon.poll() is None
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
        if master is not None and master.poll() is None:
            os.killpg(master.pid, signal.SIGKILL)
        log.close()
    assert not marker.exists()
    assert not os.path.exists("/tmp/x.py") and not (tmp_path / "x.py").exists() and sorted(os.listdir(work)) == ["worker1.log"]
    text = open(log_path).read()
    assert text.count("serving rank 1") == 1 and "Traceback" not in text, text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("args,workers,says,same", [
    (["--mode", "ddp", "--batch-size", "12"], 2, "DDP on 3 ranks", {"mode": "ddp", "batch_size": 12}),
    (["--replicas", "2", "--batch-size", "8"], 4, "x 2 replicas: 0@worker1/cpu,worker2/cpu",  # 2 x 2 grid
     {"replicas": 2, "batch_size": 8}),
], ids=["ddp", "replicas"])
def test_daemons_run_ddp_and_replicas_equal_to_a_local_run(tmp_path, args, workers, says, same):
    from helpers import assert_close_f32, run_ranks
    from rpcmp.core.checkpoint import load_checkpoint
    port = free_port()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    args = [*args, "--max-steps", "6"]
    log = open(tmp_path / "daemons.log", "w")
    daemons = [subprocess.Popen([RPCMP, "worker", "--master", f"127.0.0.1:{port}", "--rank", str(r),
                                 "--token-file", str(token), "--preload", ""], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True) for r in range(1, workers + 1)]
    try:
        out, _ = _master(port, token, *args, "--checkpoint-dir", str(tmp_path / "daemons"), workers=workers,
                         env={**os.environ, "COLUMNS": "200"}).communicate(timeout=150)
        assert says in out and "steps 6" in out, out
        _wait_log(tmp_path / "daemons.log", "ended (exit 0)", workers)  # every daemon rank trained and ended normally
    finally:
        for d in daemons:
            if d.poll() is None:
                os.killpg(d.pid, signal.SIGKILL)
        log.close()
    # the same run on local processes (started by rpcmp's launcher: the command line is not what is compared)
    run_ranks("mlp", workers + 1, fit_steps, {**same, "max_steps": 6, "checkpoint_dir": str(tmp_path / "local")}, timeout=150)
    a, b = load_checkpoint(str(tmp_path / "daemons")), load_checkpoint(str(tmp_path / "local"))
    assert a["mode"] == b["mode"] and a["step"] == b["step"] == 6
    assert_close_f32(a["model"], b["model"])


SPAWN_PROBE = """
import multiprocessing as mp, rpcmp, sys
if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=print, args=("child ok",))
    p.start(); p.join(); sys.exit(p.exitcode)
"""


def _reachable_python():
    """A command prefix that lets an unprivileged user reach this Python, which may live under a
    folder only root may enter (pyenv under /root): in a mount namespace of the command's own,
    that folder is a tmpfs that others may enter, holding the interpreter's tree bound back
    in. Nothing outside the command changes."""
    real = os.path.realpath(sys.executable)
    parts = real.split(os.sep)
    blocked = [os.sep.join(parts[:i]) for i in range(2, len(parts)) if not os.stat(os.sep.join(parts[:i])).st_mode & 0o001]
    if not blocked:
        return []
    top = blocked[0]
    inner = os.sep.join(parts[:len(top.split(os.sep)) + 1])
    script = (f'set -e; keep=$(mktemp -d); mount --bind "{inner}" "$keep"; mount -t tmpfs -o mode=0755 tmpfs "{top}"; '
              f'mkdir -p "{inner}"; mount --bind "$keep" "{inner}"; exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


def _as_user_ok():
    import shutil
    if os.geteuid() != 0 or not (shutil.which("useradd") and shutil.which("setpriv")):
        return "needs root, useradd and setpriv"
    return None


@pytest.mark.skipif(_as_user_ok() is not None, reason=f"an unprivileged daemon: {_as_user_ok()}")
@pytest.mark.timeout(300)
def test_an_unprivileged_daemon_with_the_documented_token_permissions_serves_a_checkpointing_job(tmp_path):
    import pwd
    import shutil
    import tempfile
    import uuid

    from rpcmp.core.checkpoint import load_checkpoint
    user = f"rpcmpt{uuid.uuid4().hex[:6]}"
    subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
                   check=True)
    etc, state = tempfile.mkdtemp(dir="/tmp"), tempfile.mkdtemp(dir="/tmp")
    daemon = None
    try:
        ids = pwd.getpwnam(user)
        as_user = [*_reachable_python(), "setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--"]
        with open(os.path.join(state, "probe.py"), "w") as f:
            f.write(SPAWN_PROBE)
        os.chmod(state, 0o755)
        probe = subprocess.run([*as_user, sys.executable, os.path.join(state, "probe.py")], capture_output=True,
                               text=True, cwd=state)
        if probe.returncode:
            pytest.skip(f"user {user} cannot run this checkout's Python: {probe.stderr.strip()[-300:]}")
        # workers/README.md: /etc/rpcmp root:rpcmp 0750, the token root:rpcmp 0640, state in the user's folder
        os.chown(etc, 0, ids.pw_gid)
        os.chmod(etc, 0o750)
        token = os.path.join(etc, "token")
        with open(token, "w") as f:
            f.write("s3cret\n")
        os.chmod(token, 0o600)  # root-owned 0600 (the old advice): the daemon says why it cannot start
        refused = subprocess.run([*as_user, RPCMP, "worker", "--master", "127.0.0.1:1", "--rank", "1", "--token-file", token],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and f"cannot read the token file {token} as user {user}" in refused.stderr \
            and "chmod 640" in refused.stderr, refused.stderr
        os.chown(token, 0, ids.pw_gid)
        os.chmod(token, 0o640)
        os.chown(state, ids.pw_uid, ids.pw_gid)
        os.chmod(state, 0o750)
        os.makedirs(os.path.join(state, "tmp"))
        os.chown(os.path.join(state, "tmp"), ids.pw_uid, ids.pw_gid)
        ckpt = os.path.join(state, "job")
        os.makedirs(ckpt)
        os.chown(ckpt, ids.pw_uid, ids.pw_gid)
        port = free_port()
        log = open(tmp_path / "daemon.log", "w")
        daemon = subprocess.Popen([*as_user, RPCMP, "worker", "--master", f"127.0.0.1:{port}", "--rank", "1",
                                   "--token-file", token, "--preload", ""], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "TMPDIR": os.path.join(state, "tmp"), "HOME": state}, cwd=state)
        out, _ = _master(port, token, "--max-steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", ckpt,
                         workers=1).communicate(timeout=150)
        assert "steps 4" in out, out + open(tmp_path / "daemon.log").read()
        _wait_log(tmp_path / "daemon.log", "ended (exit 0)")
        run = load_checkpoint(ckpt)["run"]
        stage0 = os.path.join(ckpt, f"step-00000004.{run}.stage-0.pt")  # written by the daemon's stage
        assert os.stat(stage0).st_uid == ids.pw_uid
    finally:
        if daemon is not None and daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait(10)
        shutil.rmtree(etc, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
        subprocess.run(["userdel", user], check=False)
