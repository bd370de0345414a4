"""Hugging Face Llama built from a tiny config (RoPE, RMSNorm, SwiGLU, grouped-query attention), cut in 3."""
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import rpcmp
from nanogpt import data, lm_loss, VOCAB


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                              use_cache=False))

    def forward(self, idx):
        return self.m(idx).logits


job = rpcmp.Job(model=LM, stages=rpcmp.SplitAt("m.model.layers.1", "m.model.layers.3"), data=data, batch_size=8,
                microbatches=4, loss=lm_loss, optimizer=(torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
                hang_timeout=60)  # tracing a stage under load: see the note in tests/integration/test_language_models.py
