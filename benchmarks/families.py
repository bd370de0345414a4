"""Hugging Face model families built from their configs, cut at their blocks, trained as the unsplit model.

    .venv/bin/python benchmarks/families.py                  # every family below
    .venv/bin/python benchmarks/families.py qwen2 opt        # some of them
    .venv/bin/python benchmarks/families.py --schedule overlap --microbatches 4   # a loss per micro-batch

For each family: a 4-block model from a tiny config, its batches a dict of ``input_ids`` and a padding
``attention_mask``, its loss reading the model's own output (``out.logits``), ``SplitAt`` before blocks 1
and 3 on 4 processes (the master and three owners), ``schedule="gpipe"`` (the loss, a mean over the tokens
padding leaves in, is not a mean over samples); one step of AdamW (weight decay off biases and norms, as
Hugging Face's Trainer groups the parameters), a re-cut before block 2 instead of 1, two
more steps (an encoder-decoder, its decoder reading the same tokens: cut before block 1 of the encoder and
of the decoder, re-cut before their blocks 2; ALBERT, whose one layer forward calls at every depth: cut before
the encoder and the head, re-cut before the head's last layer), then eval-mode predictions. Losses, every parameter and the
predictions are compared with the unsplit model trained on the same batches in this process, at float32
tolerance. ``--schedule overlap`` or ``1f1b`` (and ``--microbatches``) computes a loss per micro-batch instead, where
the owners take the optimizer step in the backward (rpcmp/owner/stepping.py); its batches have no padding, so that
the micro-batches' losses, weighted by their share of the samples, add up to the batch's. Dropout is off: a layer
draws its masks from its own process's generator. This file is also the job each launch loads (``FAMILY`` in the
environment says which).
"""
from __future__ import annotations

import os

import click
import torch
import torch.nn.functional as F
import transformers as T
from torch import nn

import rpcmp
import unsplit

