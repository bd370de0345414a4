import os
import subprocess

import pytest
import torch

from rpcmp.core.checkpoint import (CheckpointError, CheckpointWriteError, check_model_keys, latest_checkpoint, load_checkpoint,
                              save_checkpoint, save_stage_file)


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
    with pytest.raises(CheckpointWriteError, match=r"with 0.0 MiB left on that disk: OSError: .*No space left.*previous checkpoint "
                       r".*step-00000001.pt is intact. Free space"):
        save_checkpoint(tiny_disk, {"model": {"w": torch.ones(1_000_000)}, "step": 2}, 2)
    assert os.listdir(tiny_disk) == ["step-00000001.pt"]
    assert load_checkpoint(tiny_disk)["step"] == 1


def test_a_run_prunes_only_its_own_checkpoints_and_the_latest_is_the_last_written(tmp_path):
    d = str(tmp_path)
    for step in (20, 40):
        save_checkpoint(d, {"model": {}, "step": step}, step, keep_last=2, run="aaaa")
        save_stage_file(d, 0, {"model": {}, "step": step}, step, keep_last=2, run="aaaa")
    for step in (5, 10, 15):
        save_checkpoint(d, {"model": {}, "step": step}, step, keep_last=2, run="bbbb")
        save_stage_file(d, 0, {"model": {}, "step": step}, step, keep_last=2, run="bbbb")
        assert latest_checkpoint(d).endswith(f"step-{step:08d}.bbbb.pt")  # not run aaaa's step 40
    assert sorted(os.listdir(d)) == [
        "step-00000010.bbbb.pt", "step-00000010.bbbb.stage-0.pt", "step-00000015.bbbb.pt", "step-00000015.bbbb.stage-0.pt",
        "step-00000020.aaaa.pt", "step-00000020.aaaa.stage-0.pt", "step-00000040.aaaa.pt", "step-00000040.aaaa.stage-0.pt"]
    assert load_checkpoint(d)["run"] == "bbbb"


def test_a_planted_checkpoint_cannot_run_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/owned",))
    torch.save({"format": "rpcmp-checkpoint/1", "model": {}, "x": Payload()}, tmp_path / "step-00000099.pt")
    with pytest.raises(CheckpointError, match="refuses to load"):
        load_checkpoint(str(tmp_path))
    assert not os.path.exists(tmp_path / "owned")


def test_the_directory_is_flushed_after_the_rename_and_before_pruning(tmp_path, monkeypatch):
    events = []
    real_fsync, real_remove, real_replace = os.fsync, os.remove, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}"))), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", b)), real_replace(a, b)))
    monkeypatch.setattr(os, "remove", lambda p: (events.append(("remove", p)), real_remove(p)))
    save_checkpoint(str(tmp_path), {"model": {}}, 1, keep_last=1, run="ab")
    events.clear()
    save_checkpoint(str(tmp_path), {"model": {}}, 2, keep_last=1, run="ab")
    kinds = [e[0] if e[0] != "fsync" else ("fsync dir" if e[1] else "fsync file") for e in events]
    assert kinds == ["fsync file", "replace", "fsync dir", "remove"], events


def test_only_a_failed_write_is_reported_as_one(tmp_path):
    with pytest.raises(AttributeError, match="pickle"):  # an unpicklable value is reported as what it is
        save_checkpoint(str(tmp_path), {"model": {}, "bad": lambda: None}, 1)
    assert os.listdir(tmp_path) == []  # and leaves no partial file


def test_a_failed_write_is_a_run_failure_exit_1_not_an_input_mistake_exit_2():
    from rpcmp.cli.options import exit_code
    assert exit_code(CheckpointWriteError("disk full")) == 1
    assert exit_code(CheckpointError("another model")) == 2
