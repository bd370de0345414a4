"""Checkpoints: round trip under another split, consolidated into the plain model, atomic."""
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import segmentation_models_pytorch as smp
import torch

import rpcmp
from helpers import assert_close_f32, descendant, job_path, load, metric_steps, run_command, run_ranks
from rpcmp.core.checkpoint import load_checkpoint
from rpcmp.train.engine import PipelineEngine
from rpcmp.train.trainer import _save, fit

pytestmark = pytest.mark.integration
ADAM = (torch.optim.Adam, {"lr": 0.01})


def _fit(job, world_size):
    return fit(job, world_size)["steps"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("first,second", [([3, 4], [2, 3, 2]), ([2, 3, 2], [4, 3])])
def test_train_2n_equals_n_save_restore_n_under_another_split(tmp_path, first, second):
    common = {"optimizer": ADAM, "max_steps": 10, "epochs": 2}  # 32 batches/epoch: crosses no epoch end
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert run_ranks("mlp", 3, _fit, {**common, "stages": rpcmp.Split(first), "checkpoint_dir": straight,
                                       "checkpoint_every": 1}) == 10
    assert run_ranks("mlp", 3, _fit, {**common, "stages": rpcmp.Split(first), "checkpoint_dir": split,
                                       "max_steps": 5}) == 5
    assert run_ranks("mlp", 3, _fit, {**common, "stages": rpcmp.Split(second), "checkpoint_dir": split,
                                       "resume": True}) == 10
    a, b = load_checkpoint(straight), load_checkpoint(split)
    assert a["step"] == b["step"] == 10
    run = a["run"]
    assert sorted(p for p in os.listdir(straight) if ".stage-" in p) == \
        [f"step-{s:08d}.{run}.stage-{i}.pt" for s in (9, 10) for i in range(len(first))]  # keep_last=2 per stage
    assert b["run"] == load_checkpoint(split + f"/step-00000005.{b['run']}.pt")["run"]  # resume continues the run
    assert_close_f32(b["model"], a["model"])
    assert_close_f32(b["optimizer"]["state"], a["optimizer"]["state"])
    # and the consolidated state is the plain model's
    job = load("mlp")
    job.model().load_state_dict(b["model"], strict=True)


@pytest.mark.timeout(300)
def test_resume_restores_every_process_rng_so_dropout_resumes_exactly(tmp_path):
    common = {"max_steps": 8, "epochs": 2}
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert run_ranks("dropout", 3, _fit, {**common, "checkpoint_dir": straight}) == 8
    assert run_ranks("dropout", 3, _fit, {**common, "checkpoint_dir": split, "max_steps": 4}) == 4
    assert run_ranks("dropout", 3, _fit, {**common, "checkpoint_dir": split, "resume": True}) == 8
    a, b = load_checkpoint(straight), load_checkpoint(split)
    assert set(a["rng"]["processes"]) == {"master", "worker1", "worker2"}
    assert_close_f32(b["model"], a["model"])


def _fit_and_say(job, world_size):
    import io
    from rich.console import Console
    out = io.StringIO()
    steps = fit(job, world_size, console=Console(file=out, width=300))["steps"]
    return steps, out.getvalue()


@pytest.mark.timeout(300)
def test_a_second_run_in_the_same_folder_keeps_both_runs_and_resume_continues_the_last(tmp_path):
    folder = str(tmp_path)
    assert run_ranks("mlp", 3, _fit, {"checkpoint_dir": folder, "max_steps": 40, "checkpoint_every": 20, "epochs": 2})
    first = load_checkpoint(folder)
    steps, said = run_ranks("mlp", 3, _fit_and_say, {"checkpoint_dir": folder, "max_steps": 10, "checkpoint_every": 5})
    assert steps == 10 and (f"holds another run's checkpoints (the latest: step-00000040.{first['run']}.pt): this run "
                            f"starts from step 0 as a new run") in " ".join(said.split())  # a forgotten --resume?
    second = load_checkpoint(folder)  # the folder's latest is the run written last, not the higher step
    assert second["run"] != first["run"] and second["step"] == 10
    a, b = first["run"], second["run"]
    assert sorted(os.listdir(folder)) == sorted(
        [f"step-{s:08d}.{a}.pt" for s in (20, 40)] + [f"step-{s:08d}.{a}.stage-{i}.pt" for s in (20, 40) for i in (0, 1)]
        + [f"step-{s:08d}.{b}.pt" for s in (5, 10)] + [f"step-{s:08d}.{b}.stage-{i}.pt" for s in (5, 10) for i in (0, 1)])
    steps, said = run_ranks("mlp", 3, _fit_and_say, {"checkpoint_dir": folder, "max_steps": 15, "resume": True})
    assert steps == 15 and f"resumed run {b} at step 10" in said
    assert load_checkpoint(folder)["run"] == b
    assert os.path.exists(f"{folder}/step-00000040.{a}.pt")  # the other run's checkpoints are untouched


def _fit_or_say(job, world_size):
    try:
        return fit(job, world_size)["steps"]
    except rpcmp.CheckpointError as exc:
        return str(exc)


@pytest.mark.timeout(300)
def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    assert run_ranks("mlp", 3, _fit, {"checkpoint_dir": str(tmp_path), "max_steps": 2})
    said = run_ranks("dropout", 3, _fit_or_say, {"checkpoint_dir": str(tmp_path), "max_steps": 4, "resume": True})
    assert "is from another model than this job's model" in said and "4 unexpected keys ['1.bias'" in said


def _train_and_save(job, world_size):
    pipe = rpcmp.Pipeline(job, world_size)
    x, y = next(iter(torch.utils.data.DataLoader(job.data()[0], batch_size=4)))
    pipe.train_step(x, y)
    pipe.eval()
    _save(job, PipelineEngine(pipe, job), "ab12", 1, 0, 1)
    return x, pipe.predict(x)


@pytest.mark.timeout(300)
def test_split_unet_checkpoint_loads_into_plain_unet(tmp_path):
    x, split_out = run_ranks("unet", 3, _train_and_save, {"checkpoint_dir": str(tmp_path)})
    ckpt = load_checkpoint(str(tmp_path))
    plain = smp.Unet("resnet18", encoder_weights=None, in_channels=1, classes=1)
    plain.load_state_dict(ckpt["model"], strict=True)
    plain.eval()
    with torch.no_grad():
        assert_close_f32(plain(x), split_out)
    # and each owner wrote its own stage's file, which loads into that part of the plain model
    for index, name in enumerate(["encoder", "decoder", "segmentation_head"]):
        stage = torch.load(tmp_path / f"step-00000001.ab12.stage-{index}.pt", weights_only=True)
        assert (stage["format"], stage["stage"], stage["step"], stage["owner"]) == \
            ("rpcmp-stage/1", index, 1, ["worker1/cpu", "worker2/cpu", "master/cpu"][index])
        part = getattr(smp.Unet("resnet18", encoder_weights=None, in_channels=1, classes=1), name)
        part.load_state_dict(stage["model"], strict=True)
        assert_close_f32(stage["model"], {k[len(name) + 1:]: v for k, v in ckpt["model"].items()
                                                    if k.startswith(name + ".")})
        params = {name + "." + n for n, _ in part.named_parameters()}
        assert set(stage["optimizer"]) <= params and set(stage["optimizer"]) == params & set(ckpt["optimizer"]["state"])


WRITER = """
import sys, torch
from rpcmp.core.checkpoint import save_checkpoint
size = int(sys.argv[2])
save_checkpoint(sys.argv[1], {"model": {"w": torch.full((size,), float(size))}, "step": size}, size)
"""


@pytest.mark.timeout(120)
def test_killing_the_writer_mid_save_keeps_the_previous_checkpoint(tmp_path):
    subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), "1"], check=True, timeout=60)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(400_000_000)])
    tmp = tmp_path / f"step-{400_000_000:08d}.pt.tmp"
    deadline = time.monotonic() + 60
    while not (tmp.exists() and tmp.stat().st_size > 1_000_000):
        assert time.monotonic() < deadline and proc.poll() is None, "the writer never started writing"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt["step"] == 1 and ckpt["model"]["w"].item() == 1.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig,to", [(signal.SIGINT, "group"), (signal.SIGTERM, "group"), (signal.SIGTERM, "worker2")],
                         ids=["SIGINT-everyone", "SIGTERM-everyone", "SIGTERM-worker2"])
