"""The split Unet across three nodes whose links are shaped: rpcmp (float32, ``--wire bf16`` and ``int8``)
against ``torch.distributed.pipelining`` (gloo, the same three parts and weights, its best of
GPipe and 1F1B) and the hand-written master-driven RemoteModule version, over each link rate.

    sudo make bench-net     # or: sudo .venv/bin/python benchmarks/network.py [--rates ...] [--rounds N]

The nodes are Linux network namespaces on one machine, joined by a bridge (as
launch/netns-cluster.sh makes them); every node's link is shaped with ``tc``'s ``tbf`` both ways
(the node's own interface and the bridge's end of it). The bench makes its namespaces, shapes
only them and removes them at the end, also when it fails. Per rate and system: the median
step time over the timed steps of each launch, the median over launches (the systems take turns,
launch by launch), samples/s, and the bytes each node sent per step, read from the interfaces'
counters around the timed steps; for rpcmp, the bubble and the share of the activations' transfer
time that the sending stage spent computing, from two more steps traced as ``--trace`` traces them
(rpcmp.train.timeline; the trace files are in the node logs' folder). Writes
bench-results/network.json and prints a table. The
model, batch (16 of 1x128x128) and M = 4 are those of `make bench`'s split Unet.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import click
from rich.console import Console
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ("rpcmp", "rpcmp --wire bf16", "rpcmp --wire int8", "pipelining", "hand-written RPC")
RATES = ("unshaped", "10gbit", "1gbit", "100mbit")
WARMUP, STEPS, SAMPLES = 2, 6, 16


class Cluster:
    """Three namespaced nodes on a bridge; ``shape`` limits every node's link both ways."""

    def __init__(self, nodes: int = 3):
        tag = os.getpid()
        self.subnet, self.tag, self.nodes = f"10.233.{tag % 200 + 20}", tag, nodes
        self.switch, self.names = f"rpcmp-bsw-{tag}", [f"rpcmp-bn{i}-{tag}" for i in range(nodes)]
        self.made: list[str] = []

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def __enter__(self) -> "Cluster":
        try:
            self._ip("netns", "add", self.switch)
            self.made.append(self.switch)
            self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                self._ip("netns", "add", ns)
                self.made.append(ns)
                self._ip("link", "add", f"vb{i}-{self.tag}", "netns", self.switch, "type", "veth", "peer", "name",
                         "eth0", "netns", ns)
                self._ip("-n", self.switch, "link", "set", f"vb{i}-{self.tag}", "master", "br0", "up")
                self._ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                self._ip("-n", ns, "link", "set", "eth0", "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.made:  # every process in them first, then the namespaces (their qdiscs go with them)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []

    def shape(self, rate: str) -> None:
        """Every node's link at ``rate`` (tc tbf) both ways, or unshaped."""
        for i, ns in enumerate(self.names):
            for where, dev in ((ns, "eth0"), (self.switch, f"vb{i}-{self.tag}")):
                subprocess.run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"], capture_output=True)
                if rate != "unshaped":
                    # a burst of about 2 ms of traffic (and at least 64 KiB), as tbf needs at high rates
                    burst = max(64 * 1024, _bits(rate) // 8 // 500)
                    self._tc("-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
                             "latency", "100ms")

    def launch(self, system: str, port: int, folder: str, timeout: float = 600) -> dict:
        """One launch of ``system`` on the nodes; rank 0's result."""
        out = os.path.join(folder, f"result-{port}.json")
        procs = []
        for r, ns in enumerate(self.names):
            cmd = ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "node", "--system", system,
                   "--rank", str(r), "--addr", self.addr(0), "--port", str(port), "--out", out,
                   "--namespaces", ",".join(self.names)]
            log = open(os.path.join(folder, f"node{r}-{port}.log"), "w")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"{system} did not finish in {timeout:.0f} s; logs in {folder}") from None
        if any(p.returncode for p in procs) or not os.path.exists(out):
            raise RuntimeError(f"{system} failed (exit codes {[p.returncode for p in procs]}); logs in {folder}")
        with open(out) as f:
            return json.load(f)

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    @staticmethod
    def _tc(*args: str) -> None:
        subprocess.run(["tc", *args], check=True, capture_output=True)


