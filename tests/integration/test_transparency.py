"""Transparency: training through rpcmp == training the unsplit model in one process.

Real processes, real TensorPipe RPC, distributed autograd and DistributedOptimizer.
One process tree runs every (stages, micro-batches, optimizer, schedule) case, each on
a fresh Pipeline, so the matrix stays fast.
"""
import dataclasses

import pytest
import torch

import rpcmp
from helpers import Command, assert_close_f32, batches, job_path, load, run_ranks, train_reference

pytestmark = pytest.mark.integration

STEPS = 3
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), "adam": (torch.optim.Adam, {"lr": 0.01})}
SPLITS = {2: [3, 4], 3: [2, 3, 2]}
CASES = [(m, opt, sched) for m in (1, 2, 4) for opt in OPTIMIZERS for sched in ("overlap", "gpipe")]
CASES += [(4, opt, "1f1b") for opt in OPTIMIZERS]  # M > S: micro-batch i waits for i - S


def _train_all(job, world_size):
    results = {}
    data = batches(STEPS)
    for stages, balance in SPLITS.items():
        variant = dataclasses.replace(job, stages=rpcmp.Split(balance))
        for m, opt, sched in CASES:
            pipe = rpcmp.Pipeline(variant, world_size, microbatches=m, optimizer=OPTIMIZERS[opt], schedule=sched)
            first_out = pipe.predict(data[0][0])
            losses = [pipe.train_step(x, y).item() for x, y in data]
            results[(stages, m, opt, sched)] = (first_out, losses, pipe.state_dict(), [str(p) for p in pipe.places])
            pipe.close()
    return results


