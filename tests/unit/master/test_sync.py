"""How gradients come together before a step, without processes (a pipe with no parameter owners):
one pipeline decides on its own loss; copies decide alike on the mean, and only the first speaks."""
import threading
from types import SimpleNamespace

import torch

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
