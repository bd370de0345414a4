"""What an interrupted save leaves in a checkpoint folder, and the latest checkpoint of one run."""
import os

import torch

from rpcmp.core.checkpoint import (complete_stems, latest_checkpoint, remove_incomplete, save_checkpoint,
                                   save_stage_file)


def _touch(folder, name, size=10):
    with open(os.path.join(folder, name), "wb") as f:
        f.write(b"x" * size)


def test_parts_without_an_index_and_half_written_files_are_removed_the_rest_kept(tmp_path):
    d = str(tmp_path)
    save_stage_file(d, 0, {"model": {"w": torch.ones(2)}}, step=5, run="aaaaaaaaaaaa")
    save_checkpoint(d, {"parts": []}, step=5, run="aaaaaaaaaaaa")
    save_stage_file(d, 0, {"model": {"w": torch.ones(2)}}, step=10, run="aaaaaaaaaaaa")  # the master died here
    _touch(d, "step-00000010.aaaaaaaaaaaa.stage-1.pt.tmp", 7)  # an owner killed while writing
    _touch(d, "notes.txt")  # not rpcmp's: left alone
    removed = remove_incomplete(d, complete_stems(d))
    names = dict(removed)
    assert set(names) == {"step-00000010.aaaaaaaaaaaa.stage-0.pt", "step-00000010.aaaaaaaaaaaa.stage-1.pt.tmp"}
    assert names["step-00000010.aaaaaaaaaaaa.stage-1.pt.tmp"] == 7
    assert sorted(os.listdir(d)) == ["notes.txt", "step-00000005.aaaaaaaaaaaa.pt", "step-00000005.aaaaaaaaaaaa.stage-0.pt"]
    assert remove_incomplete(d, complete_stems(d)) == []  # a second call finds nothing


def test_an_owner_folder_without_the_index_keeps_the_parts_the_master_names(tmp_path):
    d = str(tmp_path)  # another node's folder: parts only; the master's folder holds the indexes
    save_stage_file(d, 1, {"model": {"w": torch.ones(2)}}, step=5, run="bbbbbbbbbbbb")
    assert remove_incomplete(d, {"step-00000005.bbbbbbbbbbbb"}) == []
    assert len(remove_incomplete(d, set())) == 1


def test_latest_checkpoint_of_one_run_ignores_a_newer_one_of_another_run(tmp_path):
    d = str(tmp_path)
    old = save_checkpoint(d, {}, step=3, run="aaaaaaaaaaaa")
    newer = save_checkpoint(d, {}, step=7, run="cccccccccccc")
    assert latest_checkpoint(d) == newer
    assert latest_checkpoint(d, "aaaaaaaaaaaa") == old
    assert latest_checkpoint(d, "dddddddddddd") is None