def _bits(rate: str) -> int:
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3}
    for unit, mult in units.items():
        if rate.endswith(unit):
            return int(float(rate[:-len(unit)]) * mult)
    raise click.BadParameter(f"a rate like 1gbit or 100mbit, got {rate!r}")


class Timed:
    """The step timer every system uses on every rank; rank 0 also counts the bytes each node
    sends during the timed steps (the namespaces' counters, read from here as root)."""

    def __init__(self, rank: int, namespaces: list[str]):
        self.rank, self.namespaces, self.bytes = rank, namespaces, []

    def _counters(self) -> list[int]:
        out = []
        for ns in self.namespaces:
            got = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", "eth0"], capture_output=True, text=True,
                                 check=True).stdout
            out.append(json.loads(got)[0]["stats64"]["tx"]["bytes"])
        return out

    def __call__(self, step) -> float:
        for _ in range(WARMUP):
            step()
        before = self._counters() if self.rank == 0 else None
        times = []
        for _ in range(STEPS):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        if before is not None:
            self.bytes.append([(b - a) / STEPS for a, b in zip(before, self._counters())])
        return statistics.median(times)


class _Result:
    """What bench.py's workers ``put`` on a queue, written to a file instead (processes of other namespaces)."""

    def __init__(self, path: str, timed: Timed):
        self.path, self.timed = path, timed

    def put(self, value, trace: dict | None = None) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump({"step_s": value, "bytes": self.timed.bytes, "trace": trace}, f)
        os.replace(self.path + ".tmp", self.path)


def _node(system: str, rank: int, addr: str, port: int, out: str, namespaces: list[str]) -> None:
    sys.path.insert(0, HERE)
    import bench
    timed = Timed(rank, namespaces)
    result = _Result(out, timed)
    if system == "pipelining":
        bench._pipelining(rank, port, result if rank == 0 else None, "unet", addr=addr, iface="eth0", timer=timed)
    elif system == "hand-written RPC":
        bench._hand_rpc(rank, port, result, addr=addr, iface="eth0", timer=timed)
    else:
        from rpcmp.launch.runtime import run_rank
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RPCMP_IFACE="eth0", TP_SOCKET_IFNAME="eth0",
                          GLOO_SOCKET_IFNAME="eth0")
        overrides = {"wire": system.split()[-1]} if "--wire" in system else None

        def main(job, world):
            import rpcmp
            x, y = bench.unet_data()
            pipe = rpcmp.Pipeline(job, world, sample=x)
            step_s = timed(lambda: pipe.train_step(x, y))
            return step_s, _trace(pipe, lambda: pipe.train_step(x, y), out + ".trace.json")
        got = run_rank(os.path.join(HERE, "jobs", "unet.py"), rank, 3, main, overrides=overrides, local_procs=1)
        if rank == 0:
            result.put(*got)


def _trace(pipe, step, path: str, steps: int = 2) -> dict:
    """``steps`` more steps traced as ``--trace`` traces them (rpcmp.train.timeline): the bubble and the
    share of the activations' transfer time that the sending stage spent computing."""
    from rpcmp.train.timeline import write_chrome_trace
    pipe.start_trace()
    traced = []
    for n in range(steps):
        first = pipe.next_seq
        step()
        traced.append({"step": n + 1, "seqs": list(range(first, pipe.next_seq))})
    events = pipe.stop_trace()
    for st in traced:
        st["events"] = events
    return write_chrome_trace(path, traced, [s.name for s in pipe.specs], len(traced[0]["seqs"]))


