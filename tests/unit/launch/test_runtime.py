"""How many threads a process takes (the cores it may use, not the machine's), and how it leaves the RPC world."""
import os
import platform
import subprocess
import sys

import pytest

from rpcmp.launch import ending, runtime


def _cgroup_v2(tmp_path, cpu_max):
    (tmp_path / "cpu.max").write_text(cpu_max)
    return str(tmp_path)


def test_threads_follow_the_cpu_affinity(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))  # srun --cpus-per-task=8
    root = _cgroup_v2(tmp_path, "max 100000\n")
    assert runtime.usable_cpus(root) == 8
    monkeypatch.setattr(runtime, "usable_cpus", lambda: 8)
    assert runtime.default_threads(2) == 4 and runtime.default_threads(16) == 1


def test_threads_follow_a_cgroup_cpu_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)))
    assert runtime.usable_cpus(_cgroup_v2(tmp_path, "800000 100000\n")) == 8  # docker --cpus=8
    assert runtime.usable_cpus(_cgroup_v2(tmp_path, "150000 100000\n")) == 2  # 1.5 cores: 2 threads
    assert runtime.usable_cpus(_cgroup_v2(tmp_path, "max 100000\n")) == 128
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert runtime.usable_cpus(str(v1)) == 4
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert runtime.usable_cpus(str(v1)) == 128


def test_a_worker_serves_until_the_master_says_so_or_stops_answering(monkeypatch):
    """[Note: a worker serves until the master's word]: no time bound while the master answers."""
    import threading
    import time
    from rpcmp.core.served import Served

    served, pings = Served(), []

    def ping(processes, timeout):
        pings.append((processes, timeout))
        return [] if len(pings) < 5 else processes  # the master answers four pings, then is gone

    monkeypatch.setattr(ending, "unresponsive", ping)
    ending.serve_until_told(served, timeout=7.0, every=0.01)
    assert len(pings) == 5 and pings[0] == (["master"], 7.0)  # it outlived four rounds and left on the fifth

    pings.clear()
    monkeypatch.setattr(ending, "unresponsive", lambda processes, timeout: pings.append(1) or [])
    threading.Timer(0.3, served.told.set).start()
    start = time.monotonic()
    ending.serve_until_told(served, timeout=7.0, every=0.01)
    assert served.told.is_set() and time.monotonic() - start >= 0.25 and len(pings) >= 5


def test_a_connection_refused_as_the_world_forms_is_said_as_such_not_as_a_half_hour_timeout(monkeypatch):
    """torch's init_rpc reports a peer that refused a connection as "timed out in _all_gather after 1800.00 seconds"
    at once (seen with a stray connection on a worker's port as the run started); other errors go through as they are."""
    from rpcmp.errors import NetworkError

    def refused(*args, **kwargs):
        raise RuntimeError("Followers ['worker1'] timed out in _all_gather after 1800.00 seconds. The first exception "
                           "is ECONNREFUSED: connection refused (this error originated at tensorpipe/transport/uv/...)")
    monkeypatch.setattr(runtime.rpc, "init_rpc", refused)
    with pytest.raises(NetworkError, match=r"could not all connect as it started \(master: Followers \['worker1'\] .* "
                                           r"ECONNREFUSED.*run it again") as caught:
        runtime._init_rpc("master", 0, 3, None)
    assert caught.value.__cause__ is None and "died while the run started" in str(caught.value)

    def other(*args, **kwargs):
        raise RuntimeError("Address already in use")
    monkeypatch.setattr(runtime.rpc, "init_rpc", other)
    with pytest.raises(RuntimeError, match="Address already in use") as caught:
        runtime._init_rpc("master", 0, 3, None)
    assert not isinstance(caught.value, NetworkError)


