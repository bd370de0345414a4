"""Job(param_groups=...): the groups a job gives, turned into names on the master and back into
torch.optim groups on each owner, and the mistakes torch.optim would let pass in silence."""
import dataclasses

import pytest
import torch
from torch import nn

import rpcmp
from rpcmp.core.groups import GROUP_KEY, plan_groups
from rpcmp.core.hparams import StageFields, apply_fields, read_fields
from rpcmp.errors import JobError


def _tied():
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 10))
    model[2].weight = model[0].weight  # the head reads the embedding's table, as GPT-2's does
    return model


def _job(groups, optimizer=(torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1})):
    return rpcmp.Job(model=_tied, stages=rpcmp.Split([1, 2]), optimizer=optimizer, param_groups=groups)


def _no_decay(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [n for n, p in model.named_parameters() if p.dim() < 2], "weight_decay": 0.0}]


def test_groups_become_names_every_name_of_a_tied_parameter_included_and_back_into_torch_groups():
    model = _tied()
    groups = plan_groups(_job(_no_decay), model)
    assert groups.of == {"0.weight": 0, "1.weight": 1, "1.bias": 1, "2.weight": 0, "2.bias": 1}
    assert groups.settings == ({}, {"weight_decay": 0.0})
    # a stage holding the head alone finds its tied weight by its own name
    part = groups.split([("2.weight", model[2].weight), ("2.bias", model[2].bias)])
    assert [(g[GROUP_KEY], len(g["params"]), g.get("weight_decay")) for g in part] == [(0, 1, None), (1, 1, 0.0)]
    opt = torch.optim.AdamW(part, lr=1e-3, weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert groups.describe() == "2 parameter groups: 1 tensor, 40 values; 3 tensors, 18 values (weight_decay=0.0)"
    assert plan_groups(dataclasses.replace(_job(None)), model) is None


@pytest.mark.parametrize("groups,match", [
    (lambda m: [{"params": [m[0].weight]}], r"3 parameters are in no group \(1.weight, 1.bias, 2.bias\).*requires_grad=False"),
    (lambda m: [{"params": m.parameters()}, {"params": [m[1].bias], "weight_decay": 0.0}],
     r"1.bias is in group 0 and in group 1"),
    (lambda m: [{"params": m.parameters(), "weight_deacy": 0.0}], r"sets 'weight_deacy', which AdamW does not have"),
    (lambda m: [{"params": m.parameters(), "lr": "1e-3"}], r"sets lr='1e-3', but AdamW's lr is 0.001"),
    (lambda m: [{"params": m.parameters(), "betas": 0.9}], r"sets betas=0.9, but AdamW's betas is \(0.9, 0.999\)"),
    (lambda m: [{"params": ["1.wieght", "1.bias", "0.weight", "2.bias"]}], r"names '1.wieght'.*did you mean"),
    (lambda m: [{"params": _tied().parameters()}], r"not a parameter of the model it was handed"),
    (lambda m: {"params": m.parameters()}, r"must return a non-empty list of groups"),
    (lambda m: [m.parameters()], r"group 0 must be a dict with 'params'"),
    (lambda m: [{"params": m[1]}, {"params": [m[0].weight, m[2].bias]}], r"got a LayerNorm \(for a module's, give"),
    (lambda m: m.missing, r"param_groups\(model\) failed: AttributeError"),
], ids=["in-no-group", "in-two", "unknown-setting", "a-string", "not-a-pair", "misspelt-name", "another-model", "one-dict",
        "not-a-dict", "a-module", "raises"])
def test_a_mistake_in_the_groups_is_refused_saying_what_to_change(groups, match):
    with pytest.raises(JobError, match=match):
        plan_groups(_job(groups), _tied())


def test_param_groups_that_is_not_a_function_or_without_a_whole_model_is_refused_at_once():
    with pytest.raises(JobError, match="must be None or a function of the model"):
        _job([{"params": []}])
    with pytest.raises(JobError, match="stages given as modules have none"):
        rpcmp.Job(stages=[nn.Linear(2, 2), nn.Linear(2, 2)], param_groups=_no_decay)


def test_a_frozen_parameter_may_stay_out_of_every_group():
    def frozen():
        model = _tied()
        model[1].requires_grad_(False)
        return model
    job = dataclasses.replace(_job(lambda m: [{"params": [m[0].weight, m[2].bias]}]), model=frozen)
    model = frozen()
    groups = plan_groups(job, model)
    assert groups.of == {"0.weight": 0, "2.weight": 0, "2.bias": 0}
    # DDP mode hands its optimizer every parameter of the model, the frozen ones too
    assert [len(g["params"]) for g in groups.split(model.named_parameters())] == [2]


def test_fields_travel_per_group_and_land_on_the_local_groups_by_index():
    model = _tied()
    groups = plan_groups(_job(_no_decay), model)
    sent = []
    lambdas = [lambda s: 0.5 ** s, lambda s: 1.0 / (s + 1)]
    fields = StageFields((torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
                         (torch.optim.lr_scheduler.LambdaLR, {"lr_lambda": lambdas}), sent.append, groups)
    ref = torch.optim.AdamW([{"params": [model[0].weight]}, {"params": [model[1].bias], "weight_decay": 0.0}],
                            lr=1e-3, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambdas)
    for _ in range(3):
        ref.step()
        ref_sched.step()
        fields.step()
    assert [fields.sent[i]["lr"] for i in (0, 1)] == [g["lr"] for g in ref.param_groups] == [1e-3 / 8, 1e-3 / 4]
    # an owner holding the second group alone (its group is at place 0 there) gets the second group's fields
    local = torch.optim.AdamW(groups.split([("1.bias", model[1].bias)]), lr=1e-3, weight_decay=0.1)
    apply_fields(local, fields.sent)
    assert read_fields(local) == {1: fields.sent[1]} and local.param_groups[0]["weight_decay"] == 0.0
    fields.set({"lr": 0.5})  # one dict: every group
    assert sent[-1] == {0: {"lr": 0.5}, 1: {"lr": 0.5}}
    with pytest.raises(JobError, match=r"no parameter group 2"):
        fields.set({2: {"lr": 0.1}})


_FAMILIES = {
    "gpt2": lambda t: t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)),
    "llama": lambda t: t.LlamaForCausalLM(t.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64)),
    "t5": lambda t: t.T5ForConditionalGeneration(t.T5Config(num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16,
                                                            vocab_size=64)),
    "bert": lambda t: t.BertForMaskedLM(t.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                     num_attention_heads=2, vocab_size=64)),
}


@pytest.mark.model
@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_no_decay_gives_the_groups_hugging_face_s_trainer_gives_adamw(family):
    transformers = pytest.importorskip("transformers")
    from transformers.trainer import Trainer
    model = _FAMILIES[family](transformers)
    decayed, off = rpcmp.no_decay(model)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(decayed["params"]) == sorted(n for n in Trainer.get_decay_parameter_names(None, model) if n in names)
    assert off == {"params": [n for n in names if n not in decayed["params"]], "weight_decay": 0.0} and off["params"]
    if family != "t5":  # T5's relative_attention_bias is a table, out by its name alone
        assert off["params"] == [n for n, p in model.named_parameters() if p.dim() < 2]  # nanoGPT's rule


def test_no_decay_keeps_norms_of_any_name_and_frozen_parameters_out():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, bias=False))
    model[0].requires_grad_(False)
    assert rpcmp.no_decay(model) == [{"params": ["2.weight"]}, {"params": ["1.weight", "1.bias"], "weight_decay": 0.0}]
    plan_groups(_job(rpcmp.no_decay), _tied())  # as Job(param_groups=...) takes it
