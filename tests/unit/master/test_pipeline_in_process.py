"""The master's mechanism in one process: a Pipeline whose stages all live on the master, in a
one-process RPC world (real RPC, real distributed autograd, no other process). What needs
several processes (transport, faults, launch) is in tests/integration."""
import dataclasses
import functools
import threading

import pytest
import torch

import rpcmp
from helpers import assert_close_f32, batches, load, no_decay, torch_groups, train_reference
from rpcmp.train.trainer import fit
from rpcmp.core.served import current, serve
from rpcmp.owner import reduce

@pytest.fixture
def job(world):
    serve(world)  # every test starts from a fresh Served, as a second run in one process would
    return world


@pytest.mark.parametrize("schedule", ["overlap", "1f1b", "gpipe"])
def test_every_schedule_trains_as_the_unsplit_model(job, schedule):
    data = batches(3)
    torch.manual_seed(job.seed)
    ref_losses, ref_state = train_reference(job.model(), job.optimizer, job.loss, data)
    pipe = rpcmp.Pipeline(job, world_size=1, schedule=schedule, microbatches=4)
    losses = [pipe.train_step(x, y).item() for x, y in data]
    assert_close_f32(losses, ref_losses)
    assert_close_f32(pipe.state_dict(), ref_state)
    pipe.close()
    assert not current().hosts and len(current().inbox) == 0  # closing leaves nothing behind


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_step_s_only_micro_batch_runs_on_the_rpc_thread_and_several_on_each_stage_s_compute_thread(job, microbatches):
    """[Note: one compute thread per stage]: several micro-batches must build their graphs on one thread per stage
    (the backward's order); a step of one has nothing to interleave with and skips the two hand-offs."""
    threads = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: threads.append(threading.current_thread().name))
    try:
        pipe = rpcmp.Pipeline(job, world_size=1, microbatches=microbatches)
        threads.clear()  # the plan's own forwards
        for x, y in batches(2):
            pipe.train_step(x, y)
    finally:
        hook.remove()
    pipe.close()
    on_stage = {name.startswith("rpcmp-stage") for name in threads}
    assert threads and on_stage == {microbatches > 1}, sorted(set(threads))


def test_state_and_optimizer_state_round_trip_by_the_unsplit_names(job):
    pipe = rpcmp.Pipeline(dataclasses.replace(job, optimizer=(torch.optim.Adam, {"lr": 0.01})), world_size=1)
    x, y = batches(1)[0]
    pipe.train_step(x, y)
    state, optim = pipe.state_dict(), pipe.optimizer_state()
    assert list(state) == list(job.model().state_dict())
    assert set(optim) == {n for n, _ in job.model().named_parameters()} and all("exp_avg" in v for v in optim.values())
    meta = pipe.state_meta()
    assert all(meta[k].shape == v.shape and meta[k].device.type == "meta" for k, v in state.items())
    pipe.load_state_dict({k: torch.zeros_like(v) for k, v in state.items()})
    assert all(not v.any() for v in pipe.state_dict().values())
    pipe.close()


def test_clipping_and_the_learning_rate_reach_every_stage(job):
    clipped = dataclasses.replace(job, clip_grad_norm=1e-3,
                                  scheduler=(torch.optim.lr_scheduler.StepLR, {"step_size": 1, "gamma": 0.5}))
    data = batches(2)
    torch.manual_seed(job.seed)
    model = job.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    norms = []
    for x, y in data:
        opt.zero_grad()
        job.loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
        opt.step()
        sched.step()
    pipe = rpcmp.Pipeline(clipped, world_size=1)
    got = []
    for x, y in data:
        pipe.train_step(x, y)
        got.append(pipe.last_grad_norm)
    assert_close_f32(got, [n.item() for n in norms])
    assert_close_f32(pipe.state_dict(), model.state_dict())
    assert pipe.learning_rates() == [0.025] and pipe.lr == 0.025
    pipe.close()