@click.group(invoke_without_command=True)
@click.option("--rates", default=",".join(RATES), show_default=True, help="Link rates (tc tbf), or 'unshaped'.")
@click.option("--rounds", default=2, show_default=True, help="Launches of each system per rate, taking turns.")
@click.option("--systems", default=",".join(SYSTEMS), show_default=True, help="Which systems (pipelining always).")
@click.option("--out", default="bench-results/network.json", show_default=True)
@click.pass_context
def main(ctx, rates, rounds, systems, out):
    if ctx.invoked_subcommand is not None:
        return
    console = Console()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill from outside still removes the namespaces
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        raise click.UsageError(f"bench-net needs root and iproute2's ip and tc (missing: {missing or 'root'})")
    folder = os.path.join(os.path.dirname(out) or ".", "network-logs")
    os.makedirs(folder, exist_ok=True)
    res, port = {}, 29600
    chosen = [s for s in SYSTEMS if s in systems.split(",") or s == "pipelining"]
    if unknown := set(systems.split(",")) - set(SYSTEMS):
        raise click.UsageError(f"--systems: unknown {sorted(unknown)}; expected some of {', '.join(SYSTEMS)}")
    with Cluster() as cluster:
        for rate in rates.split(","):
            cluster.shape(rate)
            console.print(f"[bold]{rate}[/]: {', '.join(chosen)}, {rounds} launches each, taking turns")
            runs = {s: [] for s in chosen}
            for _ in range(rounds):
                for system in chosen:
                    port += 1
                    runs[system].append(cluster.launch(system, port, folder))
            res[rate] = {s: _summary(s, r) for s, r in runs.items()}
            console.print(_table(rate, res[rate]))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    console.print(f"wrote {out} (node logs in {folder})")


def _summary(system: str, runs: list[dict]) -> dict:
    if system == "pipelining":  # its best schedule in each launch (GPipe or 1F1B), with that schedule's bytes
        best = [min(range(len(r["step_s"])), key=lambda k: list(r["step_s"].values())[k]) for r in runs]
        steps = [list(r["step_s"].values())[k] for r, k in zip(runs, best)]
        names = [list(r["step_s"])[k] for r, k in zip(runs, best)]
        nbytes = [r["bytes"][k] for r, k in zip(runs, best)]
    else:
        steps, names, nbytes = [r["step_s"] for r in runs], [None] * len(runs), [r["bytes"][0] for r in runs]
    traces = [r["trace"] for r in runs if r.get("trace")]
    return {"step_s": statistics.median(steps), "per_launch": steps, "schedule": names,
            "bytes_per_step": [statistics.median(b[i] for b in nbytes) for i in range(len(nbytes[0]))],
            "bubble": statistics.median(t["bubble"] for t in traces) if traces else None,
            "overlap": statistics.median(t["overlap"] for t in traces if t["overlap"] is not None) if traces else None}


def _table(rate: str, got: dict) -> Table:
    table = Table(title=f"split Unet over 3 nodes, links {rate} (median step; bytes each node sent per step)")
    for col in ("system", "step", "samples/s", "vs pipelining", "MiB sent per step: node0 / node1 / node2",
                "bubble / transfers overlapped (--trace)", "per launch"):
        table.add_column(col, justify="left" if col == "system" else "right")
    peer = got["pipelining"]["step_s"]
    for system, r in got.items():
        label = system + (f" ({r['schedule'][0]})" if r["schedule"][0] else "")
        table.add_row(label, f"{r['step_s'] * 1e3:.0f} ms", f"{SAMPLES / r['step_s']:.1f}", f"{r['step_s'] / peer:.2f}",
                      " / ".join(f"{b / 2**20:.1f}" for b in r["bytes_per_step"]),
                      "-" if r.get("bubble") is None else f"{r['bubble']:.2f} / {r['overlap']:.0%}",
                      ", ".join(f"{s * 1e3:.0f}" for s in r["per_launch"]))
    return table


@main.command("node", hidden=True)
@click.option("--system", required=True)
@click.option("--rank", type=int, required=True)
@click.option("--addr", required=True)
@click.option("--port", type=int, required=True)
@click.option("--out", required=True)
@click.option("--namespaces", required=True)
def node(system, rank, addr, port, out, namespaces):
    """One process of one launch, inside its node's namespace."""
    _node(system, rank, addr, port, out, namespaces.split(","))


if __name__ == "__main__":
    main()
