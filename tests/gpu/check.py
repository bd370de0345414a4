"""``make gpu-check``: the CUDA paths on this machine's GPU, one short report (under 5 minutes on
one GPU). Without CUDA it says so and exits 0: CI never depends on a GPU."""
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: helpers


def _steps_timed(job, world_size):
    from helpers import batches
    from rpcmp.train.engine import make_engine
    engine = make_engine(job, world_size)
    data = batches(23, size=64)
    for x, y in data[:3]:
        engine.pipe.train_step(x, y)  # warm-up: CUDA context, kernels, connections
    start = time.perf_counter()
    for x, y in data[3:]:
        engine.pipe.train_step(x, y)
    return (time.perf_counter() - start) / 20 * 1e3


def _one_process_ms() -> float:
    from helpers import batches, load
    job = load("mlp")
    model = job.model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(x.cuda(), y.cuda()) for x, y in batches(23, size=64)]
    for i, (x, y) in enumerate(data):
        if i == 3:
            torch.cuda.synchronize()
            start = time.perf_counter()
        opt.zero_grad()
        job.loss(model(x), y).backward()
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 20 * 1e3


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device: skipped")
        return 0
    from rich.console import Console
    from rich.table import Table
    console = Console()
    console.print(f"gpu-check: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    report = os.path.join(os.environ.get("TMPDIR", "/tmp"), "rpcmp-gpu-check.xml")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", HERE, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
                   cwd=os.path.dirname(os.path.dirname(HERE)))
    table = Table(title=f"CUDA paths ({time.perf_counter() - start:.0f}s)")
    for col in ("test", "result", "s"):
        table.add_column(col)
    failed = 0
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        failed += outcome in ("failure", "error")
        reason = next((c.get("message", "") for c in case if c.tag == "skipped"), "")
        table.add_row(case.get("name"), outcome + (f" ({reason[:60]})" if reason else ""), f"{float(case.get('time')):.1f}")
    console.print(table)
    from helpers import run_ranks
    gpu = {"placement": ["worker1/cuda:0", "worker2/cuda:0"], "microbatches": 4, "batch_size": 64}
    rows = [("one process, cuda:0", _one_process_ms())]
    for maps in (False, True):
        rows.append((f"rpcmp 2 CUDA stages, device_maps={maps}", run_ranks("mlp", 3, _steps_timed,
                                                                             {**gpu, "device_maps": maps})))
    timing = Table(title="MLP, batch 64, M=4: ms per step (mean of 20 after 3 warm-up steps)")
    timing.add_column("run")
    timing.add_column("ms / step", justify="right")
    for name, ms in rows:
        timing.add_row(name, f"{ms:.2f}")
    console.print(timing)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
