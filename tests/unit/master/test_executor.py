"""The executor (rpcmp/master/executor.py) against a fake pipeline: what each schedule does, in
which order, and what a failed micro-batch leaves, with the stages' answers arriving late and
out of order. Real distributed-autograd contexts (the one-process RPC world of conftest.py);
no stage, no owner: the chain is a future that a timer completes."""
import random
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from rpcmp.errors import JobError, StepCancelled, WorkerLostError
from rpcmp.master import executor, inbox
from rpcmp.master.executor import check_mean_loss
from rpcmp.master.sync import LocalMerge
from rpcmp.plan.schedule import make_plan


class _Recorder(LocalMerge):
    """The fake pipeline's gradient merge: records, does nothing."""

    def __init__(self, events):
        super().__init__()
        self.events, self.asked = events, set()

    def begin(self, pipe, first_seq, count, steps=False):
        self.asked.add(steps)  # whether the owners were asked to step in the backward as the step began (M > 1)
        self.arming = list(pipe.armed) if steps else []

    def merge(self, pipe, ctx_ids, i, into, ran=True):
        """Those that armed stepped in the backward once the last micro-batch's has left them."""
        self.events.append(("merge", i, into, ctx_ids[into]))
        return tuple(self.arming) if ran and i == len(ctx_ids) - 1 else ()


class FakePipe:
    """What :class:`rpcmp.master.executor.Steppable` names, and nothing else: the last stage's
    output is ``2 * x``, answered after a random delay from another thread."""

    def __init__(self, stages: int, fail: set[int] = frozenset(), seed: int = 0, delays: dict | None = None,
                 grad: bool = False, output=lambda x: 2 * x, steps_in_backward: bool = False,
                 armed: tuple = ("first",), allows: bool = True):
        self.pid, self.job = 7, SimpleNamespace(loss=lambda out, y: ((out - y) ** 2).mean())
        self.specs, self.places = [SimpleNamespace(sizes=())] * stages, [SimpleNamespace(process="first")]
        self.owners, self.optimizer, self.loss_checked, self.schedule = ["first"] * stages, object(), True, "overlap"
        self.events, self.lock, self.fail, self.rng = [], threading.Lock(), fail, random.Random(seed)
        self.sync, self.seq, self.abandoned, self.resyncs = _Recorder(self.events), 0, [], 0
        self.in_flight = self.most_in_flight = 0
        self.alone = set()  # what send was told: whether the micro-batch is its step's only one
        self.local = threading.local()
        self.delays, self.cancelled, self.lost = delays or {}, set(), set()
        self.grad, self.outs, self.grads, self.output = grad, {}, {}, output  # grad: outputs are leaves; backward records their gradient
        # steps_in_backward: the owners may step in a step's only backward; those of them that arm it (armed), and
        # Job.nonfinite's answer (allows)
        self.steps_in_backward, self.armed, self.allows, self.asked = steps_in_backward, armed, allows, set()

    def cancel(self, seqs):
        """inbox.cancel: the owners fail what has not started on them (rpcmp.owner.admission.InOrder.cancel)."""
        self.cancelled.update(seq - self.seqs0 for seq in seqs)

    def micro_threads(self, count):
        return ThreadPoolExecutor(max_workers=count)

    def next_seqs(self, count):
        self.seq += count
        return list(range(self.seq - count, self.seq))

    def send(self, pid, seq, first, x, grad, owners, alone=False, steps=False):
        i = seq - self.seqs0
        self.alone.add(alone)
        self.asked.add(steps)
        self.local.i = i  # the same driver thread calls backward for this micro-batch
        with self.lock:
            self.events.append(("enter", i))
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        fut = torch.futures.Future()

        def answer():
            if i in self.lost:  # its owner died: the watch call says so
                fut.set_exception(WorkerLostError("the connection to second closed (EOF: end of file)"))
            elif i in self.fail:
                fut.set_exception(RuntimeError(f"stage 1 failed on micro-batch {i}"))
            elif i in self.cancelled:
                fut.set_exception(StepCancelled(f"stage 1: micro-batch {i} not run, its step failed elsewhere"))
            else:
                self.outs[i] = self.output(x.requires_grad_(self.grad))
                fut.set_result((self.outs[i], self.armed) if steps else self.outs[i])
        threading.Timer(self.delays.get(i, self.rng.uniform(0, 0.02)), answer).start()
        return fut

    def backward(self, ctx, loss):
        if self.grad:
            self.grads[self.local.i] = torch.autograd.grad(loss, self.outs[self.local.i])[0]
        with self.lock:
            self.events.append(("backward", getattr(self.local, "i", None)))
            self.in_flight -= 1

    def to_fp32(self, out):
        return out

    def allows_update(self, loss):
        self.events.append(("allows", loss.item(), getattr(self.local, "i", None)))
        return self.allows

    def apply_step(self, ctx_id, loss, stepped=()):
        self.events.append(("step", ctx_id, loss.item(), stepped))

    def resync(self):
        self.resyncs += 1


