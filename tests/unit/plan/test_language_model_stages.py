"""In-process checks of language models cut on their traced graph: every tensor of every stage
(parameters, buffers, non-persistent buffers, constants) by name against the unsplit model, the
graphs placed on the owner's device, shared and unused parameters, and which input sizes may
change. No processes: the stages are built here as their owners build them."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import rpcmp
from rpcmp.plan.materialize import graph_constants, tensor_table
from rpcmp.plan.partition import build_stage, plan_stages
from rpcmp.master.tied import describe, norm_skips, shared_groups
from rpcmp.plan.lengths import check_sizes
from rpcmp.plan.graphs import graph_devices
from rpcmp.plan.traced import run_stages

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "jobs"))
from helpers import job_path, load, same_built_graphs  # noqa: E402

MODELS = ("nanogpt", "hf_gpt2", "hf_llama")


def _plan(job, length=16):
    train, _ = job.data()
    return plan_stages(job, train[:job.batch_size][0][:, :length])


pytestmark = pytest.mark.model  # every test here traces a language model

@pytest.fixture(scope="module", params=MODELS)
def built(request):
    """Each model's plan, its stages built as their owners build them, and the unsplit model."""
    job = load(request.param)
    specs = _plan(job)
    stages = [build_stage(job, spec) for spec in specs]
    torch.manual_seed(job.seed)
    return request.param, job, specs, stages, job.model()


def test_every_tensor_of_every_stage_has_the_unsplit_models_value(built):
    name, job, specs, stages, whole = built
    reference = tensor_table(whole)
    seen, keys = set(), set()
    for spec, stage in zip(specs, stages):
        keys |= set(stage.state_dict())
        for module in (stage, stage.forward.eval_forward.__self__):  # the train and the eval graph
            for key, t in tensor_table(module).items():
                assert not t.is_meta, f"{name} stage {spec.index}: {key} is on the meta device"
                torch.testing.assert_close(t, reference[key], rtol=0, atol=0, msg=f"{name} stage {spec.index}: {key}")
                seen.add(key)
            for key in graph_constants(module):
                value = module.get_submodule(key.rpartition(".")[0]) if "." in key else module
                value = getattr(value, key.rpartition(".")[2])
                assert not value.is_meta, f"{name} stage {spec.index}: constant {key} is on the meta device"
            assert all(d == "cpu" for d in graph_devices(module).values()), graph_devices(module)
    assert seen == set(reference)  # every tensor of the model is on some stage, under its own names
    assert keys == set(whole.state_dict())  # non-persistent buffers (RoPE's inv_freq) stay out, as in the plain model


def test_the_stages_are_built_from_the_graphs_the_master_traced_node_for_node(built):
    name, job, specs, _, _ = built
    assert all(s.graphs for s in specs) and same_built_graphs(job, specs), name


def test_the_stages_take_any_sequence_length_and_predict_as_the_unsplit_model(built):
    name, job, specs, stages, whole = built
    assert all(size is None for size in specs[0].sizes[0][1:])  # dimension 1 traced as dynamic
    stages = [s.eval() for s in stages]
    whole.eval()
    g = torch.Generator().manual_seed(3)
    for length in (16, 24, 9, 1):
        x = torch.randint(0, 64, (3, length), generator=g)
        with torch.no_grad():
            torch.testing.assert_close(run_stages(stages, x), whole(x), msg=f"{name} at length {length}")


def test_tied_weights_across_stages_are_one_group_counted_once_by_the_norm():
    specs = _plan(load("hf_gpt2"))
    assert shared_groups(specs) == {"m.transformer.wte.weight": [(0, "m.transformer.wte.weight"),
                                                                 (2, "m.lm_head.weight")]}
    assert norm_skips(specs) == {2: {"m.lm_head.weight"}}
    assert describe(specs) == ["m.transformer.wte.weight is shared by stage 0 (as m.transformer.wte.weight), "
                               "stage 2 (as m.lm_head.weight)"]
    assert shared_groups(_plan(load("hf_llama"))) == {}  # untied


