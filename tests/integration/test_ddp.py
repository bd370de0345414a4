"""DDP mode from the same job file: parity with one process, global metrics, and one
checkpoint format shared with pipeline mode (real processes, gloo)."""
import re

import pytest
import torch
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

from helpers import assert_close_f32, load, no_decay, run_ranks, torch_groups
from rpcmp.core.checkpoint import load_checkpoint
from rpcmp.train.trainer import fit

pytestmark = pytest.mark.integration
SGD = (torch.optim.SGD, {"lr": 0.1})


def _fit(job, world_size):
    return fit(job, world_size)


def _reference(steps, per_rank, accumulate, world=2, name="mlp", optimizer=SGD, groups=None):
    """One process, batch world x per_rank x accumulate, the samples DDP's ranks read."""
    job = load(name)
    train, heldout = job.data()
    per_rank_batches = [list(BatchSampler(_sampler(train, world, r), per_rank, drop_last=True)) for r in range(world)]
    torch.manual_seed(job.seed)
    model = job.model()
    opt = optimizer[0](torch_groups(model, groups) if groups else model.parameters(), **optimizer[1])
    losses = []
    for s in range(steps):
        idx = [i for r in range(world) for b in per_rank_batches[r][s * accumulate:(s + 1) * accumulate] for i in b]
        x, y = train[idx]
        opt.zero_grad()
        loss = job.loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    x, y = heldout[:]
    return model.state_dict(), losses, job.metric(model(x), y)


def _sampler(train, world, rank):
    s = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    s.set_epoch(0)
    return s


@pytest.mark.timeout(240)
@pytest.mark.parametrize("accumulate,groups", [(1, None), (2, no_decay)], ids=["one-group", "accumulate-groups"])
def test_ddp_two_ranks_equals_one_process_with_twice_the_batch(tmp_path, accumulate, groups):
    optimizer = SGD if groups is None else (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.05})
    result = run_ranks("mlp", 2, _fit, {"mode": "ddp", "batch_size": 8, "accumulate": accumulate, "max_steps": 3,
                                         "optimizer": optimizer, "param_groups": groups, "checkpoint_dir": str(tmp_path)})
    ref_state, ref_losses, ref_metric = _reference(3, 4, accumulate, optimizer=optimizer, groups=groups)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt["mode"] == "ddp" and ckpt["step"] == 3
    assert_close_f32(ckpt["model"], ref_state)
    # what rank 0 reports is the global value: the loss and metric over every rank's samples
    assert_close_f32(result["losses"], ref_losses)
    assert_close_f32(result["metric_after"], float(ref_metric))


@pytest.mark.timeout(240)
def test_ddp_trains_a_model_whose_loss_leaves_parameters_without_a_gradient_as_one_process(tmp_path):
    """DDP failed the second step ("Expected to have finished reduction in the prior iteration", advice to pass
    find_unused_parameters=True, which rpcmp builds). Weight decay tells a missing gradient from a zero one: the
    layers before the detached stage must not move, as in one process."""
    wd = (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1})
    result = run_ranks("frozen", 2, _fit, {"mode": "ddp", "batch_size": 8, "max_steps": 3, "optimizer": wd,
                                           "checkpoint_dir": str(tmp_path)})
    ref_state, ref_losses, _ = _reference(3, 4, 1, name="frozen", optimizer=wd)
    ckpt = load_checkpoint(str(tmp_path))
    assert_close_f32(ckpt["model"], ref_state)
    assert_close_f32(result["losses"], ref_losses)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("first,then", [("ddp", "pipeline"), ("pipeline", "ddp")])
