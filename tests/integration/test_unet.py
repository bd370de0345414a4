"""The split segmentation_models_pytorch Unet (encoder / decoder / head on 3 processes)
trains through rpcmp exactly like the unsplit Unet when BatchNorm uses running
statistics (eval mode): BatchNorm over micro-batches is the one layer that mixes samples."""
import pytest
import torch

import rpcmp
from helpers import assert_close_f32, load, run_ranks, train_reference

pytestmark = pytest.mark.integration


def _data():
    g = torch.Generator().manual_seed(3)
    return [(torch.rand(4, 1, 64, 64, generator=g), (torch.rand(4, 1, 64, 64, generator=g) > 0.5).float())
            for _ in range(2)]


def _train(job, world_size):
    pipe = rpcmp.Pipeline(job, world_size)
    pipe.eval()  # running statistics: no sample mixing, so micro-batching is exact
    losses = [pipe.train_step(x, y).item() for x, y in _data()]
    return losses, pipe.state_dict(), [str(p) for p in pipe.places]


@pytest.mark.timeout(300)
def test_split_unet_matches_unsplit_unet():
    losses, state, places = run_ranks("unet", 3, _train)
    assert places == ["worker1/cpu", "worker2/cpu", "master/cpu"]
    job = load("unet")
    torch.manual_seed(job.seed)
    model = job.model().eval()
    ref_losses, ref_state = train_reference(model, job.optimizer, job.loss, _data())
    assert_close_f32(losses, ref_losses)
    assert set(state) == set(ref_state)
    assert_close_f32(state, ref_state)
    assert losses[1] != losses[0]  # a real step happened