V = 64
_KW = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
FAMILIES = {  # name: (config, model, config arguments, the blocks' container, or the encoder's and the decoder's,
              # or [the cuts, the re-cut's])
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, dict(vocab_size=V, n_positions=64, n_embd=32, n_layer=4, n_head=4,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False), "transformer.h"),
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, _KW, "model.layers"),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, _KW, "model.layers"),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(_KW, head_dim=8, tie_word_embeddings=True), "model.layers"),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(_KW, sliding_window=8), "model.layers"),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(_KW, head_dim=8), "model.layers"),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(_KW, head_dim=8, sliding_window=8), "model.layers"),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(_KW, pad_token_id=0), "model.layers"),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict(vocab_size=V, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64, use_cache=False),
                 "gpt_neox.layers"),
    "opt": (T.OPTConfig, T.OPTForCausalLM, dict(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=4,
            num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, use_cache=False),
            "model.decoder.layers"),
    "bloom": (T.BloomConfig, T.BloomForCausalLM, dict(vocab_size=V, hidden_size=32, n_layer=4, n_head=4,
              use_cache=False), "transformer.h"),
    "falcon": (T.FalconConfig, T.FalconForCausalLM, dict(vocab_size=V, hidden_size=32, num_hidden_layers=4,
               num_attention_heads=4, use_cache=False), "transformer.h"),
    "gptj": (T.GPTJConfig, T.GPTJForCausalLM, dict(vocab_size=V, n_embd=32, n_layer=4, n_head=4, rotary_dim=4,
             n_positions=64, use_cache=False), "transformer.h"),
    # mixtures of experts: their default grouped experts choose their path by device type
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(_KW, num_local_experts=4, num_experts_per_tok=2),
                "model.layers"),
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, dict(_KW, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, shared_expert_intermediate_size=32), "model.layers"),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(_KW, head_dim=8, sliding_window=8), "model.layers"),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, _KW, "model.layers"),
    "phi": (T.PhiConfig, T.PhiForCausalLM, dict(_KW, resid_pdrop=0.0, embd_pdrop=0.0), "model.layers"),
    "smollm3": (T.SmolLM3Config, T.SmolLM3ForCausalLM, dict(_KW, pad_token_id=0), "model.layers"),
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, dict(_KW, num_key_value_heads=4, moe_intermediate_size=32,
                    n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
                    "model.layers"),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, dict(_KW, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                sliding_window=8), "model.layers"),
    "starcoder2": (T.Starcoder2Config, T.Starcoder2ForCausalLM, dict(_KW, residual_dropout=0.0, embedding_dropout=0.0),
                   "model.layers"),
    "cohere": (T.CohereConfig, T.CohereForCausalLM, _KW, "model.layers"),
    "granite": (T.GraniteConfig, T.GraniteForCausalLM, _KW, "model.layers"),
    "stablelm": (T.StableLmConfig, T.StableLmForCausalLM, dict(_KW, hidden_dropout=0.0), "model.layers"),
    "codegen": (T.CodeGenConfig, T.CodeGenForCausalLM, dict(vocab_size=V, n_embd=32, n_layer=4, n_head=4, rotary_dim=4,
                n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False), "transformer.h"),
    "gpt_bigcode": (T.GPTBigCodeConfig, T.GPTBigCodeForCausalLM, dict(vocab_size=V, n_embd=32, n_layer=4, n_head=4,
                    n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False), "transformer.h"),
    "xglm": (T.XGLMConfig, T.XGLMForCausalLM, dict(vocab_size=V, d_model=32, num_layers=4, attention_heads=4, ffn_dim=64,
             max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False),
             "model.layers"),
    "mpt": (T.MptConfig, T.MptForCausalLM, dict(vocab_size=V, d_model=32, n_layers=4, n_heads=4, max_seq_len=64,
            use_cache=False), "transformer.blocks"),
    "biogpt": (T.BioGptConfig, T.BioGptForCausalLM, dict(vocab_size=V, hidden_size=32, num_hidden_layers=4,
               num_attention_heads=4, intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, use_cache=False), "biogpt.layers"),
    "nemotron": (T.NemotronConfig, T.NemotronForCausalLM, dict(_KW, head_dim=8), "model.layers"),
    # experts that split their rows by counts read from the router (.item()): a graph no fake tensor can run
    "jetmoe": (T.JetMoeConfig, T.JetMoeForCausalLM, dict(vocab_size=V, hidden_size=32, num_hidden_layers=4,
               num_key_value_heads=2, kv_channels=8, intermediate_size=64, max_position_embeddings=64,
               num_local_experts=4, num_experts_per_tok=2, use_cache=False), "model.layers"),
    # state-space and hybrid models: Mamba's and Jamba's selective scans (the slow path: no CUDA kernels), RecurrentGemma's
    # recurrent blocks, LFM2's short convolutions
    "mamba": (T.MambaConfig, T.MambaForCausalLM, dict(vocab_size=V, hidden_size=32, state_size=8, num_hidden_layers=4,
              use_cache=False), "backbone.layers"),
    "recurrent_gemma": (T.RecurrentGemmaConfig, T.RecurrentGemmaForCausalLM, dict(vocab_size=V, hidden_size=32,
                        intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        lru_width=32, attention_window_size=8, head_dim=8, use_cache=False), "model.layers"),
    "jamba": (T.JambaConfig, T.JambaForCausalLM, dict(_KW, num_experts=2, num_experts_per_tok=1, mamba_d_state=8,
              mamba_expand=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
              use_mamba_kernels=False), "model.layers"),
    "lfm2": (T.Lfm2Config, T.Lfm2ForCausalLM, dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False), "model.layers"),
    "t5": (T.T5Config, T.T5ForConditionalGeneration, dict(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=3,
           num_decoder_layers=3, num_heads=4, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0),
           ("encoder.block", "decoder.block")),
    "bart": (T.BartConfig, T.BartForConditionalGeneration, dict(vocab_size=V, d_model=32, encoder_layers=3,
             decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
             decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
             activation_dropout=0.0, use_cache=False), ("model.encoder.layers", "model.decoder.layers")),
    "bert": (T.BertConfig, T.BertForMaskedLM, dict(vocab_size=V, hidden_size=32, num_hidden_layers=4,
             num_attention_heads=4, intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0), "bert.encoder.layer"),
    # one layer called at every depth, its head tied to the embedding: the cuts and the re-cut's, named
    "albert": (T.AlbertConfig, T.AlbertForMaskedLM, dict(vocab_size=V, embedding_size=16, hidden_size=32,
               num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0),
               [("m.albert.encoder", "m.predictions"), ("m.albert.encoder", "m.predictions.decoder")]),
}
FAMILY = os.environ.get("FAMILY", "gpt2")
SCHEDULE = os.environ.get("FAMILY_SCHEDULE", "gpipe")
MICROBATCHES = int(os.environ.get("FAMILY_MICROBATCHES", "4"))


