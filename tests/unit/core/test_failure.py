"""A stage's failure keeps its type across the wire, by class, not by message."""
import pickle

from rpcmp.errors import PartitionError, StageError, StageOutputError
from rpcmp.core.failure import Failure


def _failure_of(exc):
    try:
        raise exc
    except Exception as caught:  # noqa: BLE001
        return pickle.loads(pickle.dumps(Failure.of(f"building stage 1 failed: {caught}", caught)))  # as RPC carries it


def test_an_rpcmp_error_on_an_owner_is_raised_on_the_master_as_its_own_type():
    error = _failure_of(PartitionError("the model's construction is not deterministic")).error()
    assert type(error) is PartitionError and "building stage 1 failed" in str(error)
    assert "PartitionError: the model's construction is not deterministic" in error.details
    assert "Traceback" in error.full_traceback
    assert type(_failure_of(StageOutputError("stage 0 returned a str")).error()) is StageOutputError


def test_any_other_exception_arrives_as_a_stage_error_whatever_its_message_says():
    error = _failure_of(ValueError("PartitionError: stage 3 looks like an rpcmp error")).error()
    assert type(error) is StageError and "ValueError" in error.details