def test_a_failed_micro_batch_leaves_the_pipeline_ready_for_the_next_step(job):
    pipe = rpcmp.Pipeline(job, world_size=1, microbatches=2)
    with pytest.raises(rpcmp.StageError, match=r"stage 0 \(.*\) on master/cpu failed on micro-batch 0: RuntimeError"):
        pipe.train_step(torch.randn(8, 5), torch.randn(8, 8))  # 5 features where the model takes 16
    assert len(current().inbox) == 0
    x, y = batches(1)[0]
    assert torch.isfinite(pipe.train_step(x, y))
    pipe.close()


@pytest.mark.parametrize("groups", [False, True], ids=["one-group", "groups-and-a-scheduler"])
def test_a_run_stopped_and_resumed_ends_where_an_uninterrupted_run_ends(job, tmp_path, groups):
    quiet = rpcmp_console()
    common = dict(epochs=1, checkpoint_every=2, data=job.data)
    if groups:  # each group's learning rate, as the scheduler last set it, comes back with the checkpoint
        common.update(param_groups=no_decay, scheduler=_PER_GROUP,
                      optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.05}))
    whole = fit(dataclasses.replace(job, max_steps=5, checkpoint_dir=str(tmp_path / "a"), **common), 1, quiet)
    whole_state = _checkpoint_state(tmp_path / "a")
    first = fit(dataclasses.replace(job, max_steps=3, checkpoint_dir=str(tmp_path / "b"), **common), 1, quiet)
    serve(job)
    rest = fit(dataclasses.replace(job, max_steps=5, checkpoint_dir=str(tmp_path / "b"), resume=True, **common), 1, quiet)
    assert first["steps"] == 3 and rest["steps"] == 5
    assert_close_f32(first["losses"] + rest["losses"], whole["losses"], rtol=0, atol=0)
    assert_close_f32(_checkpoint_state(tmp_path / "b"), whole_state, rtol=0, atol=0)


def rpcmp_console():
    from rich.console import Console
    return Console(quiet=True)


def _checkpoint_state(folder):
    from rpcmp.core.checkpoint import load_checkpoint
    return load_checkpoint(str(folder))["model"]


