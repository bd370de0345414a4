"""SplitAt: stages cut from the traced graph compose to the model, with its parameter names."""
import types
from collections import OrderedDict

import pytest
import torch
import torchvision
from torch import nn

import rpcmp
from helpers import load
from rpcmp.errors import PartitionError
from rpcmp.plan.partition import build_stage, plan_stages
from rpcmp.plan.export import trace_split
from rpcmp.plan.writes import detached_note
from rpcmp.plan.traced import run_stages


Classifier = load("traced_classifier").model  # forward is fc2(F.relu(fc1(x)))


def _compose(job, sample):
    specs = plan_stages(job, sample)
    stages = [build_stage(job, s) for s in specs]
    return specs, stages, run_stages(stages, sample)


@pytest.mark.model
def test_a_resnet_cut_in_three_keeps_flatten_and_every_name():
    resnet = lambda: torchvision.models.resnet18(num_classes=10)  # noqa: E731
    job = rpcmp.Job(model=resnet, stages=rpcmp.SplitAt("layer2", "layer4"), microbatches=2)
    x = torch.randn(8, 3, 32, 32)
    specs, stages, out = _compose(job, x)
    assert [s.name for s in specs] == ["input..layer2", "layer2..layer4", "layer4..output"]
    assert all(s.has_bn for s in specs)
    torch.manual_seed(job.seed)
    whole = resnet()
    torch.testing.assert_close(out, whole(x))  # train mode, another batch size than the traced micro-batch
    keys = [k for s in stages for k in s.state_dict()]
    assert sorted(keys) == sorted(whole.state_dict()) and len(keys) == len(set(keys))
    torch.testing.assert_close({k: v for s in stages for k, v in s.state_dict().items()}, whole.state_dict())


def _equals_unsplit(model, point: str, x: torch.Tensor) -> list:
    """The stages of ``model()`` cut at ``point``, after checking that they compute what the unsplit model does."""
    job = rpcmp.Job(model=model, stages=rpcmp.SplitAt(point))
    _, stages, out = _compose(job, x)
    torch.manual_seed(job.seed)
    torch.testing.assert_close(out, model()(x))
    return stages


def test_a_functional_op_in_forward_is_kept():
    _equals_unsplit(Classifier, "fc2", torch.randn(4, 16))


def test_split_at_errors_say_what_and_how():
    with pytest.raises(PartitionError, match=r"has no submodule \['fc3'\]: its children, in order: "
                                             r"\['fc1', 'fc2'\]; close to 'fc3': \['fc2', 'fc1'\]"):
        plan_stages(rpcmp.Job(model=Classifier, stages=rpcmp.SplitAt("fc3")), torch.randn(4, 16))
    layers = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 2))
    deep = nn.Sequential(OrderedDict(blocks=nn.Sequential(OrderedDict(layers=layers))))  # a name that leaves at one level
    with pytest.raises(PartitionError, match=r"has no submodule \['blocks.layer.1'\]: blocks has no child 'layer'; its "
                                             r"children, in order: \['layers'\]; close to 'blocks.layer.1': "
                                             r"\['blocks.layers.1'"):
        plan_stages(rpcmp.Job(model=lambda: deep, stages=rpcmp.SplitAt("blocks.layer.1")), torch.randn(4, 16))
    with pytest.raises(PartitionError, match="the job has no data"):
        plan_stages(rpcmp.Job(model=Classifier, stages=rpcmp.SplitAt("fc2")))

    class DataDependent(Classifier):
        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(h) if h.sum() > 0 else self.fc2(-h)

    with pytest.raises(PartitionError, match=r"tracing DataDependent.forward with torch.export failed.*Data-dependent"):
        plan_stages(rpcmp.Job(model=DataDependent, stages=rpcmp.SplitAt("fc2")), torch.randn(4, 16))