@pytest.fixture
def fake(monkeypatch, world):
    def make(stages, **kw):
        pipe = FakePipe(stages, **kw)
        pipe.seqs0 = pipe.seq
        monkeypatch.setattr(inbox, "send", pipe.send)
        monkeypatch.setattr(inbox, "abandon", lambda pid, seqs: pipe.abandoned.append((pid, seqs)))
        monkeypatch.setattr(inbox, "cancel", lambda pid, seqs, owners: pipe.cancel(seqs))
        return pipe
    return make


def _batch(n=7):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g)


@pytest.mark.parametrize("schedule", ["overlap", "1f1b"])
@pytest.mark.parametrize("m, stages", [(1, 2), (4, 2), (6, 3), (5, 5)])
def test_a_context_per_micro_batch_enters_merges_and_steps_as_its_plan_says(fake, schedule, m, stages):
    plan = make_plan(schedule, m, stages)
    for seed in range(3):  # answers arrive in another order each time
        pipe = fake(stages, seed=seed)
        x, y = _batch()
        loss = executor.run_step(pipe, schedule, x, y, m)
        torch.testing.assert_close(loss, ((2 * x - y) ** 2).mean())  # shares weigh micro-batches of 3, 2, 2
        kinds = [e[0] for e in pipe.events]
        assert kinds.count("enter") == kinds.count("backward") == m and kinds.count("step") == 1
        merges = [(e[1], e[2]) for e in pipe.events if e[0] == "merge"]
        assert merges == list(plan.merges)  # in the plan's order, every time
        step = kinds.index("step")
        assert step == len(kinds) - 1 and pipe.events[step][2] == pytest.approx(loss.item())
        assert len({e[3] for e in pipe.events if e[0] == "merge"}) <= 1  # all into the first micro-batch's context
        assert pipe.most_in_flight <= plan.in_flight
        assert pipe.alone == {m == 1}  # the owners run a step's only micro-batch on their RPC thread
        for i, after in enumerate(plan.admit_after):  # 1f1b: i enters once i - S is merged
            if after is not None:
                done = ("merge", after) if after else ("backward", 0)  # micro-batch 0 is merged into by the rest
                merged = next(k for k, e in enumerate(pipe.events) if e[:2] == done)
                assert merged < pipe.events.index(("enter", i)), (i, after, pipe.events)


