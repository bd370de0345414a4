"""Each schedule's plan, without processes."""
import pytest

from rpcmp.plan.schedule import SCHEDULES, make_plan


def test_gpipe_is_one_loss_on_the_gathered_batch_and_merges_in_order_into_the_first():
    plan = make_plan("gpipe", 4, 3)
    assert (plan.loss, plan.merges) == ("gathered", ((1, 0), (2, 0), (3, 0)))
    assert plan.window == (None,) * 3 and plan.in_flight == 4
    assert plan.rows()[1] == ("1", "at once", "when every output has arrived", "added into 0's, after 0's")


def test_overlap_runs_every_forward_at_once_and_merges_in_order_into_the_first():
    plan = make_plan("overlap", 4, 2)
    assert plan.loss == "micro-batch"
    assert plan.window == (None, None) and plan.in_flight == 4
    assert plan.merges == ((1, 0), (2, 0), (3, 0))


@pytest.mark.parametrize("m,s,window,in_flight", [
    (8, 3, (3, 2, 1), 3),
    (2, 3, (3, 2, 1), 2),  # fewer micro-batches than stages: nothing waits
    (4, 1, (1,), 1),
])
def test_1f1b_has_stage_k_run_forward_i_once_backward_i_minus_s_minus_k_has_left_it(m, s, window, in_flight):
    plan = make_plan("1f1b", m, s)
    assert plan.window == window and plan.in_flight == in_flight
    assert plan.merges == tuple((i, 0) for i in range(1, m))
    # a forward never waits for its own backward or a later one's: the plan cannot deadlock
    assert all(w >= 1 for w in plan.window)


def test_every_plan_merges_each_micro_batch_once_and_prints_a_row_per_micro_batch():
    for name in SCHEDULES:
        for m in (1, 2, 5):
            plan = make_plan(name, m, 3)
            merged = [i for i, _ in plan.merges]
            assert merged == sorted(set(merged)) and 0 not in merged
            assert len(plan.rows()) == m
    assert make_plan("1f1b", 4, 2).rows()[2] == ("2", "stage 0 once 0's backward has left it; stage 1 once 1's "
                                                "backward has left it", "as soon as its output arrives",
                                                "added into 0's, after 1's")


def test_a_bad_plan_request_says_what_is_allowed():
    with pytest.raises(ValueError, match=r"one of \('overlap', '1f1b', 'gpipe'\), got 'zigzag'"):
        make_plan("zigzag", 4, 2)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        make_plan("overlap", 0, 2)