@pytest.mark.model
def test_a_unet_cut_inside_its_encoder_hands_the_skip_features_on():
    import segmentation_models_pytorch as smp
    unet = lambda: smp.Unet("resnet18", encoder_weights=None, in_channels=1, classes=1)  # noqa: E731
    job = rpcmp.Job(model=unet, stages=rpcmp.SplitAt("encoder.layer3", "decoder"), microbatches=2)
    x = torch.randn(4, 1, 64, 64)
    specs, stages, out = _compose(job, x)
    assert [s.name for s in specs] == ["input..encoder.layer3", "encoder.layer3..decoder", "decoder..output"]
    torch.manual_seed(job.seed)
    torch.testing.assert_close(out, unet()(x))
    # see [Note: skip values go straight to their consumer]: the encoder's early features go from stage 0
    # to the decoder's stage in a post of their own; stage 1 receives and sends only what it uses and makes
    first, middle, last = (s.forward for s in stages)
    assert list(first.posts) == [2] and len(first.posts[2]) == 2  # the 2 feature maps only the decoder reads
    assert len(first.chain_out) == 1 and middle.chain_out[0] == first.chain_out[0]  # layer2 out: read by both
    assert not middle.mail_in and last.mail_in == first.posts[2]


def test_a_graph_that_fixes_the_batch_size_is_refused():
    class Pairs(nn.Module):  # folds the batch into a fixed number of rows
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Linear(8, 16), nn.Linear(32, 2)

        def forward(self, x):
            return self.head(self.emb(x).reshape(1, 32))

    with pytest.raises(PartitionError, match=r"fixes the batch size it was traced with \(2 samples per micro-batch\)"):
        plan_stages(rpcmp.Job(model=Pairs, stages=rpcmp.SplitAt("head"), microbatches=2), torch.randn(4, 8))


