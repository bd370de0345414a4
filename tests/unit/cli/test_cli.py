import os

import pytest

from click.testing import CliRunner

from helpers import JOBS
from rpcmp.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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
    assert [r.split("│")[6].strip() for r in rows] == ["1.5 MiB", "1.0 MiB", "64.0 KiB"], out
    assert "Conv2d x36, BatchNorm2d x36" in rows[0]  # what each stage computes (resnet34: 36 convolutions)


@pytest.mark.model
def test_plan_lists_the_operations_of_each_traced_stage():
    """SplitAt stages are pieces of the traced graph: the plan lists their ops, functional ones included
    (ResNet's residual adds and the flatten before fc)."""
    result = CliRunner().invoke(main, ["plan", os.path.join(JOBS, "traced_resnet.py")], terminal_width=250)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "worker" in line]
    assert len(rows) == 3 and "add" in rows[0] and "conv2d x" in rows[0]
    assert "flatten x1" in result.output


def test_plan_reports_a_bad_placement_clearly():
    result = CliRunner().invoke(main, ["plan", UNET, "--world-size", "2"])
    assert result.exit_code == 2
    assert "3 stages > 2 processes" in result.output


def test_worker_refuses_a_preload_that_is_not_installed_before_starting():
    result = CliRunner().invoke(main, ["worker", "--master", "127.0.0.1:1", "--rank", "1", "--preload", "torch,smp"])
    assert result.exit_code == 2 and "no module named smp" in result.output and "segmentation_models_pytorch" in result.output, \
        result.output


def test_run_rejects_a_single_process():
    result = CliRunner().invoke(main, ["run", UNET, "--local", "1"])
    assert result.exit_code != 0 and "at least 2 processes" in result.output


def test_plan_prints_the_schedules_plan():
    result = CliRunner().invoke(main, ["plan", UNET, "--schedule", "1f1b", "-m", "4"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "schedule '1f1b': one step of 4 micro-batches over 3 stages" in result.output
    text = " ".join(result.output.split())  # the caption wraps
    assert "when 0's gradients are merged" in text and "at most 3 micro-batches hold activations" in text


def test_the_command_line_modules_import_no_torch():
    """The command's own modules import no torch, so that `rpcmp --help` and a mistyped option answer
    at once; each command imports what it needs when it runs (`run --local` then forks its ranks from
    itself, see [Note: forked from a warm server])."""
    import subprocess
    import sys
    code = "import sys, rpcmp.cli.commands; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("groups,said", [
    ('[{"params": [p for p in m.parameters() if p.dim() >= 2]}, '
     '{"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]',
     "optimizer: SGD over 2 parameter groups: 4 tensors, 2,816 values; 6 tensors, 168 values (weight_decay=0.0)"),
    ('[{"params": [m[0].weight]}]', "9 parameters are in no group (0.bias, 1.weight, 1.bias, 3.weight, 3.bias, ...)"),
], ids=["groups", "a-parameter-in-none"])
def test_plan_prints_the_parameter_groups_or_what_is_wrong_with_them(tmp_path, groups, said):
    job = tmp_path / "grouped.py"
    job.write_text(open(os.path.join(JOBS, "mlp.py")).read() +
                   f"\nimport dataclasses\njob = dataclasses.replace(job, param_groups=lambda m: {groups})\n")
    result = CliRunner().invoke(main, ["plan", str(job)], terminal_width=250)
    assert said in " ".join(result.output.split()), result.output
    assert result.exit_code == (0 if "optimizer" in said else 2), result.output
