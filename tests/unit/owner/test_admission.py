"""The in-order gate of a stage, with plain threads."""
import threading
import time

import pytest

from rpcmp.owner.admission import InOrder
from rpcmp.errors import StageError, StepCancelled


def _run_all(gate, seqs, ran, hold=0.0):
    def one(seq):
        gate.enter(seq)
        ran.append(seq)
        time.sleep(hold)
        gate.leave(seq)
    threads = [threading.Thread(target=one, args=(s,)) for s in seqs]
    for t in threads:  # started in the given order, which is not the master's
        t.start()
        time.sleep(0.01)
    return threads


def test_micro_batches_run_in_the_masters_order_whatever_order_they_arrive_in():
    gate, ran = InOrder("stage 1", timeout=10), []
    for t in _run_all(gate, [3, 1, 0, 2], ran, hold=0.01):
        t.join(10)
    assert ran == [0, 1, 2, 3] and gate.next == 4


def test_a_micro_batch_lost_upstream_lets_the_later_ones_pass_once_skipped():
    gate, ran = InOrder("stage 1", timeout=10), []
    threads = _run_all(gate, [2, 0], ran)
    time.sleep(0.1)
    assert ran == [0]  # 2 waits for 1
    gate.skip(1)
    for t in threads:
        t.join(10)
    assert ran == [0, 2] and gate.next == 3


def test_waiting_too_long_says_which_stage_waited_for_what():
    gate = InOrder("stage 1 (decoder) on worker2", timeout=0.2)
    with pytest.raises(StageError, match=r"stage 1 \(decoder\) on worker2 waited 0s for micro-batch 0 before 1"):
        gate.enter(1)


def test_posted_values_are_waited_for_and_dropped_with_a_skipped_micro_batch():
    gate = InOrder("stage 2", timeout=10, mail_names=("f1", "f2"))
    got = []
    t = threading.Thread(target=lambda: got.append(gate.enter(0)))
    t.start()
    gate.receive(0, {"f1": 1})
    time.sleep(0.1)
    assert not got  # f2 is still missing
    gate.receive(0, {"f2": 2})
    t.join(10)
    assert got == [{"f1": 1, "f2": 2}]
    gate.leave(0)
    gate.receive(1, {"f1": 1})  # micro-batch 1 then fails upstream
    gate.skip(1)
    gate.receive(1, {"f2": 2})  # a late post for it is not kept
    assert gate.next == 2 and not gate._mail
    gate.timeout = 0.1
    with pytest.raises(StageError, match=r"values \['f1', 'f2'\] of micro-batch 2"):
        gate.enter(2)  # its turn, but nothing was posted for it


def test_reset_after_a_failed_step_starts_from_the_masters_next_number():
    gate = InOrder("stage 0", timeout=10)
    gate.skip(5)
    gate.reset(7)
    assert gate.next == 7
    gate.enter(7)
    gate.leave(7)
    assert gate.next == 8


def test_a_failed_step_cancels_what_has_not_entered_and_a_reset_forgets_it():
    gate = InOrder("stage 1", timeout=10)
    gate.enter(0)
    gate.cancel([0, 1, 2])  # 0 is running: it finishes; 1 and 2 fail at once when they come, in any order
    with pytest.raises(StepCancelled, match="micro-batch 2 not run, its step failed elsewhere"):
        gate.enter(2)  # does not wait for 0 and 1
    gate.leave(0)
    with pytest.raises(StepCancelled):
        gate.enter(1)  # a failed enter is not followed by leave (rpcmp.owner.stage.StageHost.run)
    assert gate.next == 3  # nothing later waits for them
    gate.reset(3)
    gate.cancel([1])  # an old number changes nothing
    assert gate.enter(3) == {}
