"""tests/jobs/gated.py trained with AdamW's weight decay: the gate, read by the next stage only through a comparison,
gets no gradient in the unsplit model, so its weights must not decay in the split one either."""
import dataclasses

import torch

from gated import job as gated_job

job = dataclasses.replace(gated_job, optimizer=(torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.5}))