@pytest.mark.parametrize("m", [1, 4])
def test_gpipe_computes_one_loss_on_the_gathered_batch_and_each_backward_starts_from_its_part(fake, m):
    for seed in range(3):  # answers arrive in another order each time
        pipe = fake(3, seed=seed, grad=True)
        x, y = _batch()
        loss = executor.run_step(pipe, "gpipe", x, y, m)
        whole = (2 * x).requires_grad_()
        expected = ((whole - y) ** 2).mean()  # not a sum of micro-batch losses: the loss of the whole batch
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=0)
        kinds = [e[0] for e in pipe.events]
        assert kinds.count("enter") == kinds.count("backward") == m and kinds[-1] == "step"
        assert max(k for k, e in enumerate(kinds) if e == "enter") < kinds.index("backward")  # all outputs first
        assert [(e[1], e[2]) for e in pipe.events if e[0] == "merge"] == list(make_plan("gpipe", m, 3).merges)
        # each micro-batch's backward gets exactly its rows of the whole loss's gradient
        torch.testing.assert_close(torch.cat([pipe.grads[i] for i in range(m)]), torch.autograd.grad(expected, whole)[0],
                                   rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["overlap", "1f1b"])
def test_a_step_of_one_micro_batch_asks_the_owners_to_step_in_its_backward_and_the_others_after_it(fake, schedule):
    # see [Note: a step steps where its gradients are made] in rpcmp/owner/stepping.py
    pipe = fake(2, steps_in_backward=True, armed=("worker1", "master"))
    x, y = _batch(8)
    loss = executor.run_step(pipe, schedule, x, y, 1)
    assert pipe.asked == {True}
    kinds = [e[0] for e in pipe.events]
    assert kinds == ["enter", "allows", "backward", "step"]  # the loss is allowed before the owners step
    assert pipe.events[-1][2:] == (pytest.approx(loss.item()), ("worker1", "master"))
    # none armed (every owner holds two stages, say): the step as before, the loss checked by apply_step
    pipe = fake(2, steps_in_backward=True, armed=())
    executor.run_step(pipe, schedule, x, y, 1)
    assert [e[0] for e in pipe.events] == ["enter", "backward", "step"] and pipe.events[-1][3] == ()


def test_a_loss_that_skips_its_update_skips_the_backward_the_owners_would_step_in(fake):
    pipe = fake(2, steps_in_backward=True, allows=False)
    x, y = _batch(8)
    loss = executor.run_step(pipe, "overlap", x, y, 1)
    assert [e[0] for e in pipe.events] == ["enter", "allows"]  # no backward, no step
    torch.testing.assert_close(loss, ((2 * x - y) ** 2).mean())


@pytest.mark.parametrize("schedule, m", [("overlap", 4), ("1f1b", 2)])
def test_a_step_of_several_micro_batches_asks_the_owners_as_it_begins_and_allows_each_loss_before_its_backward(
        fake, schedule, m):
    pipe = fake(2, steps_in_backward=True, armed=("worker1", "master"))
    x, y = _batch(8)
    executor.run_step(pipe, schedule, x, y, m)
    assert pipe.sync.asked == {True} and pipe.asked == {False}  # asked once, not in each forward message
    kinds = [e[0] for e in pipe.events]
    assert kinds.count("backward") == kinds.count("allows") == m and kinds.count("step") == 1 and kinds[-1] == "step"
    for i in range(m):  # every loss allowed before its own backward
        allowed = next(k for k, e in enumerate(pipe.events) if e[0] == "allows" and e[2] == i)
        assert allowed < pipe.events.index(("backward", i)), pipe.events
    assert pipe.events[-1][3] == ("master", "worker1")  # the master asks the others only
    # none armed: the step as before, the loss checked by apply_step
    pipe = fake(2, steps_in_backward=True, armed=())
    executor.run_step(pipe, schedule, x, y, m)
    assert "allows" not in [e[0] for e in pipe.events] and pipe.events[-1][0] == "step" and pipe.events[-1][3] == ()


def test_a_non_finite_loss_of_one_micro_batch_skips_its_backward_and_the_update(fake):
    pipe = fake(2, steps_in_backward=True, armed=("worker1",), allows=False)
    x, y = _batch(8)
    executor.run_step(pipe, "overlap", x, y, 4)
    kinds = [e[0] for e in pipe.events]
    assert kinds.count("allows") == 1  # decided once a step
    assert "backward" not in kinds  # every loss non-finite: none has a backward
    assert "step" not in kinds and kinds.count("merge") == 3  # every merge said, none stepped


