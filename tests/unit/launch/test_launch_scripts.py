"""The launch recipes: syntax, and the exact torchrun command the SLURM script builds."""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SLURM = os.path.join(ROOT, "launch", "slurm.sbatch")
ENV = {"SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "nodea,nodeb,nodec", "SLURM_GPUS_PER_NODE": "a100:2",
       "SLURM_JOB_ID": "77"}


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(os.path.join(ROOT, "launch"))
                                          if f.endswith((".sh", ".sbatch"))))
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", os.path.join(ROOT, "launch", script)], check=True)


def test_slurm_builds_the_torchrun_command(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    # srun runs the node command once, here; PYTHON=echo prints what torchrun would get
    (fake / "srun").write_text('#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    (fake / "srun").chmod(0o755)
    env = {**os.environ, **ENV, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHON": "echo"}
    out = subprocess.run(["bash", SLURM, "examples/unet_split/job.py", "--max-steps", "5"], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    assert out == ["-m", "torch.distributed.run", "--nnodes=3", "--nproc-per-node=2", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=nodea:29400", "--rdzv-id=77", "--local-addr", ip,
                   "-m", "rpcmp.master", "examples/unet_split/job.py", "--max-steps", "5"]


def test_slurm_takes_the_node_address_from_the_interface_rpcmp_is_told_to_use(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    # a node whose first address (hostname -I) is on another network than the interface named
    (fake / "hostname").write_text('#!/usr/bin/env bash\necho 192.0.2.50 10.9.8.7\n')
    (fake / "ip").write_text('#!/usr/bin/env bash\n[[ "$*" == "-4 -o addr show dev ib0" ]] || exit 1\n'
                             'echo "3: ib0    inet 10.9.8.7/16 brd 10.9.255.255 scope global ib0"\n')
    for tool in ("srun", "hostname", "ip"):
        (fake / tool).chmod(0o755)
    env = {**os.environ, **ENV, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHON": "echo"}
    out = subprocess.run(["bash", SLURM, "job.py"], env={**env, "RPCMP_IFACE": "ib0"}, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[out.index("--local-addr") + 1] == "10.9.8.7"
    out = subprocess.run(["bash", SLURM, "job.py"], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out[out.index("--local-addr") + 1] == "192.0.2.50"
    bad = subprocess.run(["bash", SLURM, "job.py"], env={**env, "RPCMP_IFACE": "eth7"}, capture_output=True, text=True)
    assert bad.returncode == 2 and "no IPv4 address on interface eth7" in bad.stderr


def test_slurm_outside_an_allocation_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", SLURM, "job.py"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "not inside a SLURM allocation" in proc.stderr


def test_slurm_doctor_runs_the_preflight_on_every_node(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    (fake / "srun").chmod(0o755)
    env = {**os.environ, **ENV, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHON": "echo", "DOCTOR": "1"}
    out = subprocess.run(["bash", SLURM, "job.py"], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["-m", "rpcmp.cli", "doctor", "--nodes", "3", "--master", "nodea:29400"]


def test_the_worker_unit_lets_stages_write_checkpoints_and_read_the_token():
    unit = open(os.path.join(ROOT, "workers", "rpcmp-worker.service")).read()
    settings = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert settings["ProtectSystem"] == "strict" and settings["User"] == "rpcmp"
    assert "/var/lib/rpcmp" in settings["ReadWritePaths"].split() and settings["StateDirectory"] == "rpcmp"
    readme = open(os.path.join(ROOT, "workers", "README.md")).read()
    for text in (unit, readme):  # the token: root-owned, readable by the daemon's group
        assert "chown root:rpcmp /etc/rpcmp/token && chmod 640 /etc/rpcmp/token" in text
    assert "chmod 600" not in readme and "allow any TCP port" in readme
