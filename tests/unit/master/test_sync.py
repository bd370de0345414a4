"""How gradients come together before a step, without processes (a pipe with no parameter owners):
one pipeline decides on its own loss; copies decide alike on the mean, and only the first speaks."""
import threading
from types import SimpleNamespace

import torch

from rpcmp.master.livecopy import LiveCopies
from rpcmp.master.replicas import ReplicaSync
from rpcmp.master.sync import LocalMerge, ReplicaReduce

PIPE = SimpleNamespace(pid=0, param_owners=[])


def _copies(losses):
    meeting, out = ReplicaSync(len(losses), timeout=10), [None] * len(losses)

    def run(i):
        out[i] = ReplicaReduce(i, meeting).before_step(PIPE, 1, torch.tensor(losses[i]))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(losses))]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    return out


def test_one_pipeline_decides_on_its_own_loss():
    loss = torch.tensor(2.5)
    assert LocalMerge().before_step(PIPE, 1, loss) is loss


def test_copies_decide_on_the_mean_loss():
    assert [float(x) for x in _copies([1.0, 3.0])] == [2.0, 2.0]


def test_a_non_finite_mean_is_reported_by_the_first_copy_only():
    first, second = _copies([1.0, float("nan")])
    assert torch.isnan(first) and second is None


def test_copies_past_the_meeting_say_so_and_the_meeting_keeps_the_step_s_loss():
    meeting = ReplicaSync(2, timeout=10)
    syncs = [ReplicaReduce(i, meeting) for i in range(2)]
    threads = [threading.Thread(target=s.before_step, args=(PIPE, 1, torch.tensor(float(i + 1)))) for i, s in enumerate(syncs)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    assert [s.reached for s in syncs] == [True, True] and float(meeting.mean) == 1.5


def _plan(r, copies, taken=(), reached=(), in_step=True):
    pipes = [SimpleNamespace(sync=SimpleNamespace(reached=q in reached)) for q in range(copies)]
    live = LiveCopies.__new__(LiveCopies)
    live.rep = SimpleNamespace(pipes=pipes, taken=list(taken))
    return live._plan(r, in_step)


def test_a_step_a_copy_took_stands_and_the_copies_that_did_not_take_it_are_refilled():
    assert _plan(0, 2, taken=[1], reached=[0, 1]) == (1, [0], True)
    assert _plan(1, 3, taken=[2, 0], reached=[0, 1, 2]) == (0, [1], True)
    assert _plan(0, 3, taken=[0, 2], reached=[0, 1, 2]) == (2, [1], True)  # the lost owner's copy took it too
    assert _plan(0, 2, taken=[0], reached=[0, 1]) == (None, [1], True)  # only the lost owner's copy: no source


def test_a_step_nobody_took_runs_again_from_a_copy_that_never_got_past_the_average():
    assert _plan(0, 2) == (1, [], False)  # lost before the meeting: nothing changed anywhere
    assert _plan(0, 2, reached=[0]) == (1, [0], False)  # its own copy may have stepped in part
    assert _plan(0, 3, reached=[0, 1]) == (2, [0, 1], False)
    assert _plan(0, 2, reached=[0, 1]) == (None, [0, 1], False)  # every copy may have stepped: not exact, not done


def test_between_steps_the_next_copy_is_the_source():
    assert _plan(1, 2, taken=[], in_step=False) == (0, [], False)
