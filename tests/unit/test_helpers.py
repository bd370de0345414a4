"""The suite's own comparison: float32 results at float32 tolerances on any CPU."""
import pytest
import torch

from helpers import assert_close_f32


def test_python_floats_from_float32_results_compare_at_float32_tolerance():
    # two float32 sums one ulp apart (seen between two x86 machines), read with .item()
    a, b = torch.tensor(1.2786788940429688), torch.tensor(1.2786786556243896)
    assert (a - b).abs().item() <= torch.finfo(torch.float32).eps * 2
    with pytest.raises(AssertionError):  # what the suite used to do
        torch.testing.assert_close([a.item()], [b.item()])
    assert_close_f32([a.item()], [b.item()])
    assert_close_f32({"loss": a.item(), "state": {"w": a}}, {"loss": b.item(), "state": {"w": b}})


def test_float32_tolerance_still_catches_real_differences():
    with pytest.raises(AssertionError):
        assert_close_f32([1.0, 2.0], [1.0, 2.001])
    with pytest.raises(AssertionError):
        assert_close_f32(torch.tensor(1.0), torch.tensor(1.0 + 1e-6), rtol=0, atol=0)