def test_a_graph_whose_shapes_follow_its_values_is_cut_and_runs_as_the_unsplit_model():
    """An expert that takes only the rows its gate picks (``nonzero``): the any-batch-size check runs the traced graph
    on fake tensors, which hold no values, and stopped the plan with ``DynamicOutputShapeException``; such a graph is
    not checked, and the stages equal the unsplit model at any batch size."""
    class Picked(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.gate, self.expert, self.head = (nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(16, 16),
                                                           nn.Linear(16, 2))

        def forward(self, x):
            h = self.emb(x)
            picked = (self.gate(h).squeeze(-1) > 0).nonzero().squeeze(-1)
            return self.head(h.index_add(0, picked, self.expert(h[picked])))

    job = rpcmp.Job(model=Picked, stages=rpcmp.SplitAt("expert", "head"), microbatches=2)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    stages = [build_stage(job, s) for s in plan_stages(job, x)]
    torch.manual_seed(job.seed)
    whole = Picked()
    for n in (1, 3, 6):
        torch.testing.assert_close(run_stages(stages, x[:n]), whole(x[:n]))


def test_the_plan_has_a_value_a_later_stage_reads_only_through_a_comparison_sent_detached():
    """tests/jobs/gated.py: stage 1 reads ``g`` only through ``g > 0`` (found on fake tensors: rpcmp.plan.unreached);
    gated_post.py: stage 2 so reads the value stage 0 posts to it; gated_names.py: gated.py cut by names (found on
    the meta device: rpcmp.plan.writes.meta_findings); codes.py: stage 1 outputs only argmax codes, so nothing stage
    0 sends is reached."""
    for name, detached, values, posts in (("gated", False, (1,), 0), ("gated_post", False, (), 1),
                                          ("gated_names", False, (1,), 0), ("codes", True, (), 0)):
        job = load(name)
        specs = plan_stages(job, job.data()[0][:job.batch_size][0])
        assert (specs[0].detached, specs[0].detached_values) == (detached, values), name
        assert [j for j, _ in specs[0].detached_posts] == [2] * posts, name
        assert all((s.detached, s.detached_values, s.detached_posts) == (False, (), ()) for s in specs[1:]), name
        if posts:
            assert "stage 2 takes no gradient of the value" in detached_note(specs[0])


@pytest.mark.model
def test_attention_is_traced_for_any_batch_size():
    """nn.MultiheadAttention reshapes by the batch size: traced with a dynamic batch dimension,
    the stages run any micro-batch size and equal the unsplit model."""
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.attn, self.head = nn.Linear(8, 16), nn.MultiheadAttention(16, 4, batch_first=True), nn.Linear(16, 2)

        def forward(self, x):
            h = self.emb(x)
            return self.head(h + self.attn(h, h, h, need_weights=False)[0])

    job = rpcmp.Job(model=Attention, stages=rpcmp.SplitAt("attn", "head"), microbatches=2)
    specs = plan_stages(job, torch.randn(4, 5, 8))
    stages = [build_stage(job, s) for s in specs]
    torch.manual_seed(job.seed)
    model = Attention()
    for n in (1, 3, 7):
        x = torch.randn(n, 5, 8)
        torch.testing.assert_close(run_stages(stages, x), model(x))


@pytest.mark.model
def test_several_inputs_and_outputs_travel_through_the_cut():
    """A model that takes a dict of two tensors and returns a tuple of two heads, cut in three:
    the inputs reach the stages that use them and both outputs come out, as the unsplit model's."""
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.image, self.side = nn.Linear(8, 16), nn.Linear(3, 16)
            self.trunk, self.cls, self.box = nn.Linear(16, 16), nn.Linear(16, 5), nn.Linear(16, 4)

        def forward(self, batch):
            h = torch.relu(self.image(batch["image"]))
            h = self.trunk(h) * torch.sigmoid(self.side(batch["meta"]))  # the second input, used two stages in
            return self.cls(h), self.box(h)

    job = rpcmp.Job(model=TwoHeads, stages=rpcmp.SplitAt("side", "cls"), microbatches=2)
    batch = {"image": torch.randn(4, 8), "meta": torch.randn(4, 3)}
    stages = [build_stage(job, s) for s in plan_stages(job, batch)]
    torch.manual_seed(job.seed)
    model = TwoHeads()
    x = {"image": torch.randn(5, 8), "meta": torch.randn(5, 3)}
    torch.testing.assert_close(run_stages(stages, x), model(x))


class _Reused(nn.Module):
    """``b`` is called twice, ``spare`` never."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.spare = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.c(self.b(self.b(self.a(x))))


class _Looped(_Reused):
    """Its blocks in an ``nn.ModuleList``, called one by one (PoolFormer's stages hold lists of blocks so)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]) for _ in range(2)])

    def forward(self, x):
        for stage in self.blocks:
            for block in stage:
                x = block(x)
        return self.c(x)


@pytest.mark.model
@pytest.mark.parametrize("model, points, said", [
    (_Reused, ("c", "a"), r"reaches the points in the order \('a', 'c'\): name them in that order"),
    (_Reused, ("b",), r"calls \['b'\] more than once; a split point must be a module forward calls once"),
    (_Reused, ("spare",), r"never calls \['spare'\]: a module forward does not call .* cannot be a point"),
    (_Looped, ("blocks.1",), r"never calls \['blocks.1'\]: blocks.1 is a ModuleList, whose blocks forward calls one "
                             r"by one; cut before one of them \('blocks.1.0', 'blocks.1.1'\)"),
])
def test_split_points_are_modules_forward_calls_once_named_in_its_order(model, points, said):
    """Stages are named after their points: another order named every stage wrongly, a point called twice
    or never gave another number of stages than asked for, without a word; a list of blocks, never called
    itself, is said with the blocks to cut at instead."""
    job = rpcmp.Job(model=model, stages=rpcmp.SplitAt(*points), microbatches=2)
    with pytest.raises(PartitionError, match=said):
        plan_stages(job, torch.randn(4, 4))


@pytest.mark.model
def test_points_that_leave_a_stage_without_an_operation_are_refused_naming_it():
    """pipelining makes no module for a stage that computes nothing: 'GraphModule' object has no attribute ..."""
    job = rpcmp.Job(model=lambda: nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 2)),
                    stages=rpcmp.SplitAt("1", "2"), microbatches=2)
    with pytest.raises(PartitionError, match=r"SplitAt\('1', '2'\): the stage from '1' to '2' holds no operation of "
                                             r"Sequential.forward .* leave out one of its points"):
        plan_stages(job, torch.randn(4, 4))


class _ByKey(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, batch):
        return self.b(self.a(batch["x"]))


