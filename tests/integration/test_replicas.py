"""Pipeline x data parallel (Job(replicas=R)): R copies of the pipeline train as one pipeline on the
global batch and as DDP on as many ranks; a checkpoint is written once and resumes under another R
(real processes, real RPC, gloo process groups per stage)."""
import dataclasses
import os
import shutil

import pytest
import torch

from helpers import assert_close_f32, batches, no_decay, run_ranks
from rpcmp.core.checkpoint import load_checkpoint
from rpcmp.train.trainer import fit

pytestmark = pytest.mark.integration
OPTIMIZERS = {"sgd-momentum": {"optimizer": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})},
              # parameter groups: every copy's optimizers, and DDP's, keep weight decay off biases and norms
              "adam": {"optimizer": (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}), "param_groups": no_decay}}


def _pipeline_steps(job, world_size):
    """3 steps of 8 samples with each optimizer; the losses and parameters after them."""
    from rpcmp.train.engine import make_engine
    out = {}
    for name, optimizer in OPTIMIZERS.items():
        engine = make_engine(dataclasses.replace(job, **optimizer), world_size)
        losses = [engine.pipe.train_step(x, y).item() for x, y in batches(3, size=8)]
        out[name] = (losses, engine.pipe.state_dict())
        out[f"{name} early"] = [st["reduced_early"] for st in engine.pipe.stats()]
        if job.replicas > 1 and name == "adam":
            try:
                engine.pipe.train_step(torch.randn(7, 16), torch.randn(7, 8))
            except Exception as exc:  # noqa: BLE001 - what the test checks
                out["uneven"] = f"{type(exc).__name__}: {exc}"
        engine.pipe.close()
    return out