class _TiedByName(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.body, self.head = nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(self.body(self.embed(idx)))


def test_tied_weights_are_found_when_stages_are_named_or_sliced():
    job = rpcmp.Job(model=_TiedByName, stages=["embed", "body", "head"])
    specs = plan_stages(job, torch.zeros(2, 5, dtype=torch.long))
    assert shared_groups(specs) == {"embed.weight": [(0, "weight"), (2, "weight")]}
    seq = rpcmp.Job(model=lambda: _sequential_tied(), stages=rpcmp.Split([1, 2]))
    assert shared_groups(plan_stages(seq)) == {"0.weight": [(0, "0.weight"), (1, "2.weight")]}


def _sequential_tied():
    layers = nn.Sequential(nn.Linear(6, 6, bias=False), nn.ReLU(), nn.Linear(6, 6, bias=False))
    layers[2].weight = layers[0].weight
    return layers


class _WithSpare(nn.Module):
    """A positional table and a pooler its forward never reads (in this configuration)."""

    def __init__(self):
        super().__init__()
        self.embed, self.spare_pos = nn.Embedding(20, 8), nn.Parameter(torch.randn(4, 8))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.pooler = nn.Linear(8, 8)
        self.blocks[2].unused = nn.Parameter(torch.ones(3))

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def test_parameters_forward_does_not_use_are_kept_with_their_nearest_stage():
    job = rpcmp.Job(model=_WithSpare, stages=rpcmp.SplitAt("blocks.1", "blocks.2"))
    specs = plan_stages(job, torch.zeros(2, 5, dtype=torch.long))
    assert [s.unused for s in specs] == [("spare_pos", "pooler.weight", "pooler.bias"), (), ("blocks.2.unused",)]
    torch.manual_seed(job.seed)
    reference = job.model().state_dict()
    state = {}
    for spec in specs:
        state.update(build_stage(job, spec).state_dict())
    assert sorted(state) == sorted(reference)
    torch.testing.assert_close(state, reference, rtol=0, atol=0)


class _FixedLength(nn.Module):
    """Adds its whole positional table: it takes sequences of 16 tokens only."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(20, 8), nn.Parameter(torch.randn(16, 8))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, idx):
        x = self.embed(idx) + self.pos
        for block in self.blocks:
            x = block(x)
        return x


def test_a_model_that_fixes_the_length_is_said_at_plan_time_and_refused_before_any_stage_runs():
    job = rpcmp.Job(model=_FixedLength, stages=rpcmp.SplitAt("blocks.1"))
    specs = plan_stages(job, torch.zeros(4, 16, dtype=torch.long))
    assert specs[0].sizes == ((None, 16),)
    check_sizes(specs[0].sizes, torch.zeros(3, 16, dtype=torch.long))  # another batch size: fine
    with pytest.raises(rpcmp.MicroBatchError, match=r"input 0 has size 9 in dimension 1, but the model.*fixes that "
                                                    r"dimension at 16.*pad them to 16"):
        check_sizes(specs[0].sizes, torch.zeros(3, 9, dtype=torch.long))


def test_plan_check_compares_every_stage_with_the_unsplit_model():
    rpcmp_bin = os.path.join(os.path.dirname(sys.executable), "rpcmp")
    out = subprocess.run([rpcmp_bin, "plan", job_path("nanogpt"), "--check"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())  # rich wraps long lines
    assert "wte.weight is shared by stage 0 (as wte.weight), stage 2 (as head.weight)" in text
    assert "largest difference from the unsplit model's 0" in text and "inputs: (batch, any) int64" in text


def test_plan_check_names_a_stage_that_differs_from_the_unsplit_model(monkeypatch):
    from rpcmp.cli import check
    job = load("nanogpt")
    specs = _plan(job)
    real = check.build_stage

    def broken(job, spec, **kwargs):  # a build that gives one weight another value
        stage = real(job, spec, **kwargs)
        if spec.index == 1:
            with torch.no_grad():
                stage.get_parameter("blocks.2.mlp.0.weight").fill_(0.5)
        return stage
    monkeypatch.setattr(check, "build_stage", broken)
    checks, diff, why = check.check_stages(job, specs, job.data()[0][:8][0])
    assert [c.wrong for c in checks][0] == [] and checks[2].wrong == []
    assert checks[1].wrong == ["blocks.2.mlp.0.weight: differs from the unsplit model"]
    assert why is None and diff > 1e-3  # and so does the output


def test_the_check_after_a_build_names_what_has_no_value():
    """A stage as the meta trace leaves it (what every owner ran before: its positions made on the meta
    device gave a nanoGPT decoder NaN) is refused by name."""
    from rpcmp.errors import PartitionError
    from rpcmp.plan.materialize import check_materialized
    job = load("nanogpt")
    stage = build_stage(job, _plan(job)[0], meta=True)
    with pytest.raises(PartitionError, match=r"stage 0 \(x\) has tensors without their unsplit values: graph nodes "
                                             r"that create tensors on the meta device: arange_start \(train graph\); "
                                             r"on the meta device: .* and \d+ more"):
        check_materialized({"train": stage}, "stage 0 (x)")


class _CachedGPT2(nn.Module):
    """GPT-2 as its config comes: use_cache=True."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        self.m = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4))

    def forward(self, idx):
        return self.m(idx).logits


def test_a_hugging_face_cache_is_refused_with_the_setting_to_change():
    job = rpcmp.Job(model=_CachedGPT2, stages=rpcmp.SplitAt("m.transformer.h.1"))
    with pytest.raises(rpcmp.PartitionError, match=r"lifted_tensor.*self.m has config.use_cache=True.*use_cache=False"):
        plan_stages(job, torch.zeros(4, 16, dtype=torch.long))


class _CacheInOutput(_CachedGPT2):
    """GPT-2 as its config comes, its whole output returned: the cache is in it."""

    def forward(self, idx):
        return self.m(idx)


class _Holder:
    def __init__(self, t):
        self.t = t


class _OddOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return _Holder(self.b(self.a(x)))


def test_an_output_rpcmp_cannot_take_apart_is_refused_with_what_to_change():
    job = rpcmp.Job(model=_CacheInOutput, stages=rpcmp.SplitAt("m.transformer.h.1"))
    with pytest.raises(rpcmp.PartitionError, match=r"Found <class 'transformers.cache_utils.DynamicCache'> in output\. "
                                                   r"self.m returns its key-value cache .*use_cache=False") as got:
        plan_stages(job, torch.zeros(4, 16, dtype=torch.long))
    assert "control flow" not in str(got.value)
    job = rpcmp.Job(model=_OddOutput, stages=rpcmp.SplitAt("b"))
    with pytest.raises(rpcmp.PartitionError, match=r"holds a .*_Holder.*register_pytree_node"):
        plan_stages(job, torch.zeros(2, 4))


def test_lengths_any_refuses_a_model_that_fixes_the_length_at_plan_time_naming_the_line():
    job = rpcmp.Job(model=_FixedLength, stages=rpcmp.SplitAt("blocks.1", lengths="any"))
    with pytest.raises(rpcmp.PartitionError, match=r"lengths='any'.*_FixedLength.forward takes input 0 \(4, 16\) with "
                                                   r"exactly 16 in dimension 1: .*test_language_model_stages.py:\d+ "
                                                   r"`x = self.embed\(idx\) \+ self.pos` fails one longer.*self.pos\[:x.size\(1\)\]"):
        plan_stages(job, torch.zeros(4, 16, dtype=torch.long))
    with pytest.raises(rpcmp.PartitionError, match="takes 'any'"):
        rpcmp.SplitAt("blocks.1", lengths="variable")


@pytest.mark.parametrize("name", ["hf_llama", "nanogpt"])
def test_lengths_any_accepts_a_model_that_takes_any_length(name):
    job = load(name)
    job = dataclasses.replace(job, stages=rpcmp.SplitAt(*job.stages.points, lengths="any"))
    assert all(spec.sizes[0] == (None, None) for spec in _plan(job))


class _ListIndex(nn.Module):
    """Indexes with a Python list (x[..., [-1]], as Falcon's attention does): a tensor made in forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h * h[..., [-1]])


class _Beit(nn.Module):
    """BEiT's relative position bias fills its index with Python values in forward."""

    def __init__(self):
        super().__init__()
        import transformers as T
        self.m = T.BeitForImageClassification(T.BeitConfig(
            image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
            use_relative_position_bias=True, drop_path_rate=0.0, hidden_dropout_prob=0.0, num_labels=10))

    def forward(self, x):
        return self.m(pixel_values=x).logits


@pytest.mark.parametrize("model,point,x", [(_ListIndex, ("b",), torch.randn(3, 4)),
                                           (_Beit, ("m.beit.layers.1", "m.beit.layers.3"), torch.randn(2, 3, 16, 16))])
def test_a_tensor_forward_makes_from_python_values_is_kept_and_the_stages_train_as_the_unsplit_model(model, point, x):
    """A list index (x[..., [-1]], as Falcon's attention), or BEiT's index filled with Python values: traced as on the
    CPU, the trace made the tensor for real. It was refused, its value unknown; now its value travels with the graphs,
    and it stays out of the checkpoint (the model has no name for it)."""
    from rpcmp.cli import check
    job = rpcmp.Job(model=model, stages=rpcmp.SplitAt(*point))
    specs = plan_stages(job, x)
    stages = [build_stage(job, s) for s in specs]
    torch.manual_seed(job.seed)
    whole = model()
    torch.testing.assert_close(run_stages(stages, x), whole(x))
    run_stages(stages, x).square().sum().backward()
    whole(x).square().sum().backward()
    grads = {k: p.grad for s in stages for k, p in s.named_parameters()}
    assert grads.keys() == dict(whole.named_parameters()).keys()
    for k, p in whole.named_parameters():  # float32: the traced graph may sum in another order (at the gradient's scale)
        torch.testing.assert_close(grads[k], p.grad, rtol=1.3e-6, atol=1e-6 * float(p.grad.abs().max()) + 1e-7, msg=k)
    assert {k for s in stages for k in s.state_dict()} == set(whole.state_dict())
    checks, diff, why = check.check_stages(job, specs, x)  # rpcmp plan --check
    assert all(c.wrong == [] for c in checks) and why is None and diff < 1e-5


def test_a_tensor_kept_in_a_list_attribute_is_refused_naming_the_module_and_the_rewrite():
    job = rpcmp.Job(model=_InAList, stages=rpcmp.SplitAt("b"))  # traced as on the CPU, the list's tensor too
    with pytest.raises(rpcmp.PartitionError, match=r"SplitAt: _InAList's forward reads a tensor the model keeps outside "
                                                   r"its parameters and buffers, in a list or dict attribute \(lifted_tensor_0, "
                                                   r"read by aten.add.Tensor\).*register_buffer"):
        plan_stages(job, torch.zeros(2, 4))


class _InAList(_ListIndex):
    """Keeps a tensor in a list attribute, which the trace lifts as a constant."""

    def __init__(self):
        super().__init__()
        self.table = [torch.arange(4.0)]

    def forward(self, x):
        return self.b(self.a(x) + self.table[0])


class _Raw(nn.Module):
    """A Hugging Face model as its users call it: a dict batch with a padding mask, its ModelOutput back."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        self.m = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=4, resid_pdrop=0.0,
                                            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))

    def forward(self, batch):
        return self.m(**batch)


def test_a_padded_dict_batch_reaches_the_stages_and_the_model_output_comes_back_as_the_model_returns_it():
    job = rpcmp.Job(model=_Raw, stages=rpcmp.SplitAt("m.transformer.h.1", "m.transformer.h.3"), microbatches=2)
    g = torch.Generator().manual_seed(3)

    def batch(n, t):
        lengths = torch.randint(2, t + 1, (n,), generator=g)
        return {"input_ids": torch.randint(0, 64, (n, t), generator=g),
                "attention_mask": (torch.arange(t) < lengths[:, None]).long()}
    stages = [build_stage(job, s) for s in plan_stages(job, batch(4, 12))]
    torch.manual_seed(job.seed)
    model = _Raw()
    x = batch(5, 12)
    got, want = run_stages(stages, x), model(x)
    assert type(got) is type(want) and list(got) == ["logits"], (type(got), list(got))
    torch.testing.assert_close(got.logits, want.logits)  # the mask reached the attention of every stage
    assert not torch.allclose(want.logits, model({"input_ids": x["input_ids"]}).logits)


def test_a_dict_batch_of_the_models_own_arguments_is_refused_with_the_wrapper_to_write():
    from transformers import GPT2Config, GPT2LMHeadModel
    job = rpcmp.Job(model=lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                                             use_cache=False)),
                    stages=rpcmp.SplitAt("transformer.h.1"), microbatches=2)
    batch = {"input_ids": torch.zeros(4, 8, dtype=torch.long), "attention_mask": torch.ones(4, 8, dtype=torch.long),
             "extra": torch.ones(4)}  # a key forward takes only through **kwargs
    with pytest.raises(rpcmp.PartitionError, match=r"arrive as 'input_ids'\. Wrap the model: .*self\.m\(\*\*batch\)"):
        plan_stages(job, batch)


def test_a_mixture_of_experts_that_reads_its_router_s_counts_is_cut_and_runs_as_the_unsplit_model():
    """JetMoE's experts split their rows by counts read from the router (``.item()``): the check that the traced
    graph takes any batch size runs on fake tensors, which hold no values, and stopped the plan with
    ``DataDependentOutputException``; such a graph is not checked, and the stages equal the unsplit model."""
    import transformers as T

    class JetMoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = T.JetMoeForCausalLM(T.JetMoeConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=4, num_key_value_heads=2, kv_channels=8,
                intermediate_size=64, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                use_cache=False))

        def forward(self, ids):
            return self.m(input_ids=ids).logits

    job = rpcmp.Job(model=JetMoE, stages=rpcmp.SplitAt("m.model.layers.1", "m.model.layers.3"), microbatches=2)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    specs = plan_stages(job, ids)
    stages = [build_stage(job, s) for s in specs]
    torch.manual_seed(job.seed)
    whole = JetMoE()
    for n in (1, 3):
        torch.testing.assert_close(run_stages(stages, ids[:n]), whole(ids[:n]))
