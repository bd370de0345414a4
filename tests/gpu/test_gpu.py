"""The CUDA paths, proven where a GPU is: CUDA stages in separate processes (with and without
TensorPipe device maps), a language model cut on its traced graph on CUDA stages, Adam state of
CUDA stages through a checkpoint and resume, CUDA stages moved while training and a lost CUDA
owner rebuilt on a spare (with and without device maps), narrow wires, bf16 autocast and
recomputation on CUDA stages, DDP with NCCL and fp16 loss scaling, and replicas of CUDA stages.
Skipped without CUDA; ``make gpu-check`` runs them and prints a report (tests/gpu/check.py)."""
import dataclasses
import functools
import os
import random
import signal
import threading
import time

import pytest
import torch

import rpcmp
from helpers import assert_close_f32, batches, load, metric_steps, run_ranks, train_reference
from rpcmp.core.checkpoint import load_checkpoint

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
ON_GPU = {"placement": ["worker1/cuda:0", "worker2/cuda:0"]}
GPU_F32 = {"rtol": 1e-4, "atol": 1e-5}  # CUDA kernels sum in other orders than the CPU reference's


def _steps(job, world_size):
    pipe_losses = []
    from rpcmp.train.engine import make_engine
    engine = make_engine(job, world_size)
    for x, y in batches(3, size=8):
        pipe_losses.append(engine.pipe.train_step(x, y).item())
    return pipe_losses, engine.pipe.state_dict()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("device_maps", [False, True])
def test_cuda_stages_in_separate_processes_train_as_the_unsplit_model(device_maps):
    job = load("mlp")
    losses, state = run_ranks("mlp", 3, _steps, {**ON_GPU, "device_maps": device_maps, "microbatches": 2})
    torch.manual_seed(job.seed)
    ref_losses, ref_state = train_reference(job.model(), job.optimizer, job.loss, batches(3, size=8))
    assert all(v.device.type == "cpu" for v in state.values())  # the consolidated state comes back on the CPU
    assert_close_f32(losses, ref_losses, **GPU_F32)
    assert_close_f32(state, ref_state, **GPU_F32)


def _lm_batches(job):
    train, _ = job.data()
    return [train[i * 8:(i + 1) * 8] for i in range(3)]


def _lm_steps(job, world_size):
    from rpcmp.train.engine import make_engine
    engine = make_engine(job, world_size)
    losses = [engine.pipe.train_step(x, y).item() for x, y in _lm_batches(job)]
    return losses, engine.pipe.state_dict()


@pytest.mark.timeout(300)
def test_a_language_model_cut_on_its_traced_graph_trains_on_cuda_stages_as_the_unsplit_model():
    """The nanoGPT decoder (positions made in forward on the input's device, its head tied to the
    embedding across stages), traced as on the CPU with no memory and run on CUDA stages."""
    job = load("nanogpt")
    adamw = (torch.optim.AdamW, {"lr": 1e-3, "eps": 1e-6})  # eps: see tests/integration/test_language_models.py
    place = {"placement": [f"worker{i}/cuda:0" for i in (1, 2, 3)], "microbatches": 2, "batch_size": 8,
             "optimizer": adamw}
    losses, state = run_ranks("nanogpt", 4, _lm_steps, place)
    torch.manual_seed(job.seed)
    ref_losses, ref_state = train_reference(job.model(), adamw, job.loss, _lm_batches(job))
    assert_close_f32(losses, ref_losses, **GPU_F32)
    assert_close_f32(state, ref_state, **GPU_F32)


def _moved_steps(job, world_size):
    """Six steps; before step 2 stage 1 moves to worker3, before step 4 stage 0 moves to worker2: with device
    maps, the hops worker3 -> worker2 and back have none (the maps were set for worker1 <-> worker2)."""
    from rpcmp.train.engine import make_engine
    pipe = make_engine(job, world_size).pipe
    losses = []
    for step, (x, y) in enumerate(batches(6, size=8)):
        if step == 2:
            pipe.move_stage(1, "worker3/cuda:0")
        if step == 4:
            pipe.move_stage(0, "worker2/cuda:0")
        losses.append(pipe.train_step(x, y).item())
    return losses, pipe.state_dict(), list(pipe.owners)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("device_maps", [False, True])
def test_cuda_stages_moved_while_training_train_as_the_unsplit_model(device_maps):
    job = load("mlp")
    losses, state, owners = run_ranks("mlp", 4, _moved_steps, {**ON_GPU, "device_maps": device_maps, "microbatches": 2})
    torch.manual_seed(job.seed)
    ref_losses, ref_state = train_reference(job.model(), job.optimizer, job.loss, batches(6, size=8))
    assert owners == ["worker2", "worker3"]
    assert_close_f32(losses, ref_losses, **GPU_F32)
    assert_close_f32(state, ref_state, **GPU_F32)


def _fit_losing(job, world_size, at=None):
    """``fit``; with ``at``, worker2 (stage 1) is SIGKILLed once the metrics show step ``at``."""
    import torch.distributed.rpc as rpc
    from rpcmp.train.trainer import fit
    killed = threading.Event()
    if at is not None:
        pid = rpc.rpc_sync("worker2", os.getpid)

        def kill():
            while metric_steps(job.metrics_file) < at:
                time.sleep(0.002)
            os.kill(pid, signal.SIGKILL)
            killed.set()
        threading.Thread(target=kill, daemon=True).start()
    return fit(job, world_size)["steps"], killed.is_set()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device_maps", [False, True])
