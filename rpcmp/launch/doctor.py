"""``rpcmp doctor``: a preflight of this node before a job, and what to fix.

    rpcmp doctor                                   # this node
    rpcmp doctor --master 10.0.0.1:29500 --nodes 3 # and can it reach the master?
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from .network import interfaces, is_loopback

__all__ = ["diagnose", "render"]


def _addresses() -> dict[str, list[str]]:
    try:
        out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, timeout=5).stdout
        return {i["ifname"]: [f"{a['local']}/{a['prefixlen']}" for a in i.get("addr_info", [])]
                for i in json.loads(out)}
    except (OSError, ValueError, subprocess.SubprocessError):
        return {name: [] for name in interfaces()}


def _check(name: str, ok: bool, detail: str, fix: str = "") -> dict:
    return {"check": name, "ok": ok, "detail": detail, "fix": "" if ok else fix}


def diagnose(master: str | None = None, iface: str | None = None, nodes: int = 1) -> dict:
    """Everything the doctor looks at, as data (the CLI renders it)."""
    iface = iface or os.environ.get("RPCMP_IFACE")
    addrs = _addresses()
    host = socket.gethostname()
    try:
        host_ip = socket.gethostbyname(host)
    except OSError:
        host_ip = "unresolvable"
    used = iface or next((n for n, a in addrs.items() if any(x.split("/")[0] == host_ip for x in a)), None)
    checks = []
    if iface:
        checks.append(_check("interface", iface in addrs, f"{iface}: {', '.join(addrs.get(iface, [])) or 'missing'}",
                             f"use one of {sorted(addrs)} with --iface / RPCMP_IFACE"))
    loop = is_loopback(host)
    checks.append(_check(
        "hostname", not (loop and nodes > 1 and not iface), f"{host} -> {host_ip}{' (loopback)' if loop else ''}",
        "other nodes cannot reach a loopback address: pass torchrun --local-addr <this node's IP> on every node "
        "(--rdzv-conf is_host=true on the rendezvous host) and --iface, or map the hostname to a real address "
        "in /etc/hosts"))
    if master:
        mhost, _, mport = master.rpartition(":")
        start = time.monotonic()
        try:
            with socket.create_connection((mhost, int(mport)), timeout=3):
                ok, detail = True, f"{master} reachable in {1e3 * (time.monotonic() - start):.1f} ms"
        except (OSError, ValueError) as exc:
            ok, detail = False, f"{master} unreachable after {time.monotonic() - start:.1f}s: {exc}"
        checks.append(_check("master port", ok, detail,
                             "start the master first, check that its address is on a network this node shares, "
                             "and that no firewall blocks the port"))
    checks.append(_check("torch", True, f"{torch.__version__}"))
    checks.append(_check("gloo", dist.is_gloo_available(), "available" if dist.is_gloo_available() else "missing",
                         "install a torch build with gloo"))
    nccl = dist.is_nccl_available() and torch.cuda.is_available()
    checks.append(_check("nccl", True, "available" if nccl else "not usable here (no GPU or no NCCL): DDP uses gloo"))
    rpc_ok = torch.distributed.rpc.is_available()
    shm = os.access("/dev/shm", os.W_OK)
    checks.append(_check("TensorPipe", rpc_ok, f"transports: uv{', shm' if shm else ''}" if rpc_ok else "missing",
                         "install a torch build with torch.distributed.rpc"))
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    checks.append(_check("GPUs", True, f"{len(gpus)} visible" + (f": {', '.join(gpus)}" if gpus else "")))
    return {"host": host, "interfaces": addrs, "used": used, "checks": checks}


def render(report: dict, console: Console | None = None) -> bool:
    console = console or Console()
    table = Table(title=f"interfaces on {report['host']}")
    table.add_column("interface")
    table.add_column("addresses")
    table.add_column("used")
    for name, addrs in report["interfaces"].items():
        table.add_row(name, ", ".join(addrs) or "-", "<- rpcmp" if name == report["used"] else "")
    console.print(table)
    checks = Table(title="checks")
    for col in ("check", "status", "detail", "what to fix"):
        checks.add_column(col)
    for c in report["checks"]:
        checks.add_row(c["check"], "[green]ok[/]" if c["ok"] else "[red]FAIL[/]", c["detail"], c["fix"])
    console.print(checks)
    healthy = all(c["ok"] for c in report["checks"])
    console.print("[green]ready[/]" if healthy else "[red]not ready: fix the FAIL lines above[/]")
    return healthy
