"""Job.nonfinite, once for both modes."""
import pytest
import torch

from rpcmp.errors import NonFiniteLossError
from rpcmp.policy import NonFinite


def test_stop_raises_before_the_update_and_says_what_to_do():
    policy = NonFinite("stop", " (DDP mode)")
    assert policy.allows(torch.tensor(0.5))
    with pytest.raises(NonFiniteLossError, match=r"the loss is nan \(DDP mode\): training stopped before the optimizer step"):
        policy.allows(torch.tensor(float("nan")))


def test_skip_warns_and_counts_every_skipped_step():
    policy = NonFinite("skip")
    for n in (1, 2):
        with pytest.warns(RuntimeWarning, match=rf"loss is inf: this step's update was skipped .* {n} skipped so far"):
            assert not policy.allows(torch.tensor([1.0, float("inf")]))
    assert policy.skipped == 2 and policy.allows(torch.tensor([1.0, 2.0]))
