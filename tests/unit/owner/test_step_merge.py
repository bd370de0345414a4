"""An owner's optimizer step in the backward (see [Note: a step steps where its gradients are made] in
rpcmp/owner/stepping.py): after the last merge of a step's micro-batches (rpcmp/owner/reduce.py::StepMerge), and not
after a rollback."""
from rpcmp.owner.reduce import StepMerge


def _merged(said) -> tuple[list, bool]:
    """A stage of three micro-batches with nothing to add (no gradient to merge, no context to read), told ``said``;
    the contexts its step was taken on, and whether it says it stepped."""
    taken = []
    merge = StepMerge({}, "stage 0", first_seq=0, count=3, hook=True, step=taken.append)
    merge.empty.update(range(3))
    merge.contexts[0] = 7
    said(merge)
    assert merge.closed
    return taken, merge.stepped


def test_a_stage_steps_once_every_micro_batch_s_backward_has_left_it_in_any_order():
    assert _merged(lambda m: [m.left(i, None, True) for i in (2, 0, 1)]) == ([7], True)
    # the master's word on the last micro-batch comes after: nothing more
    assert _merged(lambda m: ([m.left(i, None, True) for i in range(3)], m.left(2, [7, 8, 9]))) == ([7], True)


def test_a_stage_leaves_the_step_to_the_master_when_its_word_merged_a_micro_batch_the_backward_did_not_bring():
    # micro-batch 1 had no backward here (Job.nonfinite left it out, or its output took no gradient): the master's
    # word merged it, and the last backward then completes the merges but takes no step
    assert _merged(lambda m: (m.left(0, None, True), m.left(1, [7, 8]), m.left(2, None, True))) == ([], False)
    assert _merged(lambda m: [m.left(i, [7, 8, 9][:i + 1]) for i in range(3)]) == ([], False)


def test_a_rollback_cancels_a_step_armed_before_it_and_waits_for_one_being_taken(monkeypatch):
    """A failed step's owner may reach its step in the backward after the master rolled the stage back (another
    owner lost meanwhile): that step is not taken, and a rollback waits for a step already under way."""
    import threading
    import time
    from types import SimpleNamespace

    import torch

    from rpcmp.owner import stepping
    host = SimpleNamespace(posts=False, place=SimpleNamespace(process="worker1"), next_process="worker2",
                           device=torch.device("cpu"))
    served = SimpleNamespace(optimizers={7: object()}, hosts_of=lambda pid: [host], step_gates={})
    taken, started = [], threading.Event()

    def local_step(local, ctx_id):
        started.set()
        time.sleep(0.2 if ctx_id == 3 else 0)
        taken.append(ctx_id)
    monkeypatch.setattr(stepping, "current", lambda: served)
    monkeypatch.setattr(stepping, "local_step", local_step)
    armed = stepping.stepper(7)
    stepping.cancel(7)  # the rollback
    armed(1)
    assert taken == []
    stepping.stepper(7)(2)  # the next step's, armed after the rollback
    assert taken == [2]
    started.clear()
    slow = threading.Thread(target=stepping.stepper(7), args=(3,))
    slow.start()
    assert started.wait(10)
    stepping.cancel(7)  # while step 3 is being taken: returns once it is over, not before
    assert taken == [2, 3]
    slow.join(10)
