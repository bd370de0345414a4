"""Hugging Face GPT-2 built from a tiny config (no download; lm_head tied to wte as in every GPT-2), cut in 3."""
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import rpcmp
from nanogpt import data, lm_loss, VOCAB


class LM(nn.Module):
    """The model as users wrap it for a pipeline: token ids in, logits out."""

    def __init__(self):
        super().__init__()
        self.m = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=4,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))

    def forward(self, idx):
        return self.m(idx).logits


job = rpcmp.Job(model=LM, stages=rpcmp.SplitAt("m.transformer.h.1", "m.transformer.h.3"), data=data, batch_size=8,
                microbatches=4, loss=lm_loss, optimizer=(torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
                hang_timeout=60)  # tracing a stage under load: see the note in tests/integration/test_language_models.py