def test_a_batch_holding_what_is_not_a_tensor_is_refused_naming_it():
    """A dataset's sample names, kept beside the tensors by the default collate (a list of str): the trace would
    take the first batch's names as constants. It failed with "AttributeError: 'str' object has no attribute
    'shape'" from inside rpcmp."""
    job = rpcmp.Job(model=_ByKey, stages=rpcmp.SplitAt("b"), microbatches=2)
    with pytest.raises(PartitionError, match=r"batch\['name'\]\[0\] is a str \('a'\).*Leave it out of the model's input"):
        plan_stages(job, {"x": torch.randn(4, 4), "name": ["a", "b", "c", "d"]})


def test_a_split_point_named_twice_is_refused_at_once():
    with pytest.raises(PartitionError, match=r"names \['h.2'\] more than once"):
        rpcmp.SplitAt("h.2", "h.4", "h.2")


@pytest.mark.model
@pytest.mark.parametrize("shape", ["model_output", "dict", "one_tuple", "tensor"])
def test_the_last_stage_returns_the_output_as_the_model_returns_it(shape):
    """pipelining's split graph flattens the model's output; a loss written for the unsplit model
    (``out.logits``, ``out["aux"]``, ``out[0]``) must read the split one alike."""
    from transformers.modeling_outputs import CausalLMOutput

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            logits = self.c(torch.relu(self.b(self.a(x))))
            return {"model_output": lambda: CausalLMOutput(logits=logits), "dict": lambda: {"logits": logits, "aux": x.sum(1)},
                    "one_tuple": lambda: (logits,), "tensor": lambda: logits}[shape]()

    job = rpcmp.Job(model=Heads, stages=rpcmp.SplitAt("b", "c"), microbatches=2)
    stages = [build_stage(job, s) for s in plan_stages(job, torch.randn(4, 8))]
    torch.manual_seed(job.seed)
    model = Heads()
    x = torch.randn(5, 8)
    got, want = run_stages(stages, x), model(x)
    assert type(got) is type(want), (type(got), type(want))
    torch.testing.assert_close(got, want)


@pytest.mark.model
@pytest.mark.parametrize("family", ["mobilenet_v3_small"])
def test_a_traced_stage_in_eval_mode_runs_the_eval_graph(family):
    """Traced in train mode, BatchNorm would keep normalising with batch statistics (and updating the
    running ones) after .eval(): see [Note: a traced stage in eval mode]. Each stage switches graphs."""
    kwargs = {"dropout": 0.0} if family == "mobilenet_v3_small" else {}  # train mode compared too: no random masks
    factory = lambda: getattr(torchvision.models, family)(num_classes=10, **kwargs)  # noqa: E731
    points = {"mobilenet_v3_small": ("features.4", "features.9"),
              "densenet121": ("features.denseblock2", "features.denseblock4")}[family]
    job = rpcmp.Job(model=factory, stages=rpcmp.SplitAt(*points), microbatches=2)
    x = torch.randn(4, 3, 64, 64)
    stages = [build_stage(job, s) for s in plan_stages(job, x)]
    torch.manual_seed(job.seed)
    model = factory()
    with torch.no_grad():
        for stage in stages:
            stage.eval()
        torch.testing.assert_close(run_stages(stages, x[:3]), model.eval()(x[:3]))
        before = {k: v.clone() for s in stages for k, v in s.state_dict().items()}
        run_stages(stages, x)
        assert all(torch.equal(v, before[k]) for s in stages for k, v in s.state_dict().items())  # no statistics moved
        for stage in stages:
            stage.train()
        torch.testing.assert_close(run_stages(stages, x), model.train()(x))  # and back to the training graph


def test_a_second_plan_of_the_same_job_and_batch_shape_reuses_the_trace(monkeypatch):
    import dataclasses
    import rpcmp.plan.export as export
    traced = []
    monkeypatch.setattr(export, "trace_split", lambda *a, **k: traced.append(1) or trace_split(*a, **k))
    job = rpcmp.Job(model=lambda: Classifier(), stages=rpcmp.SplitAt("fc2"))  # a factory no other test planned
    x = torch.randn(4, 16)
    first, once = plan_stages(job, x), len(traced)
    assert once and plan_stages(job, x) == first and len(traced) == once  # a second Pipeline: not traced again
    assert plan_stages(dataclasses.replace(job, wire="bf16"), x) == first and len(traced) == once  # what it traces
    for other, sample in ((job, torch.randn(8, 16)), (dataclasses.replace(job, seed=1), x)):  # another shape, seed
        before = len(traced)
        assert len(plan_stages(other, sample)) == 2 and len(traced) > before
    before = len(traced)
    job.model = lambda: Classifier()  # the job changed in place: traced again
    assert len(plan_stages(job, x)) == 2 and len(traced) > before