def _ddp_steps(job, world_size):
    """The same batches in DDP mode: rank r reads samples r, r + 2, ... of each."""
    import torch.distributed as dist
    from rpcmp.train.ddp import DDPEngine
    out, rank = {}, dist.get_rank()
    for name, optimizer in OPTIMIZERS.items():
        engine = DDPEngine(dataclasses.replace(job, **optimizer))
        losses = [engine.train_step([(x[rank::world_size], y[rank::world_size])])[0] for x, y in batches(3, size=8)]
        out[name] = (losses, {k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    return out


@pytest.mark.timeout(240)
def test_two_replicas_of_two_stages_train_as_one_pipeline_and_as_ddp_on_two_ranks():
    hybrid = run_ranks("mlp", 5, _pipeline_steps, {"replicas": 2, "microbatches": 2})
    single = run_ranks("mlp", 3, _pipeline_steps, {"microbatches": 2})
    ddp = run_ranks("mlp", 2, _ddp_steps, {"mode": "ddp"})
    assert hybrid.pop("uneven").startswith("JobError: a batch of 7 samples does not split evenly over 2 replicas")
    # every stage of every copy started its average from the backward, in each of the 3 steps
    # (see [Note: the average overlaps the backward])
    assert hybrid.pop("sgd-momentum early") == hybrid.pop("adam early") == [3, 3, 3, 3]
    for name in OPTIMIZERS:
        assert_close_f32(hybrid[name], single[name])  # losses (the mean over the copies) and parameters
        assert_close_f32(hybrid[name], ddp[name])
        assert list(hybrid[name][1]) == list(single[name][1])  # the unsplit model's names


def _copies_steps(job, world_size):
    """3 steps with Adam; each copy's state after them (one copy: the pipeline's)."""
    from rpcmp.train.engine import make_engine
    pipe = make_engine(dataclasses.replace(job, **OPTIMIZERS["adam"]), world_size).pipe
    losses = [pipe.train_step(x, y).item() for x, y in batches(3, size=8)]
    return losses, [p.state_dict() for p in getattr(pipe, "pipes", [pipe])]


def _ddp_adam(job, world_size):
    return _ddp_steps(job, world_size)["adam"]


@pytest.mark.timeout(240)
def test_a_buffer_the_forward_writes_is_copy_0_s_in_every_copy_as_ddp_takes_rank_0_s():
    """A running mean of the model's own (tests/jobs/ema.py) moves on each copy's share, as BatchNorm's statistics:
    every copy now takes copy 0's after each step, as DDP broadcasts rank 0's buffers, so the copies stay identical
    (a copy rebuilt from another after a loss is the copy it replaces); they drifted apart before."""
    (losses, (copy0, copy1)) = run_ranks("ema", 5, _copies_steps, {"replicas": 2})
    ddp_losses, ddp_state = run_ranks("ema", 2, _ddp_adam, {"mode": "ddp"})
    assert_close_f32(copy1, copy0)
    assert_close_f32(copy0, ddp_state)
    assert_close_f32(losses, ddp_losses)


def _signed_steps(job, world_size):
    """Steps on inputs of one sign (the gate's scale used by every copy), and, with replicas, one
    between them whose even samples (copy 0's) are positive and odd ones (copy 1's) negative."""
    from rpcmp.train.engine import make_engine
    pipe = make_engine(job, world_size).pipe
    (x1, y1), (x2, y2), (x3, y3) = batches(3)
    x1, x2, x3 = x1.abs(), x2.abs() * torch.tensor([1.0, -1.0]).repeat(4)[:, None], x3.abs()
    out = {"losses": [pipe.train_step(x1, y1).item()]}
    if job.replicas > 1:
        try:
            pipe.train_step(x2, y2)
        except Exception as exc:  # noqa: BLE001 - what the test checks
            out["mixed"] = f"{type(exc).__name__}: {exc}"
    out["losses"].append(pipe.train_step(x3, y3).item())
    out["state"] = pipe.state_dict()
    return out


@pytest.mark.timeout(180)
def test_copies_that_use_other_parameters_are_refused_alike_and_train_on():
    """A parameter no copy uses (the gate's bias) is left alone; one that only some copies used in a
    step (the gate's scale) fails that step in every copy, with its name, and nobody is left inside a
    collective: the next step trains, and the whole equals one pipeline trained without the mixed step."""
    hybrid = run_ranks("branchy", 5, _signed_steps, {"replicas": 2}, timeout=150)
    single = run_ranks("branchy", 3, _signed_steps, timeout=150)
    mixed = hybrid.pop("mixed")
    assert mixed.startswith("StageError: stage 0 (")
    assert "parameters ['0.scale'] got a gradient this step in some copies of the stage but not in all" in mixed
    assert_close_f32(hybrid, single)


def _fit(job, world_size):
    return fit(job, world_size)


@pytest.mark.timeout(360)
def test_a_checkpoint_is_written_once_and_resumes_under_another_replica_count_and_mode(tmp_path):
    common = {"max_steps": 4, "checkpoint_every": 2, "epochs": 1, "optimizer": OPTIMIZERS["adam"]["optimizer"]}
    whole = run_ranks("mlp", 3, _fit, {**common, "max_steps": 6, "checkpoint_dir": str(tmp_path / "one")})
    first = run_ranks("mlp", 5, _fit, {**common, "replicas": 2, "checkpoint_dir": str(tmp_path / "grid")})
    parts = sorted(f for f in os.listdir(tmp_path / "grid") if ".stage-" in f)
    assert len(parts) == 2 * 2 and all(".stage-0.pt" in f or ".stage-1.pt" in f for f in parts)  # S parts a step, not R x S
    shutil.copytree(tmp_path / "grid", tmp_path / "to-ddp")
    rest = run_ranks("mlp", 3, _fit, {**common, "max_steps": 6, "resume": True, "checkpoint_dir": str(tmp_path / "grid")})
    assert_close_f32(first["losses"] + rest["losses"], whole["losses"])
    # and in DDP mode on 2 ranks
    ddp = run_ranks("mlp", 2, _fit, {**common, "max_steps": 6, "resume": True, "mode": "ddp",
                                      "checkpoint_dir": str(tmp_path / "to-ddp")})
    assert_close_f32(first["losses"] + ddp["losses"], whole["losses"])
    assert_close_f32(load_checkpoint(str(tmp_path / "to-ddp"))["model"], load_checkpoint(str(tmp_path / "one"))["model"])
    assert_close_f32(load_checkpoint(str(tmp_path / "grid"))["model"], load_checkpoint(str(tmp_path / "one"))["model"])
    # the held-out metric is over every sample, whichever copy computed it
    assert_close_f32(first["metric_before"], whole["metric_before"])
    # prediction through the copies: each predicts a share, the outputs come back in the held-out order
    from helpers import load
    from rpcmp.train.predict import predict_local
    shared = run_ranks("mlp", 5, _predict, {"replicas": 2, "checkpoint_dir": str(tmp_path / "grid")})
    alone = predict_local(load("mlp"), str(tmp_path / "grid"), str(tmp_path / "alone"), 0)
    assert_close_f32(torch.load(os.path.join(shared["out_dir"], "predictions.pt")),
                     torch.load(os.path.join(tmp_path / "alone", "predictions.pt")))
    assert_close_f32(shared["metric"], alone["metric"])


@pytest.mark.timeout(240)
def test_the_copies_predict_a_model_whose_samples_meet_as_one_pipeline_does():
    """Each copy predicted its share, and a model whose output holds every sample against every other (in-batch
    negatives) came back as halves: (8, 4) logits in place of (8, 8), a held-out metric of another model. Copy 0 now
    predicts such a model's batches whole (see [Note: samples that meet in the model] in rpcmp/plan/writes.py)."""
    one = run_ranks("in_batch", 3, _fit, {"max_steps": 2})
    copies = run_ranks("in_batch", 5, _fit, {"max_steps": 2, "replicas": 2})
    assert_close_f32(copies["metric_before"], one["metric_before"])


def _predict(job, world_size):
    from rpcmp.train.predict import predict_split
    out_dir = os.path.join(job.checkpoint_dir, "shared")
    return {**predict_split(job, world_size, job.checkpoint_dir, out_dir, 0), "out_dir": out_dir}
