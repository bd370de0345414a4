from collections import namedtuple

import pytest
import torch

from rpcmp.errors import MicroBatchError, StageOutputError
from rpcmp.core.microbatch import batch_size, check_tensors, compact, gather, scatter


def test_tensor_round_trip_uneven():
    x = torch.arange(10).view(5, 2)
    parts = scatter(x, 3)
    assert [p.shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(gather(parts), x)


def test_nested_list_dict_tuple_round_trip():
    Pair = namedtuple("Pair", "a b")
    batch = {"feats": [torch.randn(6, 3), torch.randn(6, 2, 2)], "pair": Pair(torch.ones(6), 7), "tag": "x"}
    parts = scatter(batch, 4)
    assert len(parts) == 4 and parts[3]["tag"] == "x" and parts[0]["pair"].b == 7
    assert isinstance(parts[0]["pair"], Pair) and isinstance(parts[0]["feats"], list)
    merged = gather(parts)
    torch.testing.assert_close(merged["feats"][1], batch["feats"][1])
    torch.testing.assert_close(merged["pair"].a, batch["pair"].a)


def test_batch_smaller_than_microbatches_says_how_to_fix():
    with pytest.raises(MicroBatchError, match=r"batch of 3 samples cannot be split into 4 micro-batches.*microbatches <= 3"):
        scatter(torch.zeros(3, 1), 4)


def test_mismatched_dim0_and_no_tensor():
    with pytest.raises(MicroBatchError, match=r"share dim 0, got sizes \[2, 3\]"):
        batch_size([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(MicroBatchError, match="at least one tensor"):
        batch_size({"a": 1})
    with pytest.raises(MicroBatchError, match="microbatches >= 1"):
        scatter(torch.zeros(2), 0)


def test_check_tensors_names_the_bad_leaf():
    check_tensors([torch.zeros(1), {"a": torch.zeros(1)}], "out")
    with pytest.raises(StageOutputError, match=r"out\[1\]\['a'\] is a float"):
        check_tensors([torch.zeros(1), {"a": 1.0}], "out")


def test_a_stage_output_with_none_is_refused_where_it_is():
    """A stage that forgot to ``return`` (None), or returned None inside a structure, is named."""
    import pytest
    from rpcmp.errors import StageOutputError
    from rpcmp.core.microbatch import check_tensors
    with pytest.raises(StageOutputError, match=r"the output of stage 1 is a NoneType"):
        check_tensors(None, "the output of stage 1")
    with pytest.raises(StageOutputError, match=r"the output of stage 1\[1\]\['mask'\] is a NoneType"):
        check_tensors((torch.ones(1), {"mask": None}), "the output of stage 1")
    check_tensors((torch.ones(1), {"mask": torch.ones(1)}), "the output of stage 1")


def test_a_micro_batch_goes_to_the_wire_in_storage_of_its_own_and_a_whole_tensor_as_it_is():
    x = torch.randn(5, 4096, requires_grad=True)  # an odd batch in two: the first part is 3/5 of the storage
    first, second = (compact(p) for p in scatter({"x": x, "ids": torch.arange(5)}, 2))
    for part, rows in ((first, 3), (second, 2)):
        assert part["x"].untyped_storage().nbytes() == rows * 4096 * 4 and part["ids"].untyped_storage().nbytes() == rows * 8
    torch.testing.assert_close(torch.cat([first["x"], second["x"]]), x, rtol=0, atol=0)
    first["x"].sum().backward()  # still the batch's: its gradient reaches x
    assert x.grad[:3].eq(1).all() and x.grad[3:].eq(0).all()
    whole = {"x": torch.randn(4, 3)}
    assert compact(whole)["x"] is whole["x"]