@pytest.fixture(scope="module")
def split_runs():
    return run_ranks("mlp", 3, _train_all, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stages", sorted(SPLITS))
@pytest.mark.parametrize("m,opt,sched", CASES)
def test_split_training_matches_one_process(split_runs, stages, m, opt, sched):
    job = load("mlp")
    torch.manual_seed(job.seed)
    model = job.model()
    first_out = model(batches(1)[0][0]).detach()
    ref_losses, ref_state = train_reference(model, OPTIMIZERS[opt], job.loss, batches(STEPS))
    out, losses, state, places = split_runs[(stages, m, opt, sched)]
    assert len(places) == stages and len(set(p.split("/")[0] for p in places)) == stages
    assert_close_f32(out, first_out)
    assert_close_f32(losses[0], ref_losses[0])
    assert_close_f32(losses, ref_losses)
    assert_close_f32(state, ref_state)


def _five_builds(job, world_size):
    states = []
    for _ in range(5):
        pipe = rpcmp.Pipeline(job, world_size)
        states.append(pipe.state_dict())
        pipe.close()
    return states


@pytest.mark.timeout(300)
def test_two_stages_on_one_process_start_from_the_seeded_unsplit_model_every_time():
    # Both stages live on worker1; their builds must not interleave the global RNG.
    states = run_ranks("slow_build", 2, _five_builds, timeout=240)
    job = load("slow_build")
    torch.manual_seed(job.seed)
    ref = job.model().state_dict()
    for state in states:
        assert_close_f32(state, ref, rtol=0, atol=0)


# NAdam has no functional twin in torch: its local optimizers are torch.optim ones, which torch's own
# step leaves holding the last gradient of a parameter; SGD's are functional (see [Note: a parameter a
# step did not reach] in rpcmp/master/move.py).
ADAM = (torch.optim.Adam, {"lr": 0.01})
SKIPPING_OPTIMIZERS = {"nadam": (torch.optim.NAdam, {"lr": 0.01}), "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}


def _signed():
    """Three steps; the second's inputs all negative: the gate's scale gets no gradient in it."""
    (x1, y1), (x2, y2), (x3, y3) = batches(3)
    return [(x1.abs(), y1), (-x2.abs(), y2), (x3.abs(), y3)]


def _skipping(job, world_size):
    out = {}
    for m in (1, 2):
        for name, opt in SKIPPING_OPTIMIZERS.items():
            pipe = rpcmp.Pipeline(job, world_size, microbatches=m, optimizer=opt)
            out[(m, name)] = ([pipe.train_step(x, y).item() for x, y in _signed()], pipe.state_dict())
            pipe.close()
    return out


@pytest.mark.timeout(300)
def test_a_parameter_a_step_does_not_reach_is_left_alone_as_by_the_unsplit_model():
    """tests/jobs/branchy.py's gate uses its scale on inputs of a positive sum only: the unsplit model, its
    gradients zeroed to None, does not update the scale in the negative step, with any optimizer."""
    runs = run_ranks("branchy", 3, _skipping, timeout=240)
    job = load("branchy")
    for (m, name), got in runs.items():
        torch.manual_seed(job.seed)
        assert_close_f32(got, train_reference(job.model(), SKIPPING_OPTIMIZERS[name], job.loss, _signed()),
                         msg=lambda text, m=m, name=name: f"{name}, {m} micro-batches: {text}")


def _frozen(job, world_size):
    pipe = rpcmp.Pipeline(dataclasses.replace(job, optimizer=ADAM), world_size, microbatches=4)
    out = [pipe.train_step(x, y).item() for x, y in _batches(job)], pipe.state_dict()
    pipe.close()
    return out


def _batches(job):
    train = job.data()[0]
    return [train[i * 8:(i + 1) * 8] for i in range(4)]


@pytest.mark.timeout(300)
def test_a_stage_that_takes_no_gradient_of_its_input_trains_as_the_unsplit_model_across_processes():
    """tests/jobs/frozen.py's middle stage reads its input detached: over processes the step failed (the first
    stage's merge found no gradient of a micro-batch); the first stage now gets none, as in the unsplit model. No
    batch reaches the plan here: the stage is found at its first forward (Adam's update of those zeros is zero)."""
    got = run_ranks("frozen", 4, _frozen, timeout=240)
    job = load("frozen")
    torch.manual_seed(job.seed)
    assert_close_f32(got, train_reference(job.model(), ADAM, job.loss, _batches(job)))


def _codes(job, world_size):
    pipe = rpcmp.Pipeline(job, world_size)
    out = [pipe.train_step(x, y).item() for x, y in _batches(job)], pipe.state_dict(), pipe.specs[0].detached
    pipe.close()
    return out


@pytest.mark.timeout(200)
def test_a_traced_stage_that_outputs_only_codes_after_a_stage_in_the_master_s_process_trains_as_the_unsplit_model():
    """tests/jobs/codes.py: the master's own backward waited forever for a gradient of what its stage sent to the
    codes' stage (distributed autograd waits for every send of the process that starts the backward). The traced
    plan now sees that the stage outputs no floating tensor, and the stage before sends detached from the first
    step: no gradient, as in the unsplit model (weight decay would move a parameter given a zero one)."""
    losses, state, detached = run_ranks("codes", 3, _codes, timeout=120)
    job = load("codes")
    torch.manual_seed(job.seed)
    assert detached
    assert_close_f32((losses, state), train_reference(job.model(), job.optimizer, job.loss, _batches(job)))
    torch.manual_seed(job.seed)
    initial = job.model().state_dict()
    assert torch.equal(state["inp.weight"], initial["inp.weight"])  # no gradient reached it, as unsplit


def _gated(job, world_size):
    pipe = rpcmp.Pipeline(job, world_size)
    out = [pipe.train_step(x, y).item() for x, y in _batches(job)], pipe.state_dict()
    pipe.close()
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name, ranks", [("gated", 3), ("gated_post", 4), ("gated_decay", 3), ("gated_names", 3)])
def test_a_received_value_read_only_through_a_comparison_beside_a_reached_one_trains_as_the_unsplit_model(name, ranks):
    """tests/jobs/gated.py, gated_post.py: a stage reads a value (sent with the chain, or posted past a stage) only
    through ``g > 0`` and the chain value through differentiable ops. Any unreached message had the stage before
    told to send its output detached: posted, the step waited forever (the stages before lost their gradient).
    gated_decay.py, with weight decay: sent with a gradient, the gate came back with zeros and its weights decayed,
    where the unsplit model gives them no gradient; the plan now has it sent detached (gated_post.py: posted;
    gated_names.py: cut by names)."""
    got = run_ranks(name, ranks, _gated, timeout=120)
    job = load(name)
    torch.manual_seed(job.seed)
    assert_close_f32(got, train_reference(job.model(), job.optimizer, job.loss, _batches(job)))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name, local, says", [
    ("frozen", "4", "stage 1 takes no gradient of stage 0's output (its forward reads it through detach, no_grad or an "
                    "op without one): stage 0 gets none and keeps its first values, as in the unsplit model"),
    ("in_batch", "3", "the model's samples meet each other (output (8, 8): a dimension after the first follows the "
                      "batch size): each batch runs as 1 micro-batch")])
def test_the_run_says_what_the_plan_found_in_the_model(name, local, says):
    """Often a mistake in the model (a stray detach), or a model that cannot be pipelined as it is (in-batch
    negatives): the banner says it before the first step."""
    proc = Command("run", job_path(name), "--local", local, "--max-steps", "2", merged=True)
    try:
        out, _ = proc.communicate(timeout=150)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert says in " ".join(out.split())


