"""``Job(wire="bf16" | "int8")`` between real processes over TensorPipe: activations (and, on a
traced model, the skip values a stage posts straight to a later one) cross in half (about a quarter
of) the bytes, their gradients come back, and training stays within the format's rounding of the
float32 run."""
import dataclasses

import pytest
import torch

import rpcmp
from helpers import run_ranks

pytestmark = pytest.mark.integration


def _both(job, world_size):
    train, _ = job.data()
    data = [train[i * job.batch_size:(i + 1) * job.batch_size] for i in range(3)]
    out = {}
    for wire in ("fp32", "bf16", "int8"):
        pipe = rpcmp.Pipeline(dataclasses.replace(job, wire=wire), world_size)
        losses = [pipe.train_step(x, y).item() for x, y in data]
        out[wire] = (losses, pipe.state_dict(), pipe.stats())
        pipe.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("job,world", [("mlp", 3), ("traced_unet", 4)], ids=["mlp", "traced-unet-posts"])
def test_a_narrow_wire_cuts_what_crosses_and_trains_within_its_rounding(job, world):
    got = run_ranks(job, world, _both, timeout=240)
    wide_losses, wide_state, wide = got["fp32"]
    # int8: a quarter, + a scale per row of at least 64 values (<= 1/64 of float32's bytes), + the shapes
    for wire, part in (("bf16", (0.5, 0.5 * (1 + 1e-3))), ("int8", (0.25, 0.31))):
        losses, state, narrow = got[wire]
        for k in range(len(wide) - 1):  # the last stage sends float32 to the master's loss
            ratio = narrow[k]["mib_out"] / wide[k]["mib_out"]
            assert part[0] * (1 - 1e-3) <= ratio <= part[1], (wire, k, ratio)
        assert losses != wide_losses
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(wide_losses), rtol=3e-2, atol=3e-2, msg=wire)
        for key, value in state.items():
            if value.is_floating_point():
                torch.testing.assert_close(value, wide_state[key], rtol=3e-2, atol=3e-2, msg=f"{wire} {key}")
