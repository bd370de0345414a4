from torch import nn

import rpcmp


def broken_decoder():
    raise RuntimeError("decoder factory exploded")


job = rpcmp.Job(stages=[lambda: nn.Linear(4, 4), broken_decoder], batch_size=4, loss=lambda out, y: out.sum())