def test_a_stage_merges_its_micro_batches_in_order_and_averages_once(job):
    """rpcmp.owner.reduce.StepReduce alone (a gloo group of this one process): micro-batches whose backward
    leaves the stage out of order are merged in order, the all_reduce starts once, when all have left;
    a parameter no micro-batch used gets no gradient; a late word changes nothing; a failed step
    still takes part in its all_reduce; counts short of the copies are refused by name."""
    import threading
    import torch.distributed as dist
    import torch.distributed.autograd as dist_autograd
    from rpcmp.errors import StageError
    from rpcmp.owner.reduce import StepReduce
    lin, unused = torch.nn.Linear(3, 2), torch.nn.Parameter(torch.ones(2))
    params = {"fc.weight": lin.weight, "fc.bias": lin.bias, "gate": unused}
    xs = [torch.randn(4, 3) for _ in range(3)]
    ctxs, ready, release = [None] * 3, [threading.Event() for _ in range(3)], threading.Event()

    def micro(i):  # a context per micro-batch, alive until the test is done with it
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [lin(xs[i]).pow(2).sum()])
            ctxs[i] = ctx
            ready[i].set()
            release.wait(60)
    threads = [threading.Thread(target=micro, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in ready)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        step = StepReduce(params, "stage 0", None, 1, first_seq=0, count=3, hook=False)
        step.contexts.update(enumerate(ctxs))
        step.left(2)
        assert step.next == 0 and step.work is None  # 2 waits for 0 and 1
        step.left(0)
        assert step.next == 1 and step.work is None
        step.left(1)
        assert step.next == 3 and step.work is not None
        step.average(ctxs[0])
        grads = {p: g for p, g in dist_autograd.get_gradients(ctxs[0]).items()}
        assert unused not in grads
        lin.zero_grad()
        lin(torch.cat(xs)).pow(2).sum().backward()  # the sum over the micro-batches, in one pass
        assert_close_f32(grads[lin.weight], lin.weight.grad)
        assert_close_f32(grads[lin.bias], lin.bias.grad)
        work = step.work
        step.left(1)  # late: the step is over
        assert step.work is work
        failed = StepReduce(params, "stage 0", None, 1, first_seq=0, count=3, hook=False)
        failed.contexts.update(enumerate(ctxs))
        failed.left(0)
        failed.settle(wait=True)  # joins the step's all_reduce with zeros, and ends the step
        assert failed.work is not None and failed.closed and failed.next == 1
        short = StepReduce(params, "stage 0 (layers) on master", None, 2, first_seq=0, count=1, hook=False)
        with pytest.raises(StageError, match=r"parameters \['fc.weight', 'fc.bias'\] got a gradient this step in some copies"):
            short.average(ctxs[0])  # as if a second copy had used neither
    finally:
        dist.destroy_process_group()
        release.set()
        for t in threads:
            t.join(30)


def test_a_stage_merges_a_micro_batch_whose_context_is_gone_before_its_turn(job):
    """rpcmp.owner.reduce.StepMerge alone: micro-batch 2's backward leaves the stage before 0's and 1's
    and the master releases its context before they are merged; it is merged in its turn all the same,
    into the sum over the micro-batches in one pass. A micro-batch whose backward never left the stage
    and whose context is gone is refused by name, not left out."""
    import threading
    import torch.distributed.autograd as dist_autograd
    from rpcmp.errors import StageError
    from rpcmp.owner.reduce import StepMerge
    lin = torch.nn.Linear(3, 2)
    params = {"fc.weight": lin.weight, "fc.bias": lin.bias}
    xs = [torch.randn(4, 3) for _ in range(3)]
    ctxs, ready = [None] * 3, [threading.Event() for _ in range(3)]
    release = [threading.Event() for _ in range(3)]

    def micro(i):  # a context per micro-batch, alive until the test releases it
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [lin(xs[i]).pow(2).sum()])
            ctxs[i] = ctx
            ready[i].set()
            release[i].wait(60)
    threads = [threading.Thread(target=micro, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(30) for e in ready)
        step = StepMerge(params, "stage 0", first_seq=0, count=3, hook=False)
        step.contexts.update(enumerate(ctxs))
        step.left(2)  # as the backward's callback says it
        release[2].set()
        threads[2].join(30)
        with pytest.raises(RuntimeError, match="Could not find autograd context"):
            dist_autograd.get_gradients(ctxs[2])
        step.left(0)
        step.left(1)
        assert step.next == 3 and step.closed and step.error is None and not step.held
        lin.zero_grad()
        lin(torch.cat(xs)).pow(2).sum().backward()
        grads = dist_autograd.get_gradients(ctxs[0])
        assert_close_f32(grads[lin.weight], lin.weight.grad)
        assert_close_f32(grads[lin.bias], lin.bias.grad)
        lost = StepMerge(params, "stage 0 (layers) on worker1", first_seq=0, count=3, hook=False)
        lost.left(0, [ctxs[0]])
        lost.left(2, ctxs)  # the master's last word: 2's context is gone, and no callback said 2 had left
        assert isinstance(lost.error, StageError) and "micro-batch 2's output needed a gradient" in str(lost.error)
    finally:
        for e in release:
            e.set()
        for t in threads:
            t.join(30)


class _Branch(torch.nn.Module):
    """Two experts: every sample takes ``a``, and ``b`` too where its first feature is positive; ``b`` runs on
    those samples only, and not at all where none is (as a router that gives an expert no token)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        out, take = self.a(x), x[:, 0] > 0
        if take.any():
            out = out.index_add(0, take.nonzero().squeeze(1), self.b(x[take]))
        return out


def _branching():
    return torch.nn.Sequential(_Branch(), torch.nn.Linear(16, 8))


def _routed(steps: int = 3):
    """Batches whose micro-batch 0 (of 2 or 4) sends no sample to expert b and whose last ones send all, then
    one step that sends none."""
    out = []
    for x, y in batches(steps + 1):
        x[:4, 0], x[4:, 0] = -1.0, 1.0  # b: none of micro-batch 0 (and 1 at M = 4), every later one
        out.append((x, y))
    out[-1][0][:, 0] = -1.0
    return out


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("optimizer", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.NAdam, {"lr": 0.01})],
                         ids=["sgd", "nadam"])
def test_a_parameter_the_first_micro_batch_did_not_reach_trains_as_in_the_unsplit_model(job, m, optimizer):
    """A branch (an expert) that micro-batch 0 leaves alone and a later one takes: its gradient is summed beside
    the first context's and every reader sees it (the clipping norm, the optimizer, functional or torch.optim);
    in the last step no micro-batch takes it, and it is left alone."""
    branching = dataclasses.replace(job, model=_branching, stages=rpcmp.Split([1, 1]), optimizer=optimizer,
                                    clip_grad_norm=0.5)
    serve(branching)  # the owner (here, the master itself) builds from the job it serves
    data = _routed()
    torch.manual_seed(branching.seed)
    model = _branching()
    opt = optimizer[0](model.parameters(), **optimizer[1])
    want = []
    for x, y in data:
        opt.zero_grad()
        loss = branching.loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        want.append(loss.item())
    pipe = rpcmp.Pipeline(branching, world_size=1, microbatches=m)
    torch.manual_seed(branching.seed)
    pipe.load_state_dict(_branching().state_dict())
    got = [pipe.train_step(x, y).item() for x, y in data]
    state = pipe.state_dict()
    pipe.close()
    assert_close_f32(got, want)
    assert_close_f32(state, model.state_dict())
    assert not reduce._BESIDE  # the optimizer let them go


def _tied_layers():
    layers = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), torch.nn.Tanh(),
                                 torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 8))
    layers[2].weight = layers[0].weight  # one parameter, read by both stages
    return layers


@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_parameter_shared_by_two_stages_trains_as_one(job, clip):
    tied = dataclasses.replace(job, model=_tied_layers, stages=rpcmp.Split([2, 2]), clip_grad_norm=clip,
                               optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
    serve(tied)  # the owner (here, the master itself) builds from the job it serves
    data = batches(3)
    torch.manual_seed(tied.seed)
    model = _tied_layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for x, y in data:
        opt.zero_grad()
        loss = tied.loss(model(x), y)
        loss.backward()
        if clip:  # the norm counts the shared parameter once, as parameters() lists it once
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        ref_losses.append(loss.item())
    pipe = rpcmp.Pipeline(tied, world_size=1, microbatches=2)
    losses = [pipe.train_step(x, y).item() for x, y in data]
    state = pipe.state_dict()
    pipe.close()
    assert_close_f32(losses, ref_losses)
    assert_close_f32(state, model.state_dict())
    torch.testing.assert_close(state["0.weight"], state["2.weight"], rtol=0, atol=0)  # the copies never part


_PER_GROUP = (torch.optim.lr_scheduler.LambdaLR, {"lr_lambda": [lambda s: 0.5 ** s, lambda s: 1.0 / (s + 1)]})


def test_parameter_groups_train_as_the_unsplit_model_s_optimizer_with_them(job):
    """Each group keeps its settings on every owner, a tied parameter (read by both stages) its group's, and a
    scheduler moves each group's learning rate as torch's moves it (see [Note: parameter groups])."""
    grouped = dataclasses.replace(job, model=_tied_layers, stages=rpcmp.Split([2, 2]), param_groups=no_decay,
                                  optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.05}),
                                  scheduler=_PER_GROUP)
    serve(grouped)
    data = batches(3)
    torch.manual_seed(grouped.seed)
    model = _tied_layers()
    opt = torch.optim.SGD(torch_groups(model), lr=0.1, momentum=0.9, weight_decay=0.05)
    sched = _PER_GROUP[0](opt, **_PER_GROUP[1])
    ref_losses, ref_lrs = [], []
    for x, y in data:
        opt.zero_grad()
        loss = grouped.loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        ref_losses.append(loss.item())
        ref_lrs.append([g["lr"] for g in opt.param_groups])
    pipe = rpcmp.Pipeline(grouped, world_size=1, microbatches=2)
    losses, lrs = [], []
    for x, y in data:
        losses.append(pipe.train_step(x, y).item())
        lrs.append([pipe.hparams()[0][g]["lr"] for g in (0, 1)])
    state = pipe.state_dict()
    pipe.close()
    assert_close_f32(losses, ref_losses)
    assert lrs == ref_lrs
    assert_close_f32(state, model.state_dict())


def _warm_then_cosine(optimizer):  # what Hugging Face's recipes pass: a function of the optimizer
    import transformers
    return transformers.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=4)


def test_a_scheduler_made_by_a_function_of_the_optimizer_moves_every_stage_s_rate_as_torch_s():
    """Job(scheduler=fn): transformers' get_*_schedule_with_warmup return a LambdaLR of the optimizer they are given;
    the master calls it on its probe, as torch's own scheduler classes (see [Note: schedulers in pipeline mode])."""
    job = load("mlp")
    serve(job)
    data = batches(4)
    torch.manual_seed(job.seed)
    model = job.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = _warm_then_cosine(opt)
    ref = []
    for x, y in data:
        opt.zero_grad()
        job.loss(model(x), y).backward()
        opt.step()
        sched.step()
        ref.append(opt.param_groups[0]["lr"])
    pipe = rpcmp.Pipeline(dataclasses.replace(job, scheduler=_warm_then_cosine, placement=["master/cpu"] * 2,
                                              optimizer=(torch.optim.SGD, {"lr": 0.1})), world_size=1)
    got = []
    for x, y in data:
        pipe.train_step(x, y)
        got.append(pipe.learning_rates())
    state = pipe.state_dict()
    pipe.close()
    assert got == [[lr] for lr in ref] and ref[0] < ref[1] > ref[2] > ref[3]  # warm-up, then down
    assert_close_f32(state, model.state_dict())


def test_a_scheduler_function_that_returns_no_scheduler_is_refused_saying_so():
    job = dataclasses.replace(load("mlp"), scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                              placement=["master/cpu"] * 2)
    serve(job)
    with pytest.raises(rpcmp.JobError, match=r"returned a ReduceLROnPlateau, not a torch.optim.lr_scheduler.LRScheduler "
                                             r"stepped once per optimizer step"):
        rpcmp.Pipeline(job, world_size=1)
    for wrong in ((torch.optim.SGD, {}), (torch.optim.lr_scheduler.ReduceLROnPlateau, {})):
        with pytest.raises(rpcmp.JobError, match=r"or a function of the optimizer that returns one"):
            dataclasses.replace(job, scheduler=wrong)


@pytest.mark.parametrize("scripts", [False, True], ids=["functional-python", "torch-that-scripts"])
def test_the_local_optimizers_hold_state_that_rpcmp_writes_into(job, monkeypatch, scripts):
    """Under a torch that compiles the functional optimizers with TorchScript (there, Python reads a copy of their
    state: a resume's or a rollback's writes were lost), the local optimizers are torch.optim ones; writing a
    moment by name reaches the optimizer that steps. See [Note: local optimizers rpcmp can write]."""
    from torch.distributed.optim import optimizer as dist_optim
    from rpcmp.master.move import distributed_optimizer
    from rpcmp.owner import state as stage_state
    plain = scripts or hasattr(dist_optim, "_new_script_local_optimizer")  # this torch scripts them itself
    if scripts:  # what such a torch has; its constructor then asks whether TorchScript is on
        monkeypatch.setattr(dist_optim, "_new_script_local_optimizer", dist_optim._new_local_optimizer, raising=False)
    adam = dataclasses.replace(job, optimizer=(torch.optim.Adam, {"lr": 0.01}))
    serve(adam)
    pipe = rpcmp.Pipeline(adam, world_size=1)
    cls, kwargs = pipe.optimizer_spec
    optim = distributed_optimizer(cls, pipe.param_rrefs, **kwargs)
    assert torch.jit._state._enabled  # on again after the constructor chose
    local = optim.remote_optimizers[0].local_value().optim
    assert isinstance(local, torch.optim.Adam) == plain
    pipe.optimizer = optim
    pipe.train_step(*batches(1)[0])
    state = stage_state.optimizer_state(pipe.pid, optim.remote_optimizers[0])
    name = next(iter(state))
    state[name]["exp_avg"] = torch.full_like(state[name]["exp_avg"], 7.0)
    stage_state.load_optimizer_state(pipe.pid, optim.remote_optimizers[0], {name: state[name]})
    assert torch.equal(stage_state.optimizer_state(pipe.pid, optim.remote_optimizers[0])[name]["exp_avg"],
                       state[name]["exp_avg"])
    pipe.close()


def _spectral(kind: str):
    def model():
        wrap = torch.nn.utils.parametrizations.spectral_norm if kind == "parametrization" else torch.nn.utils.spectral_norm
        return torch.nn.Sequential(wrap(torch.nn.Linear(16, 32)), torch.nn.Tanh(), wrap(torch.nn.Linear(32, 8)))
    return model


@pytest.mark.parametrize("kind", ["parametrization", "hook"])
def test_spectral_norm_trains_as_the_unsplit_model_with_micro_batches(job, kind):
    """Spectral norm's power iteration updates its vectors on every training forward: once per micro-batch, where the
    unsplit model does once a batch, and the model drifted from the unsplit one without a word. Like BatchNorm's
    statistics, a stage that has it now runs each training batch as one micro-batch (Job.batchnorm='batch')."""
    job = dataclasses.replace(job, model=_spectral(kind), stages=rpcmp.Split([2, 1]), optimizer=(torch.optim.Adam, {"lr": 0.01}))
    serve(job)  # the owner builds what this process serves
    data = batches(3)
    torch.manual_seed(job.seed)
    ref_losses, ref_state = train_reference(job.model(), job.optimizer, job.loss, data)
    pipe = rpcmp.Pipeline(job, world_size=1, microbatches=4)
    losses = [pipe.train_step(x, y).item() for x, y in data]
    assert_close_f32(losses, ref_losses)
    assert_close_f32(pipe.state_dict(), ref_state)
    pipe.close()


# A user's own running statistic (tests/jobs/ema.py: an EMA of the features): its training forward writes a buffer
# in place, as BatchNorm's does, but it is no module rpcmp knows by kind.
_RunningMean = type(load("ema").model()[1])


class _Chain(torch.nn.Module):  # not an nn.Sequential: stages given by name are checked against its forward
    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = torch.nn.Linear(16, 32), _RunningMean(32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))