def test_checkpoint_resumes_in_the_other_mode(tmp_path, first, then):
    common = {"optimizer": (torch.optim.Adam, {"lr": 0.01}), "checkpoint_dir": str(tmp_path), "epochs": 4}
    fresh = run_ranks("mlp", 3 if first == "pipeline" else 2, _fit, {**common, "mode": first, "max_steps": 30})
    resumed = run_ranks("mlp", 3 if then == "pipeline" else 2, _fit,
                        {**common, "mode": then, "max_steps": 60, "resume": True})
    assert resumed["steps"] == 60 and len(resumed["losses"]) == 30
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt["mode"] == then and ckpt["step"] == 60
    first_loss, last_loss = fresh["losses"][0], sum(fresh["losses"][-5:]) / 5
    resumed_loss = sum(resumed["losses"][:5]) / 5
    assert last_loss < 0.8 * first_loss  # the first run learned
    assert resumed_loss < 0.8 * first_loss and resumed_loss == pytest.approx(last_loss, rel=0.25)


@pytest.mark.timeout(240)
def test_ddp_from_the_command_line(tmp_path):
    import os
    from helpers import job_path, run_command
    # a job of 3 stages on 2 ranks: DDP holds the whole model on every rank, no stage is placed
    proc = run_command("run", job_path("three"), "--local", "2", "--mode", "ddp", "--max-steps", "20", "--precision",
                       "bf16", timeout=200, env={**os.environ, "COLUMNS": "160"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DDP on 2 ranks (gloo), 8 samples per rank, accumulate 1, bf16" in proc.stdout
    assert re.search(r"steps 20\s+loss", proc.stdout)


@pytest.mark.timeout(300)
def test_ddp_resume_restores_every_rank_rng_so_dropout_resumes_exactly(tmp_path):
    common = {"mode": "ddp", "max_steps": 8, "epochs": 2}
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run_ranks("dropout", 2, _fit, {**common, "checkpoint_dir": straight})
    run_ranks("dropout", 2, _fit, {**common, "checkpoint_dir": split, "max_steps": 4})
    run_ranks("dropout", 2, _fit, {**common, "checkpoint_dir": split, "resume": True})
    a, b = load_checkpoint(straight), load_checkpoint(split)
    assert a["step"] == b["step"] == 8 and set(a["rng"]["processes"]) == {"rank0", "rank1"}
    assert_close_f32(b["model"], a["model"])


def _torchrun_ddp(job, *args, env=None):
    import os
    import subprocess
    import sys
    from helpers import job_path
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
                           "--nproc-per-node=2", "-m", "rpcmp.master", job_path(job), "--mode", "ddp", "--epochs", "4",
                           *args], capture_output=True, text=True, timeout=150, env={**os.environ, **(env or {})})


@pytest.mark.timeout(400)
def test_ddp_resume_with_node_local_folders_continues_every_rank_from_rank_0s_checkpoint(tmp_path):
    base = str(tmp_path / "local")
    for steps, resume in (("3", []), ("6", ["--resume"])):  # rank 1's own folder stays empty
        proc = _torchrun_ddp("node_local", "--max-steps", steps, *resume, env={"CKPT_BASE": base})
        assert proc.returncode == 0, proc.stdout + proc.stderr
    # the run never stopped: the same two DDP ranks, started by rpcmp (its launcher is not what is tested here)
    run_ranks("mlp", 2, _fit, {"mode": "ddp", "epochs": 4, "max_steps": 6, "checkpoint_dir": str(tmp_path / "straight")})
    a, b = load_checkpoint(str(tmp_path / "straight")), load_checkpoint(base + "/node0")
    assert a["step"] == b["step"] == 6
    assert_close_f32(b["model"], a["model"])


@pytest.mark.timeout(300)
def test_a_checkpoint_write_longer_than_the_collective_timeout_does_not_fail_the_other_ranks(tmp_path):
    result = run_ranks("slow_save", 2, _fit, {"mode": "ddp", "max_steps": 4, "checkpoint_every": 2,
                                              "checkpoint_dir": str(tmp_path), "epochs": 4}, timeout=200)
    assert result["steps"] == 4 and load_checkpoint(str(tmp_path))["step"] == 4