def test_a_muted_end_drops_native_writes_to_stderr_but_not_python_s_and_puts_both_back(capfd, monkeypatch):
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    with ending.native_log_muted():
        os.write(2, b"[W tensorpipe_agent.cpp] pipe closed\n")  # as TensorPipe writes: to the descriptor
        print("rpcmp: said by Python", file=sys.stderr)
        with ending.native_log_muted():  # muted already: a no-op, Python's output still goes out
            print("rpcmp: said again", file=sys.stderr)
    os.write(2, b"native after\n")
    print("python after", file=sys.stderr)
    err = capfd.readouterr().err
    assert "pipe closed" not in err
    assert "said by Python" in err and "said again" in err and "native after" in err and "python after" in err


def test_with_the_native_log_asked_for_nothing_is_muted(capfd, monkeypatch):
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "WARNING")
    with ending.native_log_muted():
        os.write(2, b"[W tensorpipe_agent.cpp] pipe closed\n")
    assert "pipe closed" in capfd.readouterr().err


def _taken(port: int) -> bool:
    import socket
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def test_a_picked_port_lies_below_the_kernel_s_ephemeral_range_and_stays_taken_until_handed_on():
    """[Note: ports below the ephemeral range]: nothing the kernel hands out by itself lands on it."""
    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    socks = runtime.reserve_ports("127.0.0.1", 2)
    ports = [s.getsockname()[1] for s in socks]
    assert ports[1] == ports[0] + 1 and not any(low <= p <= high for p in ports)
    assert all(_taken(p) for p in ports)  # held: not even a SO_REUSEADDR bind gets it
    for s in socks:
        s.close()
    assert not any(_taken(p) for p in ports)
    assert not low <= runtime.free_port() <= high


def test_the_local_launcher_holds_its_rendezvous_port_until_the_store_listens_on_it(monkeypatch):
    """The port is picked before the ranks fork and listened on after: held all the while, so no other process's
    listener takes it meanwhile (that made ranks of one run connect to a listener of another)."""
    import pytest
    from rpcmp.launch import local

    seen = []

    class Stop(Exception):
        pass

    def bound_store(host, port, sock=None):
        seen.append(_taken(port))
        raise Stop

    monkeypatch.setattr(local, "bound_store", bound_store)
    monkeypatch.setattr(local, "_rpc_used_here", lambda: False)
    job = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "mlp.py")
    with pytest.raises(Stop):  # one process: the master here, nothing forked
        local.launch_local(job, 1, lambda job, world: None)
    assert seen == [True]


_STEPS = r"""
import ctypes, resource, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
if sys.argv[1] == "rpcmp":
    from rpcmp.launch import runtime
    runtime._malloc_settings()
faults = []
for _ in range(4):  # a step's buffers: six 4 MiB gradients made, written, then let go
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(4 << 20) for _ in range(6)]
    for b in blocks:
        ctypes.memset(b, 1, 4 << 20)
    for b in blocks:
        libc.free(b)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults[1:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or "glibc" not in " ".join(platform.libc_ver()),
                    reason="glibc's malloc")
def test_a_step_s_freed_buffers_are_kept_for_the_next_step_not_faulted_in_again():
    """Each step makes and frees the same buffers; glibc's default hands the heap's top back to the kernel and the
    next step faults every page in again (6,144 for 24 MiB). A process of rpcmp keeps them: see
    [Note: one malloc arena]. What a user exports wins (MALLOC_*_THRESHOLD_, GLIBC_TUNABLES)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    run = [sys.executable, "-c", _STEPS]
    default, kept = (int(subprocess.run(run + [which], env=env, capture_output=True, text=True, check=True).stdout)
                     for which in ("plain", "rpcmp"))
    assert default > 1000 and kept < 100, (default, kept)
    for told in ({"MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_MMAP_THRESHOLD_": "131072"},
                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072:glibc.malloc.mmap_threshold=131072"}):
        faults = int(subprocess.run(run + ["rpcmp"], env={**env, **told}, capture_output=True, text=True,
                                    check=True).stdout)
        assert faults > 1000, (told, faults)