def test_ctrl_c_stops_between_steps_saves_and_resume_trains_the_uninterrupted_model(tmp_path, sig, to):
    """Ctrl-C reaches every process of `--local 3` (one process group): the master finishes the step in
    flight, writes a checkpoint and exits 130, the owners wait for its word; --resume then trains the model
    of a run never stopped. So does SIGTERM to every process (docker stop, a pod's end, a preemption), where the
    owners used to die of it and the run fail with nothing saved, and SIGTERM to one owner, which the master takes
    as its own (exit 143)."""
    rpcmp_cli = os.path.join(os.path.dirname(sys.executable), "rpcmp")
    common = [rpcmp_cli, "run", job_path("mlp"), "--local", "3", "--threads", "1", "--epochs", "10", "--max-steps", "160"]
    # as from a terminal: a test runner's worker may ignore SIGINT, and a process started so keeps ignoring it
    stopped = subprocess.Popen([*common, "--checkpoint-dir", str(tmp_path / "a"), "--metrics", str(tmp_path / "m.jsonl")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    at = random.randint(5, 60)
    deadline = time.monotonic() + 120
    while metric_steps(tmp_path / "m.jsonl") < at:
        assert stopped.poll() is None and time.monotonic() < deadline, stopped.communicate()[0]
        time.sleep(0.02)
    if to == "group":
        os.killpg(stopped.pid, sig)
    else:
        os.kill(descendant(stopped.pid, "rpcmp-" + to), sig)
    out, _ = stopped.communicate(timeout=120)
    assert stopped.returncode == 128 + sig, out
    assert to == "group" or f"{sig.name} to {to}: stopping after the step in flight" in out, out
    step = int(re.search(rf"stopped by {sig.name} after step (\d+): checkpoint in", out).group(1))
    assert load_checkpoint(str(tmp_path / "a"))["step"] == step >= at and step < 160
    assert not subprocess.run(["pgrep", "-f", str(tmp_path / "a")], capture_output=True).stdout
    resumed = run_command(*common[1:], "--checkpoint-dir", str(tmp_path / "a"), "--resume", timeout=120)
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stdout, resumed.stdout + resumed.stderr
    # the run never stopped, started by rpcmp's launcher (the command line is not what is compared)
    run_ranks("mlp", 3, _fit, {"threads": 1, "epochs": 10, "max_steps": 160, "checkpoint_dir": str(tmp_path / "b")},
              timeout=120)
    assert_close_f32(load_checkpoint(str(tmp_path / "a"))["model"], load_checkpoint(str(tmp_path / "b"))["model"])