def _timed_split(job, world_size):
    pipe = rpcmp.Pipeline(dataclasses.replace(job, stages=rpcmp.Split(parts=2, by="time")), world_size)
    x, y = job.data()[0][:8]
    loss = pipe.train_step(x, y).item()
    specs = [(s.start, s.stop) for s in pipe.specs]
    pipe.close()
    return specs, loss


@pytest.mark.timeout(300)
def test_a_pipeline_balanced_by_time_draws_its_sample_from_the_job():
    specs, loss = run_ranks("mlp", 3, _timed_split, timeout=240)
    assert specs[0][0] == 0 and specs[-1][1] == 7 and len(specs) == 2 and loss > 0


def _remote_modules(job, world_size):
    from torch.distributed.nn import RemoteModule
    pipe = rpcmp.Pipeline(job, world_size)
    x = batches(1)[0][0]
    kinds = [isinstance(s, RemoteModule) for s in pipe.stages]
    owners = [s.get_module_rref().owner().name for s in pipe.stages]
    h = x
    for stage in pipe.stages:  # the stages, called one by one through PyTorch's RPC API
        h = stage.forward_async(h).wait()
    names = [len(s.remote_parameters()) for s in pipe.stages]
    whole = pipe.predict(x)
    pipe.close()
    return kinds, owners, h, whole, names


@pytest.mark.timeout(300)
def test_stages_are_remote_modules_on_their_owners():
    kinds, owners, chained, whole, params = run_ranks("mlp", 3, _remote_modules, timeout=240)
    assert kinds == [True, True] and owners == ["worker1", "worker2"]
    assert params == [4, 6]  # Linear + LayerNorm in stage 0; 3 Linear in stage 1
    assert_close_f32(chained, whole, rtol=0, atol=0)


# Small steps: random labels on ResNet-18 at lr 0.1 diverge within 3 steps, where float32 rounding
# (another thread count, another conv kernel) grows past any tolerance.
TRACED_OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}), "adam": (torch.optim.Adam, {"lr": 1e-3})}


TRACED = [(opt, sched) for opt in ("sgd", "adam") for sched in ("overlap", "1f1b", "gpipe")]
# A model with BatchNorm runs each batch as one micro-batch (Job.batchnorm="batch"), where the schedules
# do the same work: one schedule per optimizer is enough there.
TRACED_BN = [("sgd", "overlap"), ("adam", "gpipe")]


def _train_traced(job, world_size):
    from rpcmp.plan.materialize import meta_model
    from rpcmp.plan.partition import has_batch_state
    train, _ = job.data()
    data = [train[i * job.batch_size:(i + 1) * job.batch_size] for i in range(STEPS)]
    out = {}
    for opt, sched in TRACED_BN if has_batch_state(meta_model(job)) else TRACED:
        pipe = rpcmp.Pipeline(job, world_size, optimizer=TRACED_OPTIMIZERS[opt], schedule=sched)
        losses = [pipe.train_step(x, y).item() for x, y in data]
        out[(opt, sched)] = (losses, pipe.state_dict(), [s.name for s in pipe.specs], pipe.batch_chunks)
        pipe.close()
    return out, data


@pytest.mark.timeout(400)
@pytest.mark.parametrize("model,stages", [("resnet", 3), ("classifier", 2), ("unet", 3), ("transformer", 3)])
def test_split_at_trains_as_the_unsplit_model(model, stages):
    """ResNet-18 (flatten, residual adds, BatchNorm), a classifier with F.relu in forward and the
    smp Unet cut inside its encoder (skip features cross stages), cut on the traced graph: params
    after 3 steps equal the unsplit model's, with its keys."""
    # One intra-op thread everywhere: convolutions then use the same kernels in the stages and in the
    # reference, and Adam (which turns a rounding difference in a near-zero gradient into a step of
    # size lr) sees the same gradients.
    runs, data = run_ranks(f"traced_{model}", stages, _train_traced, overrides={"threads": 1}, timeout=360)
    job = load(f"traced_{model}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = {}
        for opt, optimizer in TRACED_OPTIMIZERS.items():
            torch.manual_seed(job.seed)
            refs[opt] = train_reference(job.model(), optimizer, job.loss, data)
    finally:
        torch.set_num_threads(threads)
    for (opt, sched), (losses, state, names, chunks) in runs.items():
        ref_losses, ref_state = refs[opt]
        assert len(names) == stages and chunks == (1 if model in ("resnet", "unet") else 4)  # BatchNorm: whole batch
        assert sorted(state) == sorted(ref_state)  # the unsplit model's keys, all of them
        assert_close_f32(losses, ref_losses, msg=lambda m: f"{model} {opt} {sched}: {m}")
        assert_close_f32(state, ref_state, msg=lambda m: f"{model} {opt} {sched}: {m}")
