"""No process holds the whole model: owners build, load and save their parts only."""
import functools
import os
import re

import pytest
import torch
import torch.distributed.rpc as rpc
from click.testing import CliRunner

from helpers import assert_close_f32, load, run_ranks
from rpcmp.core.checkpoint import CheckpointError, load_checkpoint
from rpcmp.cli import main
from rpcmp.train.trainer import fit

pytestmark = pytest.mark.integration

# Evaluated on each process over RPC: the parameters alive there that hold memory (not meta ones).
# gc.collect() first: get_objects() also lists unreachable objects not collected yet.
LIVE = ("__import__('gc').collect() * 0 + sum(p.numel() for p in __import__('gc').get_objects() "
        "if isinstance(p, __import__('torch').nn.Parameter) and p.device.type != 'meta')")


def _live_then_train(job, world_size, folder):
    """A Pipeline's live parameters on each process, then a 2-step run writing a checkpoint to ``folder``, in
    the same processes (their traces are reused: one traced-Unet world for the tests below)."""
    import dataclasses
    import rpcmp
    pipe = rpcmp.Pipeline(job, world_size)
    owners = [p.process for p in pipe.places]
    live = {name: rpc.rpc_sync(name, eval, args=(LIVE,)) for name in ["master", *owners]}
    stages = [sum(r.to_here().numel() for r in s.remote_parameters()) for s in pipe.stages]  # after: copies
    state = pipe.state_dict()
    pipe.close()
    steps = fit(dataclasses.replace(job, checkpoint_dir=folder, max_steps=2), world_size)["steps"]
    return live, owners, stages, state, steps


@pytest.fixture(scope="module")
def unet_run(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("owner_parts") / "ckpt")
    return folder, run_ranks("traced_unet", 4, functools.partial(_live_then_train, folder=folder), timeout=300)


@pytest.mark.timeout(300)
def test_each_owner_holds_only_its_stage_and_the_master_nothing(unet_run):
    """The Unet cut inside its encoder: each owner's live parameters are exactly its stage's, the
    master (which planned and traced the model) holds none, and the values are the unsplit model's."""
    live, owners, stages, state, _ = unet_run[1]
    assert live["master"] == 0
    assert [live[o] for o in owners] == stages and all(stages)
    job = load("traced_unet")
    torch.manual_seed(job.seed)
    assert_close_f32(state, job.model().state_dict(), rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_a_checkpoint_is_an_index_and_parts_read_as_one_and_exported_as_a_plain_file(unet_run, tmp_path):
    folder, (*_, steps) = unet_run
    assert steps == 2
    ckpt = load_checkpoint(folder)
    index = torch.load(ckpt["path"], weights_only=True)
    assert "model" not in index and "state" not in index["optimizer"]  # the master wrote no tensor
    assert [p["file"] for p in index["parts"]] == sorted(f for f in os.listdir(folder) if ".stage-" in f)
    assert [p["owner"] for p in index["parts"]] == ["worker1/cpu", "worker2/cpu", "worker3/cpu"]

    out = str(tmp_path / "unet.pt")
    result = CliRunner().invoke(main, ["export", folder, out])
    assert result.exit_code == 0 and "wrote" in result.output, result.output
    plain = load("traced_unet").model()
    plain.load_state_dict(torch.load(out, weights_only=True), strict=True)
    assert_close_f32(plain.state_dict(), ckpt["model"], rtol=0, atol=0)

    os.remove(os.path.join(folder, index["parts"][1]["file"]))  # a part left on another node
    with pytest.raises(CheckpointError, match=r"stage 1\) was written by worker2/cpu .* Copy the parts into one folder"):
        load_checkpoint(folder)


def _initial(job, world_size, good, short):
    """The state a Pipeline starts from with ``Job(init_from=good)``, and the error ``short`` (a key missing)
    raises, in one world."""
    import dataclasses
    import rpcmp
    pipe = rpcmp.Pipeline(dataclasses.replace(job, init_from=good), world_size)
    state = pipe.state_dict()
    pipe.close()
    try:
        rpcmp.Pipeline(dataclasses.replace(job, init_from=short), world_size).close()
    except Exception as exc:  # noqa: BLE001 - what the user would see is what the test reads
        return state, f"{type(exc).__name__}: {exc}"
    return state, None


@pytest.mark.timeout(300)
def test_init_from_gives_each_owner_its_keys_of_a_plain_state_dict(tmp_path):
    job = load("traced_resnet")
    torch.manual_seed(123)  # another seed than the job's: other values than its own initialization
    values = job.model().state_dict()
    good, short = str(tmp_path / "init.pt"), str(tmp_path / "short.pt")
    torch.save(values, good)
    torch.save({k: v for k, v in values.items() if k != "fc.weight"}, short)
    state, error = run_ranks("traced_resnet", 4, functools.partial(_initial, good=good, short=short))
    assert_close_f32(state, values, rtol=0, atol=0)
    assert error and re.search(r"CheckpointError: Job\(init_from=...\): .* 1 missing keys \['fc.weight'\]", error), error


@pytest.mark.timeout(300)
def test_init_from_a_file_holding_a_tied_weight_once_gives_every_name_its_value(tmp_path):
    """Hugging Face's save_pretrained leaves the tied lm_head.weight out of model.safetensors (it is the embedding's,
    on another stage here): starting from such a file was refused ("1 missing keys ['m.lm_head.weight']"). A key
    that no name of its tensor has is still refused."""
    job = load("hf_gpt2")
    torch.manual_seed(123)
    values = job.model().state_dict()
    good, short = str(tmp_path / "init.pt"), str(tmp_path / "short.pt")
    torch.save({k: v for k, v in values.items() if k != "m.lm_head.weight"}, good)
    torch.save({k: v for k, v in values.items() if k not in ("m.lm_head.weight", "m.transformer.ln_f.bias")}, short)
    state, error = run_ranks("hf_gpt2", 4, functools.partial(_initial, good=good, short=short))
    assert_close_f32(state, values, rtol=0, atol=0)
    assert error and re.search(r"1 missing keys \['m.transformer.ln_f.bias'\]", error), error