class _Dropped(nn.Module):
    def __init__(self, p: float | None):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 8), nn.Linear(8, 2)
        self.drop = nn.Dropout(p) if p is not None else nn.Identity()

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("p,one", [(None, True), (0.0, True), (0.5, False)], ids=["no-dropout", "p0", "p0.5"])
def test_an_owner_builds_the_master_s_graphs_or_traces_once_where_both_modes_trace_alike(monkeypatch, p, one):
    import dataclasses
    import rpcmp.plan.export as export
    job = rpcmp.Job(model=lambda: _Dropped(p), stages=rpcmp.SplitAt("fc2"))
    x = torch.randn(6, 16)
    specs = plan_stages(job, x)
    assert all(s.one_graph is one for s in specs) and all(s.graphs for s in specs)  # dropout(x, 0, train) is x
    monkeypatch.setattr(export, "_TRACES", type(export._TRACES)())  # an owner's process: nothing traced yet
    traced = []
    monkeypatch.setattr(export, "trace_split", lambda *a, **k: traced.append(1) or trace_split(*a, **k))
    shipped = [build_stage(job, s) for s in specs]
    assert traced == []  # built from the graphs the master traced
    own = [build_stage(job, dataclasses.replace(s, graphs=b"")) for s in specs]  # graphs the master could not write
    assert len(traced) == (1 if one else 2)
    torch.manual_seed(job.seed)
    model = _Dropped(p)
    for stages in (shipped, own):
        for mode in ("eval", "train") if p != 0.5 else ("eval",):  # p=0.5: random masks in train mode
            for module in (*stages, model):
                getattr(module, mode)()
            torch.testing.assert_close(run_stages(stages, x), model(x))


