"""Each schedule's plan, without processes."""
import pytest

from rpcmp.plan.schedule import SCHEDULES, make_plan


def test_gpipe_is_one_loss_on_the_gathered_batch_and_merges_in_order_into_the_first():
    plan = make_plan("gpipe", 4, 3)
    assert (plan.loss, plan.merges) == ("gathered", ((1, 0), (2, 0), (3, 0)))
    assert plan.admit_after == (None,) * 4 and plan.in_flight == 4
    assert plan.rows()[1] == ("1", "at once", "when every output has arrived", "added into 0's, after 0's")


def test_overlap_admits_every_micro_batch_at_once_and_merges_in_order_into_the_first():
    plan = make_plan("overlap", 4, 2)
    assert plan.loss == "micro-batch"
    assert plan.admit_after == (None,) * 4 and plan.in_flight == 4
    assert plan.merges == ((1, 0), (2, 0), (3, 0))


@pytest.mark.parametrize("m,s,admit,in_flight", [
    (8, 3, (None, None, None, 0, 1, 2, 3, 4), 3),
    (2, 3, (None, None), 2),  # fewer micro-batches than stages: nothing waits
    (4, 1, (None, 0, 1, 2), 1),
])
def test_1f1b_admits_micro_batch_i_when_i_minus_s_is_merged(m, s, admit, in_flight):
    plan = make_plan("1f1b", m, s)
    assert plan.admit_after == admit and plan.in_flight == in_flight
    assert plan.merges == tuple((i, 0) for i in range(1, m))
    # a micro-batch never waits for itself or a later one: the plan cannot deadlock
    assert all(a is None or a < i for i, a in enumerate(plan.admit_after))


def test_every_plan_merges_each_micro_batch_once_and_prints_a_row_per_micro_batch():
    for name in SCHEDULES:
        for m in (1, 2, 5):
            plan = make_plan(name, m, 3)
            merged = [i for i, _ in plan.merges]
            assert merged == sorted(set(merged)) and 0 not in merged
            assert len(plan.rows()) == m
    assert make_plan("1f1b", 4, 2).rows()[2] == ("2", "when 0's gradients are merged", "as soon as its output arrives",
                                                "added into 0's, after 1's")


def test_a_bad_plan_request_says_what_is_allowed():
    with pytest.raises(ValueError, match=r"one of \('overlap', '1f1b', 'gpipe'\), got 'zigzag'"):
        make_plan("zigzag", 4, 2)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        make_plan("overlap", 0, 2)