def test_a_lost_cuda_owner_is_rebuilt_on_the_spare_and_the_model_equals_an_uninterrupted_run(tmp_path, device_maps):
    """tests/jobs/three.py (dropout in stage 1: the CUDA generators come back with the snapshot) on three CUDA
    stages and a spare; the owner of stage 1 SIGKILLed after the step-10 snapshot."""
    common = {"placement": [f"worker{i}/cuda:0" for i in (1, 2, 3)], "spares": 1, "max_steps": 30, "epochs": 1,
              "device_maps": device_maps}
    runs = {}
    for name, at in (("clean", None), ("lost", random.randint(11, 15))):
        folder = str(tmp_path / name)
        steps, killed = run_ranks("three", 5, functools.partial(_fit_losing, at=at), timeout=240,
                                  overrides={**common, "checkpoint_dir": folder, "metrics_file": folder + ".jsonl"})
        assert steps == 30 and killed == (at is not None)
        runs[name] = load_checkpoint(folder)
    assert runs["lost"]["step"] == runs["clean"]["step"] == 30
    assert_close_f32(runs["lost"]["model"], runs["clean"]["model"], **GPU_F32)


def _variants(job, world_size, variants):
    out = {}
    for name, options in variants.items():
        pipe = rpcmp.Pipeline(dataclasses.replace(job, **options), world_size)
        out[name] = ([pipe.train_step(x, y).item() for x, y in batches(3, size=8)], pipe.state_dict())
        pipe.close()
    return out


@pytest.mark.timeout(240)
def test_narrow_wires_and_autocast_on_cuda_stages_train_within_their_rounding():
    """``wire="bf16"`` and ``"int8"`` (per-row scales computed on the device) and ``precision="bf16"``."""
    narrow = {"wire-bf16": {"wire": "bf16"}, "wire-int8": {"wire": "int8"}, "autocast-bf16": {"precision": "bf16"}}
    got = run_ranks("mlp", 3, functools.partial(_variants, variants={"fp32": {}, **narrow}),
                    {**ON_GPU, "microbatches": 2})
    wide_losses, wide_state = got["fp32"]
    for name in narrow:
        losses, state = got[name]
        assert losses != wide_losses, name  # the format was used
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(wide_losses), rtol=3e-2, atol=3e-2, msg=name)
        for key, value in state.items():
            torch.testing.assert_close(value, wide_state[key], rtol=3e-2, atol=3e-2, msg=f"{name} {key}")


@pytest.mark.timeout(240)
def test_recomputation_on_cuda_stages_redraws_the_same_dropout_and_trains_as_without():
    """tests/jobs/three.py (dropout in stage 1): the backward's recomputation restores the CUDA generator."""
    cuda = {"placement": [f"worker{i}/cuda:0" for i in (1, 2, 3)]}
    got = run_ranks("three", 4, functools.partial(_variants, variants={"plain": {}, "recompute": {"recompute": True}}),
                    cuda)
    assert_close_f32(got["recompute"], got["plain"], **GPU_F32)


def _fit(job, world_size):
    from rpcmp.train.trainer import fit
    return fit(job, world_size)


@pytest.mark.timeout(300)
def test_adam_state_of_cuda_stages_survives_a_checkpoint_and_resume(tmp_path):
    common = {**ON_GPU, "optimizer": (torch.optim.Adam, {"lr": 0.01}), "checkpoint_every": 2, "epochs": 1}
    run_ranks("mlp", 3, _fit, {**common, "max_steps": 6, "checkpoint_dir": str(tmp_path / "whole")})
    run_ranks("mlp", 3, _fit, {**common, "max_steps": 3, "checkpoint_dir": str(tmp_path / "cut")})
    run_ranks("mlp", 3, _fit, {**common, "max_steps": 6, "resume": True, "checkpoint_dir": str(tmp_path / "cut")})
    whole, resumed = load_checkpoint(str(tmp_path / "whole")), load_checkpoint(str(tmp_path / "cut"))
    assert resumed["step"] == 6 and set(resumed["optimizer"]["state"]) == set(whole["optimizer"]["state"])
    assert_close_f32(resumed["model"], whole["model"], **GPU_F32)


@pytest.mark.timeout(240)
def test_ddp_with_nccl_and_fp16_loss_scaling_trains(tmp_path):
    out = run_ranks("mlp", 1, _fit, {"mode": "ddp", "precision": "fp16", "max_steps": 20, "epochs": 1,
                                     "checkpoint_dir": str(tmp_path)})
    ckpt = load_checkpoint(str(tmp_path))
    assert out["losses"][-1] < out["losses"][0] and ckpt["loss_scale"] and ckpt["mode"] == "ddp"


@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL needs one GPU per copy of a stage: fewer than 2 GPUs")
def test_replicas_of_cuda_stages_train_as_one_pipeline():
    grid = {"replicas": 2, "microbatches": 2,
            "placement": ["worker1/cuda:0", "worker3/cuda:0", "worker2/cuda:1", "worker4/cuda:1"]}
    hybrid = run_ranks("mlp", 5, _steps, grid)
    single = run_ranks("mlp", 3, _steps, {**ON_GPU, "microbatches": 2})
    assert_close_f32(hybrid, single, **GPU_F32)