@pytest.mark.parametrize("stages", ["split", "names", "traced"])
def test_a_buffer_the_forward_writes_is_written_once_a_batch_as_by_the_unsplit_model(job, stages):
    """A forward that writes a buffer (a running mean) wrote it once per micro-batch on a split run, where the unsplit
    model does once a batch, and the model drifted without a word. Any buffer the training forward writes is now
    found when the stages are planned, and the run trains each batch as one micro-batch, as for BatchNorm."""
    model, declared = {"split": (lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), _RunningMean(32),
                                                              torch.nn.Linear(32, 8)), rpcmp.Split([2, 1])),
                       "names": (_Chain, ["inp", ("norm", "out")]),
                       "traced": (_Chain, rpcmp.SplitAt("norm"))}[stages]
    pipe = _trained_as_the_unsplit_model(job, model, declared)
    assert pipe.batch_chunks == 1  # as for BatchNorm (Job.batchnorm="batch")
    pipe.close()


def _trained_as_the_unsplit_model(job, model, declared, optimizer=(torch.optim.Adam, {"lr": 0.01})):
    """A pipeline of ``model`` cut as ``declared``, trained 3 steps on 4 micro-batches and checked against the
    unsplit model; open, to look into."""
    job = dataclasses.replace(job, model=model, stages=declared, optimizer=optimizer)
    serve(job)
    data = batches(3)
    torch.manual_seed(job.seed)
    ref_losses, ref_state = train_reference(job.model(), job.optimizer, job.loss, data)
    pipe = rpcmp.Pipeline(job, world_size=1, microbatches=4, sample=data[0][0])
    losses = [pipe.train_step(x, y).item() for x, y in data]
    assert_close_f32(losses, ref_losses)
    assert_close_f32(pipe.state_dict(), ref_state)
    return pipe


