"""``Job(wire="bf16")`` between real processes over TensorPipe: activations (and, on a traced
model, the skip values a stage posts straight to a later one) cross in half the bytes, their
gradients come back, and training stays within bf16's rounding of the float32 run."""
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
    for wire in ("fp32", "bf16"):
        pipe = rpcmp.Pipeline(dataclasses.replace(job, wire=wire), world_size)
        losses = [pipe.train_step(x, y).item() for x, y in data]
        out[wire] = (losses, pipe.state_dict(), pipe.stats())
        pipe.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("job,world", [("mlp", 3), ("traced_unet", 4)], ids=["mlp", "traced-unet-posts"])
def test_a_bf16_wire_halves_what_crosses_and_trains_within_bf16_rounding(job, world):
    got = run_ranks(job, world, _both, timeout=240)
    (wide_losses, wide_state, wide), (losses, state, narrow) = got["fp32"], got["bf16"]
    for k in range(len(wide) - 1):  # the last stage sends float32 to the master's loss
        assert narrow[k]["mib_out"] == pytest.approx(wide[k]["mib_out"] / 2, rel=1e-3), k
    assert losses != wide_losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(wide_losses), rtol=3e-2, atol=3e-2)
    for key, value in state.items():
        if value.is_floating_point():
            torch.testing.assert_close(value, wide_state[key], rtol=3e-2, atol=3e-2, msg=key)
