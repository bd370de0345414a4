"""Worker daemons serve job after job: two jobs in a row, a master killed mid-job, a
third job, a stranger's job refused, and SIGTERM stops them cleanly."""
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import job_path
from rpcmp.runtime import free_port

pytestmark = pytest.mark.integration
RPCMP = os.path.join(os.path.dirname(sys.executable), "rpcmp")


def _master(port, token_file, *args, timeout=120, **kw):
    return subprocess.Popen([RPCMP, "run", job_path("mlp"), "--workers", "2", "--listen", f"127.0.0.1:{port}",
                             "--token-file", str(token_file), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


@pytest.mark.timeout(300)
def test_daemons_serve_jobs_survive_a_dead_master_and_refuse_strangers(tmp_path):
    port = free_port()
    while port + 1 > 65535:
        port = free_port()
    token, wrong = tmp_path / "token", tmp_path / "wrong"
    token.write_text("s3cret\n")
    wrong.write_text("guess\n")
    logs = [open(tmp_path / f"worker{r}.log", "w") for r in (1, 2)]
    daemons = [subprocess.Popen([RPCMP, "worker", "--master", f"127.0.0.1:{port}", "--rank", str(r),
                                 "--token-file", str(token)], stdout=logs[r - 1], stderr=subprocess.STDOUT,
                                start_new_session=True) for r in (1, 2)]
    try:
        for _ in range(2):  # two jobs, one after the other
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
    assert text.count("serving rank 1 of 3") == 4  # two jobs, the one whose master died, the third
    assert text.count("ended (exit 0)") >= 3
    assert "wrong job token, refused" in text and "worker daemon stopped" in text