class _ByDevice(nn.Module):
    """Chooses its path by the device type of its input, as transformers' grouped experts of MoE models do."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)])

    def forward(self, x):
        h = self.layers[0](x)
        return self.layers[1](h * 2 if h.device.type == "cpu" else h * 3)


def test_a_forward_that_chooses_by_device_type_is_traced_as_on_the_cpu():
    _equals_unsplit(_ByDevice, "layers.1", torch.randn(4, 4))


def test_a_traced_stage_s_missing_kernel_says_how_it_was_traced():
    from rpcmp.plan.graphs import described
    exc = NotImplementedError("\"histogram_cpu\" not implemented for 'Int'\n\nWhile executing %histc ...")
    got = described(types.SimpleNamespace(kind="traced"), exc)
    assert got.startswith("NotImplementedError: \"histogram_cpu\" not implemented for 'Int'. The stage's graph was "
                          "traced as on the CPU")
    assert got.endswith("While executing %histc ...")
    assert described(types.SimpleNamespace(kind="names"), exc) == f"NotImplementedError: {exc}"
    assert described(types.SimpleNamespace(kind="traced"), ValueError("x")) == "ValueError: x"


def test_a_compiled_model_is_split_as_the_module_it_wraps_with_its_names():
    job = rpcmp.Job(model=lambda: torch.compile(Classifier()), stages=rpcmp.SplitAt("fc2"))
    x = torch.randn(4, 16)
    with pytest.warns(UserWarning, match="torch.compile'd module: rpcmp splits the module it wraps"):
        specs, stages, out = _compose(job, x)
    assert [n for s in stages for n, _ in s.named_parameters()] == [n for n, _ in Classifier().named_parameters()]
    torch.manual_seed(job.seed)
    torch.testing.assert_close(out, Classifier()(x))


class _Autocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        x = self.inp(x)
        with torch.autocast("cpu", enabled=False):  # as a model does to keep a part in float32
            x = torch.tanh(self.mid(x.float()))
        return self.out(x)


@pytest.mark.parametrize("point", ["mid", "out"])
def test_an_autocast_block_is_refused_saying_why_and_what_to_do(point):
    """pipelining's split loses a block that changes a global mode; the trace failed with an AttributeError and rpcmp
    blamed data-dependent control flow, which the model does not have."""
    with pytest.raises(PartitionError, match=r"changes a global mode in a block \(`with torch.autocast.*pytorch#164030.*"
                                             r"declare the stages by name or as modules"):
        trace_split(_Autocast().to("meta"), rpcmp.SplitAt(point), torch.randn(4, 8, device="meta"))


def _gpt2_with_an_ema():
    import transformers
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4,
                                                                 n_head=4, use_cache=False))
    running_mean = type(load("ema").model()[1])  # tests/jobs/ema.py
    model.transformer.ln_f = nn.Sequential(model.transformer.ln_f, running_mean(32))
    return model


@pytest.mark.model
def test_a_traced_plan_finds_a_buffer_write_where_the_forward_cannot_run_on_the_meta_device():
    """A Hugging Face model reads values in its forward (`.item()`), so the meta-device run that finds buffer writes
    fails on it; a SplitAt plan finds the write in its graphs instead (an EMA after the last block)."""
    from rpcmp.plan.writes import Found, meta_findings
    job = rpcmp.Job(model=_gpt2_with_an_ema, stages=rpcmp.SplitAt("transformer.h.2"))
    x = torch.randint(0, 64, (4, 12))
    assert meta_findings(job, x) == Found()  # nothing known
    assert all(s.writes == ("transformer.ln_f.1.mean",) for s in plan_stages(job, x))


def test_traces_made_at_once_by_several_threads_of_one_process_each_succeed():
    """A trace swaps pipelining's tracing functions for rpcmp's while it runs: two at once in one process (two
    pipelines built from two threads) took each other's, and failed in torch.export (SymInt 'not tracked with
    proxy', '_EXPORT_MODULE_HIERARCHY must not be None'). They now take turns."""
    import dataclasses
    import threading
    from rpcmp.plan.export import traces
    from rpcmp.plan.traced import example_of
    job, failed = load("nanogpt"), []

    def trace(seed):
        try:
            traces(dataclasses.replace(job, seed=seed), example_of(torch.randint(0, 16, (2, 8))), eval_too=False)
        except Exception as exc:  # noqa: BLE001 - the finding is any failure
            failed.append(exc)
    threads = [threading.Thread(target=trace, args=(seed,)) for seed in (101, 102, 103)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed, failed[0]


class _FixedBatch(nn.Module):
    def forward(self, x):
        return x.view(8, 32)  # the batch size written into forward


def test_what_the_meta_run_finds_stands_for_a_forward_that_fixes_its_batch_size():
    """The run on one sample more (which finds the samples that meet) fails on such a forward; the buffer write the
    two runs before found is kept, and that output is not called one whose samples meet."""
    from rpcmp.plan.writes import meta_findings
    running_mean = type(load("ema").model()[1])
    job = rpcmp.Job(model=lambda: nn.Sequential(nn.Linear(16, 32), running_mean(32), _FixedBatch()),
                    stages=rpcmp.Split([2, 1]))
    found = meta_findings(job, torch.randn(8, 16))
    assert found.writes == ("1.mean",) and found.mixes == ()


def _gpt2_checkpointed(reentrant: bool):
    import transformers
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4,
                                                                 n_head=4, use_cache=False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


@pytest.mark.model
def test_layers_checkpointed_with_use_reentrant_are_refused_saying_what_to_change():
    """Such a model was refused for fixing its batch size or for data-dependent control flow (traced with the size it
    was given), with advice that did not name the cause; the refusal now says it, and the setting that traces."""
    import functools
    x = torch.randint(0, 64, (4, 12))
    job = rpcmp.Job(model=functools.partial(_gpt2_checkpointed, True), stages=rpcmp.SplitAt("transformer.h.2"))
    with pytest.raises(PartitionError, match=r"GPT2LMHeadModel checkpoints its layers with use_reentrant=True.*which "
                                             r"torch.export cannot trace.*'use_reentrant': False.*Job\(recompute=True\)"):
        plan_stages(job, x)
    import dataclasses
    assert len(plan_stages(dataclasses.replace(job, model=functools.partial(_gpt2_checkpointed, False)), x)) == 2