class _Detached(torch.nn.Module):  # reads its input through no gradient: a frozen feature
    def forward(self, x):
        return x.detach().tanh()


class _Codes(torch.nn.Module):  # a hard decision: no floating output to carry a gradient back
    def forward(self, x):
        return x.argmax(-1)


class _Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = torch.nn.Linear(16, 32), _Detached(), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.out(self.mid(self.inp(x)))


@pytest.mark.parametrize("stages", ["split", "names", "traced", "codes"])
def test_a_stage_that_takes_no_gradient_of_its_input_trains_as_the_unsplit_model(job, stages):
    """A stage whose forward reads its input only detached left the message that brought it without a gradient,
    and distributed autograd waited for one forever: the step hung. The stages before now get no gradient, as in
    the unsplit model (see [Note: an input the backward never reaches] in rpcmp/owner/reach.py): a Split or names
    plan finds the stage on the meta device, a traced one on fake tensors (rpcmp.plan.unreached), before the first
    step (weight decay tells no gradient from a zero one)."""
    codes = lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), _Codes(), torch.nn.Embedding(32, 32),  # noqa: E731
                                        torch.nn.Linear(32, 8))
    model, declared = {"split": (lambda: torch.nn.Sequential(*_Frozen().children()), rpcmp.Split([1, 2])),
                       "names": (_Frozen, ["inp", ("mid", "out")]), "traced": (_Frozen, rpcmp.SplitAt("mid")),
                       "codes": (codes, rpcmp.Split([1, 1, 2]))}[stages]
    optimizer = (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1})
    job = dataclasses.replace(job, placement=["master/cpu"] * (3 if stages == "codes" else 2))
    pipe = _trained_as_the_unsplit_model(job, model, declared, optimizer)
    assert current().host(pipe.pid, 0).send_detached  # no gradient crosses once the stage is known
    assert not current().host(pipe.pid, 1).cut  # found before the first forward: nothing left to cut there
    pipe.close()


