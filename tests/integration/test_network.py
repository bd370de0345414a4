"""Across a real network: a three-node cluster in Linux network namespaces, and every
network misconfiguration ending in a clear error within a bounded time."""
import os
import re
import socket
import subprocess
import sys
import time
import uuid

import pytest

from helpers import fit_steps, job_path, run_command

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "launch", "netns-cluster.sh")


def _netns_ok():
    if os.geteuid() != 0:
        return "needs root for ip netns"
    name = f"rpcmp-probe-{uuid.uuid4().hex[:6]}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode:
        return f"ip netns does not work here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name])
    return None


NETNS_SKIP = _netns_ok()
needs_netns = pytest.mark.skipif(NETNS_SKIP is not None, reason=f"network namespaces: {NETNS_SKIP}")


def _cluster(tmp_path, *job_args, env=None, limit=400, nodes=3, per_node=1):
    proc = subprocess.Popen(["bash", SCRIPT, "--nodes", str(nodes), "--nproc-per-node", str(per_node),
                             "--timeout", str(limit - 60), "--logs", str(tmp_path), "--", *job_args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHON": sys.executable, "COLUMNS": "160", **(env or {})})
    try:
        out, err = proc.communicate(timeout=limit)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the script's trap removes its namespaces
            proc.wait(30)
    assert not _namespaces_of(proc.pid), f"namespaces were left behind: {_namespaces_of(proc.pid)}\n{err}"
    logs = "".join(open(os.path.join(tmp_path, f)).read() for f in sorted(os.listdir(tmp_path)) if f.endswith(".log"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), logs


def _namespaces_of(script_pid: int) -> list[str]:
    """The namespaces that the cluster script with this pid made and has not removed."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [n for n in listed if n.startswith(("rpcmp-n", "rpcmp-sw")) and n.endswith(f"-{script_pid}")]


@needs_netns
@pytest.mark.timeout(420)
def test_split_unet_on_three_namespaced_nodes_with_torchrun(tmp_path):
    proc, logs = _cluster(tmp_path, job_path("unet"), "--epochs", "10", "--max-steps", "4")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr + logs
    assert all(f"node{i}: exit 0" in out for i in range(3)), out
    m = re.search(r"loss ([\d.]+) -> ([\d.]+)", out)
    assert m and float(m.group(2)) < float(m.group(1)), out
    assert "0:encoder@worker1/cpu" in out and "2:segmentation_head@master/cpu" in out
    assert not subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).stdout


@needs_netns
@pytest.mark.timeout(300)
def test_master_addr_on_loopback_across_nodes_is_an_error_not_a_hang(tmp_path):
    start = time.monotonic()
    proc, logs = _cluster(tmp_path, job_path("mlp"), env={"RPCMP_NETNS_OMIT_LOCAL_ADDR": "1"}, limit=240)
    assert proc.returncode != 0
    assert time.monotonic() - start < 150
    assert "resolves to 127.0.0.1 (loopback), but the job spans 3 nodes" in logs and "--local-addr" in logs


def _master(env, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "rpcmp.master", job_path("mlp"), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env})


def _closed_port():
    """A port nobody listens on; below the ephemeral range, so no other test's listener takes it meanwhile (this test's
    connection attempts would reach that listener and end it)."""
    from rpcmp.launch.runtime import free_port
    return free_port()


@pytest.mark.timeout(60)
def test_interface_that_does_not_exist():
    proc = _master({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_closed_port())},
                   "--iface", "nope0")
    assert proc.returncode == 1
    assert "network interface 'nope0' does not exist" in proc.stderr and "'lo'" in proc.stderr


@pytest.mark.timeout(60)
def test_unreachable_master_reports_the_time_waited():
    start = time.monotonic()
    proc = _master({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_closed_port())},
                   "--connect-timeout", "3")
    assert proc.returncode == 1 and time.monotonic() - start < 30
    assert re.search(r"the master at 127.0.0.1:\d+ is unreachable: waited [34]s", proc.stderr), proc.stderr


@pytest.mark.timeout(120)
def test_a_listener_stopped_as_the_run_starts_ends_it_there_saying_why():
    """A connection that reaches worker2's RPC port and closes at once, as the run starts (tests/jobs/stray_connection.py,
    before the others open their pipes to it), stops its listener (TensorPipe's): the run cannot go on. It ended at the
    first held-out evaluation with a bare "RuntimeError: ECONNREFUSED" traceback."""
    done = run_command("run", job_path("stray_connection"), "--local", "3", "--max-steps", "3",
                       env={**os.environ, "STRAY_ON": "worker2"}, timeout=100)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "error: NetworkError: the run's processes could not all connect as it started (worker1 could not connect to " \
           "worker2" in done.stderr and "although worker2 is running" in done.stderr, done.stderr
    assert "Nothing was built or trained: run it again" in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _master({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert proc.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in proc.stderr


def _train_and_list_sockets(job, world_size):
    import rpcmp
    pipe = rpcmp.Pipeline(job, world_size)
    x, y = job.data()[0][:8]
    pipe.train_step(x, y)
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    pipe.close()
    return listening


@needs_netns
@pytest.mark.timeout(180)
def test_a_local_run_listens_on_loopback_only_even_with_an_interface_named():
    # In a namespace of its own with a second interface, so that nothing reaches beyond this test.
    ns = f"rpcmp-lo-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for cmd in (["link", "set", "lo", "up"], ["link", "add", "eth9", "type", "veth", "peer", "name", "eth8"],
                    ["addr", "add", "10.233.7.1/24", "dev", "eth9"], ["link", "set", "eth9", "up"], ["link", "set", "eth8", "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)
        code = ("import sys; sys.path[:0] = [%r, %r]; from helpers import job_path; import test_network as t; "
                "from rpcmp.launch.local import launch_local; "
                "print(launch_local(job_path('mlp'), 3, t._train_and_list_sockets, timeout=120, master_in_process=False))"
                % (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(__file__)))
        proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=150, env={**os.environ, "RPCMP_IFACE": "eth9"})
    finally:
        subprocess.run(["ip", "netns", "del", ns])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    addrs = [line.split()[3] for line in proc.stdout.splitlines() if line.startswith("LISTEN")]
    assert len(addrs) >= 4, proc.stdout  # the store and each process's TensorPipe listener
    assert all(a.rsplit(":", 1)[0] in ("127.0.0.1", "[::ffff:127.0.0.1]") for a in addrs), addrs


def _rank0_pid(namespace):
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"RANK=0" in env and b"rpcmp.master" in cmd and b"torch.distributed.run" not in cmd:
            return int(pid)
    return None


@needs_netns
@pytest.mark.timeout(600)
def test_rank_0_killed_on_the_cluster_restarts_resumes_and_ends_equal_to_an_uninterrupted_run(tmp_path):
    from helpers import assert_close_f32, run_ranks
    from rpcmp.core.checkpoint import complete_stems, latest_checkpoint, load_checkpoint
    steps, every = 200, 50
    clean, faulty, logs = tmp_path / "clean", tmp_path / "faulty", tmp_path / "logs"
    logs.mkdir()
    common = {"max_steps": steps, "epochs": 100, "checkpoint_every": every}
    assert run_ranks("mlp", 3, fit_steps, {**common, "checkpoint_dir": str(clean)}, timeout=240) == steps
    proc = subprocess.Popen(["bash", SCRIPT, "--timeout", "420", "--logs", str(logs), "--", job_path("mlp"),
                             "--max-steps", str(steps), "--epochs", "100", "--checkpoint-every", str(every),
                             "--checkpoint-dir", str(faulty)],  # no --resume: a restart resumes by itself
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHON": sys.executable, "COLUMNS": "160",
                                 "RPCMP_NETNS_TORCHRUN_ARGS": "--max-restarts=1"})
    try:
        deadline = time.monotonic() + 240
        while latest_checkpoint(str(faulty)) is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.05)
        rank0 = _rank0_pid(f"rpcmp-n0-{proc.pid}")
        assert rank0 is not None
        os.kill(rank0, 9)  # SIGKILL the master: every rank's job ends abnormally, every agent restarts
        out, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the script's trap kills the nodes and removes the namespaces
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert not _namespaces_of(proc.pid), _namespaces_of(proc.pid)
    node_logs = "".join(open(logs / f).read() for f in sorted(os.listdir(logs)))
    assert proc.returncode == 0 and all(f"node{i}: exit 0" in out for i in range(3)), out + node_logs
    assert "resumed run" in node_logs and "continuing run" in node_logs, node_logs
    a, b = load_checkpoint(str(clean)), load_checkpoint(str(faulty))
    assert a["step"] == b["step"] == steps
    assert_close_f32(b["model"], a["model"])
    parts = {f.split(".stage-")[0] for f in os.listdir(faulty) if ".stage-" in f}
    assert not [f for f in os.listdir(faulty) if f.endswith(".tmp")] and parts <= complete_stems(str(faulty))


# (nodes, processes per node, the grid the banner shows): 4 nodes of 1 process (the master holds a copy),
# and 3 nodes of 2 where the grid follows the nodes: each stage's copies on one node (by rank, stage 0's
# copies would be ranks 1 and 2, on two nodes), the master's node holding no stage
GRIDS = [(4, 1, "0@master/cpu,worker1/cpu  1@worker2/cpu,worker3/cpu"),
         (3, 2, "0@worker2/cpu,worker3/cpu  1@worker4/cpu,worker5/cpu")]


@needs_netns
@pytest.mark.timeout(420)
@pytest.mark.parametrize("nodes,per_node,grid", GRIDS, ids=["4x1", "3x2"])
def test_two_replicas_of_two_stages_on_namespaced_nodes_equal_a_local_run(tmp_path, nodes, per_node, grid):
    from helpers import assert_close_f32, run_ranks
    from rpcmp.core.checkpoint import load_checkpoint
    os.makedirs(tmp_path / "logs")
    proc, logs = _cluster(tmp_path / "logs", os.path.join(ROOT, "tests", "jobs", "mlp.py"), "--replicas", "2",
                          "--max-steps", "6", "--checkpoint-dir", str(tmp_path / "cluster"), nodes=nodes, per_node=per_node)
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    assert all(f"node{i}: exit 0" in proc.stdout for i in range(nodes)), proc.stdout
    assert f"x 2 replicas: {grid}" in proc.stdout, proc.stdout
    local = run_ranks("mlp", 4, fit_steps, {"replicas": 2, "max_steps": 6, "checkpoint_dir": str(tmp_path / "local")},
                      timeout=240)
    assert local == 6
    assert_close_f32(load_checkpoint(str(tmp_path / "cluster"))["model"], load_checkpoint(str(tmp_path / "local"))["model"])


def _ranks_alive(cluster_pid: int, nodes: int) -> bool:
    """Whether a rank process of the cluster (not a torchrun agent) is still running."""
    for i in range(nodes):
        for pid in subprocess.run(["ip", "netns", "pids", f"rpcmp-n{i}-{cluster_pid}"], capture_output=True,
                                  text=True).stdout.split():
            try:
                env = open(f"/proc/{pid}/environ", "rb").read()
            except OSError:
                continue
            if b"LOCAL_RANK=" in env and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                return True
    return False


def _rank_namespace(cluster_pid: int, nodes: int, rank: int) -> str | None:
    """The namespace (node) of the cluster whose rpcmp process has ``RANK=rank``."""
    for i in range(nodes):
        ns = f"rpcmp-n{i}-{cluster_pid}"
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and b"LOCAL_RANK=0" in env:
                return ns
    return None


@needs_netns
@pytest.mark.timeout(600)
def test_a_lost_node_is_replaced_by_a_spare_node_and_the_run_ends_equal_to_an_uninterrupted_run(tmp_path):
    """Five nodes of one process: the master, three owners and a spare node. Every process of the node that
    owns stage 1 (its torchrun agent too) is SIGKILLed at a random step; the master replaces it in place.
    torchrun's agents then wait at their exit barrier for the lost node's agent (torch's exit_barrier_timeout,
    300 s, not settable from the torchrun command line): the test stops the cluster once every rank has
    exited and the master has written the last checkpoint, rather than wait that out."""
    import random
    import signal
    from helpers import assert_close_f32
    from rpcmp.core.checkpoint import latest_checkpoint, load_checkpoint
    clean, faulty, logs = tmp_path / "clean", tmp_path / "faulty", tmp_path / "logs"
    logs.mkdir()
    args = ["--max-steps", "80", "--spares", "1", "--threads", "1"]
    from helpers import run_ranks
    assert run_ranks("three", 5, fit_steps, {"max_steps": 80, "spares": 1, "threads": 1, "checkpoint_dir": str(clean)},
                     timeout=240) == 80
    proc = subprocess.Popen(["bash", SCRIPT, "--nodes", "5", "--timeout", "400", "--logs", str(logs), "--", job_path("three"),
                             *args, "--checkpoint-dir", str(faulty), "--metrics", str(tmp_path / "m.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHON": sys.executable, "COLUMNS": "200"})
    at = random.randint(3, 15)
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(tmp_path / "m.jsonl") or sum(1 for _ in open(tmp_path / "m.jsonl")) < at:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.005)
        node = _rank_namespace(proc.pid, 5, 2)
        assert node is not None
        victims = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout.split()
        for pid in victims:  # the node is gone: its agent and its rank
            os.kill(int(pid), signal.SIGKILL)
        while _ranks_alive(proc.pid, 5) or latest_checkpoint(str(faulty)) is None or \
                load_checkpoint(str(faulty))["step"] != 80:
            assert proc.poll() is None and time.monotonic() < deadline + 120, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert not _namespaces_of(proc.pid), _namespaces_of(proc.pid)
    node_logs = "".join(open(logs / f).read() for f in sorted(os.listdir(logs)))
    assert node_logs.count("recovered: worker2 was lost") == 1, f"killed at step {at}\n" + node_logs
    assert "steps 80" in node_logs and "Traceback" not in node_logs, node_logs
    assert_close_f32(load_checkpoint(str(faulty))["model"], load_checkpoint(str(clean))["model"])
