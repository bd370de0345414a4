import os
import subprocess

import pytest
import torch

from rpcmp.checkpoint import CheckpointError, check_model_keys, latest_checkpoint, load_checkpoint, save_checkpoint


def test_keep_last_and_latest(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), {"model": {"w": torch.ones(1) * step}, "step": step}, step, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000002.pt", "step-00000003.pt"]
    assert latest_checkpoint(str(tmp_path)).endswith("step-00000003.pt")
    assert load_checkpoint(str(tmp_path))["model"]["w"].item() == 3


def test_truncated_checkpoint_says_so(tmp_path):
    path = save_checkpoint(str(tmp_path), {"model": {"w": torch.ones(1000)}}, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="is truncated or not a checkpoint.*delete it"):
        load_checkpoint(path)
    torch.save({"w": 1}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="not an rpcmp checkpoint"):
        load_checkpoint(str(tmp_path / "plain.pt"))
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(str(tmp_path / "empty")) if os.makedirs(tmp_path / "empty") is None else None


def test_checkpoint_from_another_model_lists_the_difference():
    ckpt = {"model": {"a.weight": torch.ones(1), "b.weight": torch.ones(1)}, "path": "x.pt"}
    with pytest.raises(CheckpointError, match=r"another model.*1 missing keys \['c.weight'\].*1 unexpected keys \['b.weight'\]"):
        check_model_keys(ckpt, {"a.weight": torch.ones(1), "c.weight": torch.ones(1)})
    with pytest.raises(CheckpointError, match="other shapes"):
        check_model_keys(ckpt, {"a.weight": torch.ones(2), "b.weight": torch.ones(1)})


@pytest.fixture
def tiny_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a 1 MiB tmpfs here (needs root): the full-disk case is not exercised")
    yield str(mnt)
    subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_during_save_keeps_the_previous_checkpoint(tiny_disk):
    save_checkpoint(tiny_disk, {"model": {"w": torch.ones(10)}, "step": 1}, 1)
    with pytest.raises(CheckpointError, match=r"with 0.0 MiB left on that disk.*previous checkpoint .*step-00000001.pt is intact"):
        save_checkpoint(tiny_disk, {"model": {"w": torch.ones(1_000_000)}, "step": 2}, 2)
    assert os.listdir(tiny_disk) == ["step-00000001.pt"]
    assert load_checkpoint(tiny_disk)["step"] == 1