def _layer():
    return torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)


class _TorchEncoder(torch.nn.Module):
    """PyTorch's own transformer: nn.TransformerEncoder deep-copies the layer it is given into each of its layers."""

    def __init__(self):
        super().__init__()
        self.enc, self.out = torch.nn.TransformerEncoder(_layer(), 3, enable_nested_tensor=False), torch.nn.Linear(16, 8)

    def forward(self, x):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(2)
        return self.out(self.enc(x.unflatten(1, (2, 8)), mask=mask, is_causal=True).flatten(1))


@pytest.mark.parametrize("stages", ["split", "traced"])
def test_layers_the_construction_deep_copies_train_as_the_unsplit_model(job, stages):
    """Each owner built the layers nn.TransformerEncoder copies from one layer held in scratch memory: every copy
    had another tensor's values, and the pipeline trained another model (see [Note: copies of a module] in
    rpcmp/plan/copies.py)."""
    model, declared = {
        "split": (lambda: torch.nn.Sequential(torch.nn.Unflatten(1, (2, 8)), *torch.nn.TransformerEncoder(_layer(), 3).layers,
                                              torch.nn.Flatten(), torch.nn.Linear(16, 8)), rpcmp.Split([2, 4])),
        "traced": (_TorchEncoder, rpcmp.SplitAt("enc.layers.1"))}[stages]
    pipe = _trained_as_the_unsplit_model(job, model, declared, (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
    pipe.close()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x, doubled: bool = False):
        y = self.lin(x).tanh()
        return y * 2 if doubled else y


class _Looped(torch.nn.Module):
    """One block called at every depth (ALBERT's shared layer, a universal transformer), with a pipe_split()
    between its second and third calls where ``across``; ``branches``: every other call takes another path."""

    def __init__(self, across: bool = False, branches: bool = False):
        super().__init__()
        self.inp, self.block, self.out = torch.nn.Linear(16, 32), _Block(), torch.nn.Linear(32, 8)
        self.across, self.branches = across, branches

    def forward(self, x):
        x = self.inp(x)
        for i in range(4):
            x = self.block(x, doubled=self.branches and i % 2 == 1)
            if self.across and i == 1:
                from torch.distributed.pipelining import pipe_split
                pipe_split()
        return self.out(x)


@pytest.mark.parametrize("across", [False, True], ids=["within-a-stage", "across-a-cut"])
def test_a_module_forward_calls_more_than_once_trains_as_the_unsplit_model(job, across):
    """pipelining outlines every call of a module but the first as a copy named block@1, block@2, ...: the plan
    refused the split (tensors the model has no name for). The calls are one module again (see [Note: a module
    forward calls more than once] in rpcmp/plan/repeats.py); across a cut, one parameter shared by two stages."""
    declared = rpcmp.SplitAt() if across else rpcmp.SplitAt("out")
    pipe = _trained_as_the_unsplit_model(job, functools.partial(_Looped, across), declared,
                                         (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))  # Adam magnifies rounding
    assert sorted(pipe.state_dict()) == sorted(_Looped().state_dict())
    assert len(pipe.specs) == 2
    pipe.close()


def test_calls_of_one_module_that_trace_to_different_graphs_are_refused_naming_it(job):
    job = dataclasses.replace(job, model=functools.partial(_Looped, branches=True), stages=rpcmp.SplitAt("out"))
    serve(job)
    with pytest.raises(rpcmp.PartitionError, match=r"calls \['block'\] more than once.*different graphs"):
        rpcmp.Pipeline(job, world_size=1, microbatches=4, sample=batches(1)[0][0])


class _Similarity(torch.nn.Module):  # each sample against every other of its batch (CLIP's logits)
    def forward(self, z):
        return z @ z.t()


class _InBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.sim = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh()), _Similarity()

    def forward(self, x):
        return self.sim(self.enc(x))