@pytest.mark.parametrize("schedule, m", [("gpipe", 1), ("gpipe", 4)])
def test_no_owner_steps_in_the_backward_of_a_gathered_loss(fake, schedule, m):
    pipe = fake(2, steps_in_backward=True)
    x, y = _batch(8)
    executor.run_step(pipe, schedule, x, y, m)
    steps = [e for e in pipe.events if e[0] == "step"]
    assert pipe.asked == {False} and pipe.sync.asked == {False} and "allows" not in [e[0] for e in pipe.events]
    assert len(steps) == 1 and steps[0][3] == ()


@pytest.mark.parametrize("schedule", ["overlap", "1f1b", "gpipe"])
def test_a_failed_micro_batch_raises_the_first_failure_and_steps_nothing(fake, schedule):
    pipe = fake(2, fail={3, 1})
    x, y = _batch(8)
    with pytest.raises(RuntimeError, match="micro-batch 1$"):  # the first by index, whichever failed first
        executor.run_step(pipe, schedule, x, y, 4)
    assert not [e for e in pipe.events if e[0] == "step"]
    assert pipe.abandoned == [(7, [0, 1, 2, 3])] and pipe.resyncs == 1
    pipe.fail = set()
    pipe.events.clear()
    executor.run_step(pipe, schedule, x, y, 4)  # the next step runs whole
    assert [e[0] for e in pipe.events].count("step") == 1


def test_a_lost_owner_is_the_failure_reported_before_what_its_loss_made_others_fail_with(fake):
    # micro-batch 0 failed with what the loss did to a neighbour (its backward: EPIPE), 2 with the loss itself
    pipe = fake(2, fail={0})
    pipe.lost = {2}
    x, y = _batch(8)
    with pytest.raises(WorkerLostError, match="the connection to second closed"):
        executor.run_step(pipe, "overlap", x, y, 4)


@pytest.mark.parametrize("schedule", ["overlap", "1f1b", "gpipe"])
def test_the_first_failure_cancels_the_rest_and_is_the_one_reported(fake, schedule):
    # micro-batch 1 fails first; the others answer later and are cancelled by then: the step reports 1's own
    # failure, not 0's cancellation; with 1f1b, 2 and 3 (admitted after 0's and 1's merges) never start
    pipe = fake(2, fail={1}, delays={0: 0.3, 1: 0.0, 2: 0.3, 3: 0.3})
    x, y = _batch(8)
    with pytest.raises(RuntimeError, match="stage 1 failed on micro-batch 1$"):
        executor.run_step(pipe, schedule, x, y, 4)
    assert pipe.cancelled == {0, 2, 3}
    entered = {e[1] for e in pipe.events if e[0] == "enter"}
    assert entered == ({0, 1} if schedule == "1f1b" else {0, 1, 2, 3})
    assert not [e for e in pipe.events if e[0] == "step"] and pipe.resyncs == 1


def test_a_batch_smaller_than_the_micro_batch_count_is_refused(fake):
    pipe = fake(2)
    x, y = _batch(3)
    with pytest.raises(Exception, match="micro"):
        executor.run_step(pipe, "overlap", x, y, 4)


def _checked(loss, outs, ys):
    """check_mean_loss on a pipe that has only what it reads; the warnings it gave."""
    pipe = SimpleNamespace(job=SimpleNamespace(loss=loss), schedule="overlap", loss_checked=False)
    y = torch.cat(ys)
    total = sum(loss(o, t) * (len(o) / len(y)) for o, t in zip(outs, ys))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        check_mean_loss(pipe, outs, ys, [len(o) / len(y) for o in outs], y, total)
    return pipe.loss_checked, [str(w.message) for w in seen]


