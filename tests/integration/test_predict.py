"""`rpcmp predict`: a checkpoint trained split, predicted by the unsplit model and through
the stages; the same outputs, PNG panels of input | truth | prediction."""
import os
import re
import subprocess
import sys

import pytest
import torch
from PIL import Image

from helpers import assert_close_f32, fit_steps, job_path, run_command, run_ranks

pytestmark = pytest.mark.integration
RPCMP = os.path.join(os.path.dirname(sys.executable), "rpcmp")


def _run(*args):
    proc = subprocess.run([RPCMP, *args], capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(300)
def test_predict_unsplit_and_split_agree_and_write_panels(tmp_path):
    ckpt = tmp_path / "ckpt"
    # trained by rpcmp's launcher (`rpcmp run` is tested elsewhere): 2 steps, a checkpoint
    assert run_ranks("unet", 3, fit_steps, {"max_steps": 2, "checkpoint_dir": str(ckpt)}) == 2
    out = _run("predict", job_path("unet"), "-c", str(ckpt), "--out", str(tmp_path / "a"), "--images", "3")
    assert "8 samples" in out and re.search(r"step-00000002\.[0-9a-f]+\.pt", out)
    # through the stages: the same console function, started from the suite's fork server (helpers.Command)
    split = run_command("predict", job_path("unet"), "-c", str(ckpt), "--out", str(tmp_path / "b"), "--images", "3",
                        "--local", "3", env={**os.environ, "COLUMNS": "200"})
    assert split.returncode == 0, split.stdout + split.stderr
    split = split.stdout
    assert re.search(r"building the stages \.\.\.\nstages built in \d+\.\d s\n", split), split  # said while they build
    assert "building the stages" not in out  # the unsplit model: no stages
    a, b = torch.load(tmp_path / "a" / "predictions.pt"), torch.load(tmp_path / "b" / "predictions.pt")
    assert a.shape == (8, 1, 64, 64)
    assert_close_f32(a, b)
    pngs = sorted(p for p in os.listdir(tmp_path / "a") if p.endswith(".png"))
    assert pngs == ["sample-0000.png", "sample-0001.png", "sample-0002.png"]
    image = Image.open(tmp_path / "a" / pngs[0])
    assert image.size == (3 * 128 + 2 * 2 * 2, 128) and image.mode == "RGB"  # 3 panels of 64 px, scaled x2


@pytest.mark.timeout(60)
def test_predict_with_another_models_checkpoint_says_so(tmp_path):
    torch.save({"format": "rpcmp-checkpoint/1", "model": {"w": torch.zeros(1)}}, tmp_path / "step-00000001.pt")
    proc = subprocess.run([RPCMP, "predict", job_path("mlp"), "-c", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "from another model" in proc.stderr