def _in_batch_negatives(out, y):  # a contrastive loss: each sample's pair is itself, every other is a negative
    return torch.nn.functional.cross_entropy(out, torch.arange(len(out)))


@pytest.mark.parametrize("stages", ["split", "names", "traced"])
def test_a_model_whose_samples_meet_trains_on_whole_batches_as_the_unsplit_model(job, stages):
    """A model whose output holds every sample against every other (in-batch negatives) computed another one per
    micro-batch, and a contrastive loss over it trained another model without a word (see [Note: samples that meet in
    the model] in rpcmp/plan/writes.py): its batches now run whole, as with BatchNorm."""
    model, declared = {"split": (lambda: torch.nn.Sequential(*_InBatch().enc, _Similarity()), rpcmp.Split([2, 1])),
                       "names": (_InBatch, ["enc", "sim"]), "traced": (_InBatch, rpcmp.SplitAt("sim"))}[stages]
    job = dataclasses.replace(job, loss=_in_batch_negatives)
    pipe = _trained_as_the_unsplit_model(job, model, declared, (torch.optim.SGD, {"lr": 0.1}))
    assert pipe.batch_chunks == 1 and pipe.specs[0].mixes
    x = batches(1)[0][0]
    assert pipe.eval().predict(x).shape == (len(x), len(x))  # and predictions, whole too
    pipe.close()


def test_a_buffer_write_the_plan_could_not_find_is_said_at_the_first_step(job, capfd):
    """Stages given as modules hold no whole model to run on the meta device: the owner finds the write at its first
    training forward of several micro-batches, and says that the run trains another model and what to set."""
    stages = [lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), _RunningMean(32)), lambda: torch.nn.Linear(32, 8)]
    job = dataclasses.replace(job, stages=stages)
    serve(job)
    pipe = rpcmp.Pipeline(job, world_size=1, microbatches=4)
    for x, y in batches(2):
        pipe.train_step(x, y)
    pipe.close()
    err = capfd.readouterr().err
    assert err.count("rpcmp: warning: stage 0") == 1, err
    assert "its training forward writes 1.mean on each micro-batch, where the unsplit model writes once a batch" in err
    assert "Job(microbatches=1) trains as the unsplit model" in err