def _token_mean(out, y):  # a language model's loss: a mean over the tokens that padding leaves in
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)


def test_a_loss_that_is_a_mean_over_samples_passes_and_other_losses_are_flagged():
    g = torch.Generator().manual_seed(0)
    outs, ys = [torch.randn(4, 3, generator=g) for _ in range(2)], [torch.randn(4, 3, generator=g) for _ in range(2)]
    assert _checked(lambda o, y: ((o - y) ** 2).mean(), outs, ys) == (True, [])
    checked, said = _checked(lambda o, y: ((o - y) ** 2).sum(), outs, ys)
    assert checked and len(said) == 1 and "schedule='gpipe'" in said[0]
    # a mean over tokens with padding left out, at initialisation (every token's loss the same, log V): the
    # micro-batches' weighted losses add up to the whole batch's (to rounding), yet the weighting is wrong
    outs = [torch.zeros(4, 6, 10), torch.zeros(4, 6, 10)]
    ys = [torch.randint(0, 10, (4, 6), generator=g) for _ in range(2)]
    ys[0][:, 2:] = -100  # the first micro-batch's sequences are short
    whole = _token_mean(torch.cat(outs), torch.cat(ys))
    torch.testing.assert_close(whole, (_token_mean(outs[0], ys[0]) + _token_mean(outs[1], ys[1])) / 2)
    checked, said = _checked(_token_mean, outs, ys)
    assert checked and len(said) == 1 and "outputs made to differ by micro-batch" in said[0], said


def test_a_mean_loss_defined_only_for_probabilities_is_not_flagged_and_a_non_finite_one_waits():
    g = torch.Generator().manual_seed(1)
    outs = [torch.rand(4, 3, generator=g) for _ in range(2)]  # probabilities: scaled by 2 they leave [0, 1]
    ys = [(torch.rand(4, 3, generator=g) > 0.5).float() for _ in range(2)]
    assert _checked(torch.nn.functional.binary_cross_entropy, outs, ys) == (True, [])
    outs[1][0, 0] = float("nan")
    assert _checked(lambda o, y: ((o - y) ** 2).mean(), outs, ys) == (False, [])  # a later step checks


def test_a_loss_the_model_computes_itself_is_refused_by_gpipe_and_said_unchecked_by_overlap(fake):
    """A Hugging Face model given labels returns its loss, 0-dimensional: nothing to gather (gpipe), and
    nothing to check a mean over samples on (overlap)."""
    x, y = _batch(8)
    pipe = fake(2, output=lambda x: {"loss": (2 * x).pow(2).mean(), "logits": 2 * x})
    pipe.job.loss = lambda out, y: out["loss"]
    with pytest.raises(JobError, match="0-dimensional tensor .* Leave the labels out of the model's input"):
        executor.run_step(pipe, "gpipe", x, y, 4)
    pipe.loss_checked = False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        executor.run_step(pipe, "overlap", x, y, 4)
        executor.run_step(pipe, "overlap", x, y, 4)
    said = [str(w.message) for w in seen if "0-dimensional" in str(w.message)]
    assert len(said) == 1 and "cannot check that Job.loss is a mean over samples" in said[0], said


@pytest.mark.parametrize("schedule", ["overlap", "gpipe"])
def test_a_loss_that_is_not_one_number_is_refused_saying_so(fake, schedule):
    """reduction='none': distributed autograd's backward said only ' is not a scalar, all roots need to be scalar'."""
    x, y = _batch(8)
    pipe = fake(2)
    pipe.job.loss = lambda out, y: ((out - y) ** 2).mean(1)
    with pytest.raises(JobError, match=r"Job.loss must return one number \(a 0-dimensional tensor\), got a tensor of "
                                       r"shape \((2|8),\): reduce it over the samples"):
        executor.run_step(pipe, schedule, x, y, 4)
