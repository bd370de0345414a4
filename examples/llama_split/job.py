"""A small Hugging Face Llama, built from its config (nothing is downloaded), trained as a
character-level language model on a text this example generates, cut into 3 stages on its
traced graph.

    rpcmp plan examples/llama_split/job.py --check      # the cut, and the stages against the unsplit model
    rpcmp run examples/llama_split/job.py --local 4     # master + 3 workers on this machine

Stage 0 holds the token embedding and RoPE's tables (its non-persistent ``inv_freq``), stage 1
the middle decoder layers, stage 2 the last layers, the final norm and the head.
"""
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

import rpcmp

CONTEXT = 64


def text(sentences: int = 1500, seed: int = 0) -> str:
    """Sentences from a small grammar: enough structure for a model to learn in a minute."""
    rng = random.Random(seed)
    who = ["the cat", "a dog", "my friend", "the old man", "our teacher", "a small bird"]
    does = ["sees", "likes", "follows", "paints", "finds", "remembers"]
    what = ["the red ball", "a quiet river", "the tall tree", "a warm house", "the blue sky", "an open door"]
    when = ["today", "every morning", "at night", "in the rain", "after lunch", "before dawn"]
    return " ".join(f"{rng.choice(who)} {rng.choice(does)} {rng.choice(what)} {rng.choice(when)}."
                    for _ in range(sentences))


CHARS = sorted(set(text()))


def datasets():
    ids = torch.tensor([CHARS.index(c) for c in text()])
    windows = ids.unfold(0, CONTEXT + 1, 16)  # overlapping windows of CONTEXT + 1 characters
    g = torch.Generator().manual_seed(0)
    windows = windows[torch.randperm(len(windows), generator=g)]
    held = len(windows) // 10
    return TensorDataset(windows[held:, :-1], windows[held:, 1:]), TensorDataset(windows[:held, :-1], windows[:held, 1:])


class TinyLlama(nn.Module):
    """Token ids in, logits out: the shape a pipeline's last stage hands to the loss."""

    def __init__(self):
        super().__init__()
        self.m = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(CHARS), hidden_size=128, intermediate_size=344, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT, use_cache=False))

    def forward(self, idx):
        return self.m(idx).logits


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def next_char_accuracy(logits, targets):
    return (logits.argmax(-1) == targets).float().mean().item()


job = rpcmp.Job(
    model=TinyLlama,
    stages=rpcmp.SplitAt("m.model.layers.2", "m.model.layers.4", lengths="any"),
    data=datasets,
    loss=lm_loss,
    metric=next_char_accuracy,
    metric_name="next-char accuracy",
    optimizer=(torch.optim.AdamW, {"lr": 3e-3, "weight_decay": 0.01}),
    batch_size=16,
    microbatches=4,
    epochs=2,
    hang_timeout=60,  # tracing a stage takes seconds on a busy machine
)
