"""What a process serves, in one object: the master's awaited outputs, what the run is doing,
a fresh object for a second run in one process."""
import threading

import pytest
import torch

from rpcmp.core.hparams import StageFields
from rpcmp.core.served import Awaited, RunStatus, current, serve


def test_an_awaited_output_is_settled_once_from_another_thread_and_a_dropped_one_is_thrown_away():
    awaited = Awaited()
    out, gone = awaited.expect((0, 1)), awaited.expect((0, 2))
    awaited.drop([(0, 2)])
    threading.Thread(target=awaited.settle, args=((0, 1), torch.ones(2))).start()
    assert torch.equal(out.wait(), torch.ones(2))
    assert not awaited.settle((0, 1), torch.zeros(2))  # a second answer (a later error) finds nobody waiting
    assert not awaited.settle((0, 2), torch.zeros(2)) and not gone.done() and len(awaited) == 0
    failing = awaited.expect((1, 0))
    awaited.settle((1, 0), ValueError("stage 1 failed"))
    with pytest.raises(ValueError, match="stage 1 failed"):
        failing.wait()


def test_the_run_status_names_the_lost_process_its_stages_the_step_and_the_way_back():
    status = RunStatus(stages={"worker2": ["stage 1 decoder"]})
    assert status.describe(["worker2"], "stopped answering").startswith(
        "before the first step: worker2 (stage 1 decoder) stopped answering. Look at")
    assert "(--checkpoint-dir DIR to keep progress)" in status.describe(["worker2"], "left")
    status.checkpoint_dir = "runs/a"  # given, nothing saved yet: not told to give it
    assert status.describe(["worker2"], "left").endswith("No checkpoint was written in runs/a yet")
    status.step, status.checkpoint = 7, "ck/step-6.pt"
    text = status.describe(["worker3"], "did not answer for 5s")
    assert "at step 7: worker3 (no stage) did not answer for 5s" in text and "ck/step-6.pt: rerun with --resume" in text
    assert RunStatus(task="predicting with a.pt").describe(["worker1"], "left").startswith("predicting with a.pt: worker1")


def test_a_second_run_in_one_process_starts_from_a_fresh_object():
    first = serve("job-a")
    first.hosts[(0, 0)] = object()
    first.inbox.expect((0, 0))
    ids = [first.next_pipeline_id(), first.next_pipeline_id()]
    assert current() is first and ids == [0, 1]
    second = serve("job-b")
    assert current() is second and second.job == "job-b"
    assert not second.hosts and len(second.inbox) == 0 and second.next_pipeline_id() == 0
    assert second.status is not first.status and second.outcome is None


def test_stage_fields_send_what_the_scheduler_sets_and_only_what_changed():
    sent = []
    fields = StageFields((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                         (torch.optim.lr_scheduler.OneCycleLR, {"max_lr": 1.0, "total_steps": 4}), sent.append)
    ref = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=1.0, total_steps=4)
    assert {"lr", "momentum"} <= set(sent[0][0]) and fields.lr == ref.param_groups[0]["lr"]  # set at construction
    for _ in range(3):
        ref.step()
        sched.step()
        fields.step()
        assert fields.lr == ref.param_groups[0]["lr"] and fields.sent[0]["momentum"] == ref.param_groups[0]["momentum"]
    count = len(sent)
    fields.set({"lr": fields.lr})  # unchanged: nothing travels
    assert len(sent) == count
    restored = StageFields((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                           (torch.optim.lr_scheduler.OneCycleLR, {"max_lr": 1.0, "total_steps": 4}), sent.append)
    restored.load_state(fields.state())
    assert restored.sent == fields.sent


def test_a_scheduler_state_loaded_back_sends_every_field_even_one_sent_before():
    """A lost owner, killed while the master pushed the next step's learning rates: the survivors had them, the
    master's record did not (the push raised), and after the rollback to the checkpoint (the scheduler's state of
    that step loaded back) the rates of the step trained again were "unchanged" against that record, so nothing
    was sent and a survivor trained it with the next step's rates (tests/integration/test_live_recovery.py, now
    and then under load: a model 1e-4 off). Loading a state now sends all of its fields."""
    sent = []
    cut = [False]

    def send(changed):
        sent.append(changed)
        if cut[0]:
            raise RuntimeError("worker2 is gone")
    fields = StageFields((torch.optim.SGD, {"lr": 0.1}), (torch.optim.lr_scheduler.StepLR, {"step_size": 1,
                                                                                          "gamma": 0.5}), send)
    fields.step()
    state = fields.state()  # the checkpoint's: lr 0.05 for the next step
    cut[0] = True
    with pytest.raises(RuntimeError):
        fields.step()  # lr 0.025 reached some stages; the record still says 0.05
    cut[0] = False
    sent.clear()
    fields.load_state(state)
    assert sent and sent[-1][0]["lr"] == 0.05 and fields.lr == 0.05


def test_without_a_scheduler_stage_fields_send_only_what_is_set_by_hand():
    sent = []
    fields = StageFields((torch.optim.SGD, {"lr": 0.1}), None, sent.append)
    fields.step()
    assert sent == [] and fields.lr == 0.1
    fields.set({"lr": 0.05, "momentum": 0.0})
    assert sent == [{0: {"lr": 0.05, "momentum": 0.0}}] and fields.lr == 0.05


def test_handles_on_a_lost_process_are_kept_and_the_others_let_go():
    class Handle:  # what an RRef answers: its owner's WorkerInfo
        def __init__(self, name):
            self.name = name

        def owner(self):
            return self

    served = serve()
    served.lost.add("worker2")
    lost, alive = Handle("worker2"), Handle("worker3")
    served.keep_lost([lost, alive])
    assert served.buried == [lost]
