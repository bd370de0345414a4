"""Training policy apart from the mechanism: Job.nonfinite (both modes), loss scaling and clipping."""
import pytest
import torch

from rpcmp.errors import NonFiniteLossError
from rpcmp.core.policy import GradientPolicy, NonFinite


def test_stop_raises_before_the_update_and_says_what_to_do():
    policy = NonFinite("stop", " (DDP mode)")
    assert policy.allows(torch.tensor(0.5))
    policy.updated = True  # a step has changed the parameters: the learning rate may be the cause
    with pytest.raises(NonFiniteLossError, match=r"Lower the learning rate"):
        policy.allows(torch.tensor(float("nan")))
    with pytest.raises(NonFiniteLossError, match=r"the loss is nan \(DDP mode\): training stopped before the optimizer step"):
        policy.allows(torch.tensor(float("nan")))


def test_a_first_step_that_is_not_finite_does_not_blame_the_learning_rate():
    policy = NonFinite("stop")
    with pytest.raises(NonFiniteLossError, match=r"before any update in this run.*learning rate is not the cause.*"
                                                 r"rpcmp plan JOB --check") as info:
        policy.allows(torch.tensor(float("nan")))
    assert "Lower the learning rate" not in str(info.value)


def test_skip_warns_and_counts_every_skipped_step():
    policy = NonFinite("skip")
    for n in (1, 2):
        with pytest.warns(RuntimeWarning, match=rf"loss is inf: this step's update was skipped .* {n} skipped so far"):
            assert not policy.allows(torch.tensor([1.0, float("inf")]))
    assert policy.skipped == 2 and policy.allows(torch.tensor([1.0, 2.0]))


def _grads(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=g) * 4, torch.randn(7, generator=g)]


def test_clipping_scales_as_clip_grad_norm_on_the_unsplit_model():
    for max_norm in (0.5, 1e6):
        grads = _grads(0)
        params = [torch.zeros_like(g, requires_grad=True) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        policy = GradientPolicy(fp16=False, max_norm=max_norm)
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads)).item()  # what the owners' squares add up to
        coef = policy.coefficient(norm)
        torch.testing.assert_close(torch.tensor(policy.last_norm, dtype=torch.float32), expected_norm)
        for p, g in zip(params, grads):
            torch.testing.assert_close(g * coef, p.grad)


def test_loss_scale_skips_an_overflow_halves_and_grows_back_after_good_steps():
    policy = GradientPolicy(fp16=True, max_norm=None, growth=3, scale=8.0)
    assert policy.scaled(torch.tensor(2.0)).item() == 16.0
    assert policy.coefficient(float("inf")) is None and policy.scale == 4.0 and policy.overflow_steps == 1
    assert policy.coefficient(8.0) == 0.25 and policy.last_norm == 2.0  # unscaled: the norm of the true gradients
    policy.coefficient(8.0)
    assert policy.scale == 4.0
    policy.coefficient(8.0)  # the third good step since the overflow
    assert policy.scale == 8.0
    floor = GradientPolicy(fp16=True, max_norm=None, scale=1.0)
    assert floor.coefficient(float("nan")) is None and floor.scale == 1.0  # never below 1


def test_without_fp16_or_clipping_no_norm_is_asked_for():
    policy = GradientPolicy(fp16=False, max_norm=None)
    assert not policy.needs_norm and policy.scale is None
    loss = torch.tensor(3.0)
    assert policy.scaled(loss) is loss