class Model(nn.Module):
    """The model as its users call it: ``self.m(**batch)``, its ModelOutput back."""

    def __init__(self):
        super().__init__()
        config, model, kwargs, _ = FAMILIES[FAMILY]
        self.m = model(config(**kwargs))

    def forward(self, batch):
        if self.m.config.is_encoder_decoder:  # the decoder reads the same tokens (teacher forcing)
            return self.m(**batch, decoder_input_ids=batch["input_ids"])
        return self.m(**batch)


def batches(steps: int = 3, size: int = 8, length: int = 16) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, V, (size, length + 1), generator=g)
        mask = (torch.arange(length) < torch.randint(4, length + 1, (size, 1), generator=g)).long()
        if SCHEDULE != "gpipe":  # a loss per micro-batch: every sample of the same length (see the docstring)
            mask = torch.ones_like(mask)
        out.append(({"input_ids": ids[:, :-1], "attention_mask": mask}, ids[:, 1:].masked_fill(mask == 0, -100)))
    return out


def loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), ignore_index=-100)


_BLOCKS = FAMILIES[FAMILY][3]
if isinstance(_BLOCKS, list):
    _CUT, _RECUT = _BLOCKS
elif isinstance(_BLOCKS, tuple):  # an encoder-decoder: cut before the encoder's block 1 and the decoder's, re-cut at 2
    _CUT, _RECUT = [f"m.{_BLOCKS[0]}.1", f"m.{_BLOCKS[1]}.1"], [f"m.{_BLOCKS[0]}.2", f"m.{_BLOCKS[1]}.2"]
else:
    _CUT, _RECUT = [f"m.{_BLOCKS}.1", f"m.{_BLOCKS}.3"], [f"m.{_BLOCKS}.2", f"m.{_BLOCKS}.3"]


job = rpcmp.Job(model=Model, stages=rpcmp.SplitAt(*_CUT), batch_size=8, microbatches=MICROBATCHES, schedule=SCHEDULE,
                loss=loss,
                optimizer=(torch.optim.AdamW, {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.1}), param_groups=rpcmp.no_decay,
                threads=1)


def _logits(out):
    return out.logits


def _split_run(job, world):
    return unsplit.split_run(job, world, batches(), _RECUT, _logits)


def _optimizer(model):
    named = dict(model.named_parameters())
    return torch.optim.AdamW([{**g, "params": [named[n] for n in g["params"]]} for g in rpcmp.no_decay(model)],
                             **job.optimizer[1])


def _unsplit_run():
    return unsplit.train(job, Model, _optimizer, batches(), loss, _logits)


@click.command()
@click.argument("names", nargs=-1)
@click.option("--schedule", type=click.Choice(["gpipe", "overlap", "1f1b"]), default="gpipe", show_default=True)
@click.option("--microbatches", type=int, default=4, show_default=True)
@click.option("--one", is_flag=True, hidden=True, help="this process runs FAMILY's comparison")
def main(names, schedule, microbatches, one):
    """Check each family in NAMES (every one by default) against the unsplit model."""
    if one:
        print("RESULT " + unsplit.compare(__file__, _split_run, _unsplit_run), flush=True)
        return
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise click.BadParameter(f"unknown families {unknown}; known: {', '.join(FAMILIES)}", param_hint="NAMES")
    unsplit.each(__file__, names or list(FAMILIES), lambda name: {"FAMILY": name, "FAMILY_SCHEDULE": schedule,
                                                                  "FAMILY_MICROBATCHES": str(microbatches)})

if __name__ == "__main__":
    main()
