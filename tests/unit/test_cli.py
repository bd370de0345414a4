import os

from click.testing import CliRunner

from rpcmp.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
UNET = os.path.join(ROOT, "examples", "unet_split", "job.py")


def test_plan_prints_the_partition_without_processes():
    result = CliRunner().invoke(main, ["plan", UNET, "--world-size", "3"])
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("encoder", "decoder", "segmentation_head", "worker1/cpu", "worker2/cpu", "master/cpu",
                 "MiB", "24,43"):  # resnet34 Unet: 24.43 M parameters
        assert text in out, text
    # what crosses each cut for one micro-batch (4 of the example's images), from shapes on the meta device:
    # the encoder's 6 feature maps, the decoder's 16 channels, the 1-channel mask
    rows = [line for line in out.splitlines() if "worker" in line or "master/cpu" in line]
    assert [r.split("│")[5].strip() for r in rows] == ["1.5 MiB", "1.0 MiB", "0.1 MiB"], out


def test_plan_reports_a_bad_placement_clearly():
    result = CliRunner().invoke(main, ["plan", UNET, "--world-size", "2"])
    assert result.exit_code == 2
    assert "3 stages > 2 processes" in result.output


def test_run_rejects_a_single_process():
    result = CliRunner().invoke(main, ["run", UNET, "--local", "1"])
    assert result.exit_code != 0 and "at least 2 processes" in result.output
