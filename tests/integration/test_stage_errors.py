"""Errors raised on a worker reach the master with the stage, the owner and the cause."""
import pytest
import torch

import rpcmp
from helpers import run_ranks

pytestmark = pytest.mark.integration


def _step(job, world_size):
    pipe = rpcmp.Pipeline(job, world_size)
    try:
        pipe.train_step(torch.randn(4, 4), None)
    except rpcmp.StageError as exc:
        return f"StageError: {exc}"
    return "no error"


@pytest.mark.timeout(120)
def test_stage_output_that_is_not_tensors():
    msg = run_ranks("bad_output", 4, _step)
    assert "StageError" in msg and "stage 1 (Scalar) on worker2/cpu" in msg
    assert "['score'] is a float" in msg and "return tensors only" in msg


@pytest.mark.timeout(120)
def test_model_factory_that_raises_reaches_the_master_with_its_traceback():
    with pytest.raises(RuntimeError) as info:
        run_ranks("factory_raises", 3, _step)
    text = str(info.value)
    assert "building stage 1 (broken_decoder) on worker2/cpu failed" in text
    assert "decoder factory exploded" in text and "Traceback" in text
