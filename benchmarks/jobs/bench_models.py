"""Job files for the benchmarks: each process of a run imports one of these."""
import segmentation_models_pytorch as smp
import torch
import torch.distributed.rpc as rpc
from torch import nn


def mlp():
    layers = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers)


def unet():
    return smp.Unet("resnet34", encoder_weights=None, in_channels=1, classes=1)


def mse(out, y):
    return nn.functional.mse_loss(out, y)


def bce(out, y):
    return nn.functional.binary_cross_entropy_with_logits(out, y)


class UnetStage(nn.Module):
    """One part of the seeded Unet as a torch.distributed.pipelining stage: tensors in, tensors out
    (the encoder's list of features travels as a tuple)."""

    def __init__(self, name):
        super().__init__()
        torch.manual_seed(0)
        self.name, self.part = name, getattr(unet(), name)

    def forward(self, *x):
        for t in x:  # gloo receives into contiguous buffers; grads out of torch.cat are views
            if t.requires_grad:
                t.register_hook(torch.Tensor.contiguous)
        if self.name == "encoder":
            return tuple(self.part(*x))
        return self.part(list(x)) if self.name == "decoder" else self.part(*x)


class Part(nn.Module):
    """One named part of the seeded Unet, for the hand-written RemoteModule baseline."""

    def __init__(self, name):
        super().__init__()
        torch.manual_seed(0)
        self.part = getattr(unet(), name)

    def forward(self, x):
        return self.part(x)


SGD = (torch.optim.SGD, {"lr": 0.01})


# A chain of identity hops without rpcmp, for the per-hop floor: master -> worker1 -> ... ->
# workerN -> master with nested async RPCs, as rpcmp's stages forward to each other.
CHAIN = {}


@rpc.functions.async_execution
def chain_forward(k: int, last: int, x: torch.Tensor) -> torch.futures.Future:
    y = x * 1.0
    if k < last:
        return rpc.rpc_async(f"worker{k + 1}", chain_forward, args=(k + 1, last, y))
    return rpc.rpc_async("master", chain_deliver, args=(y,))


def chain_deliver(y: torch.Tensor) -> None:
    CHAIN["out"].set_result(y)


def pipelining_steps(module, rank: int, world: int, counts, loss_fn, x, y) -> dict:
    """torch.distributed.pipelining's GPipe and 1F1B over ``module``, rank ``rank`` of ``world`` (in an initialised
    gloo group), at each micro-batch count in ``counts``: one step function per schedule (``"gpipe_m4"``), each the
    step the bench times: gradients zeroed, the schedule's step, SGD's step, a barrier."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    last, steps = rank == world - 1, {}
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        for m in counts:
            if name == "1f1b" and m < world:
                continue  # 1F1B needs at least as many micro-batches as stages
            sched = cls(PipelineStage(module, rank, world, torch.device("cpu")), n_microbatches=m, loss_fn=loss_fn)
            opt = torch.optim.SGD(module.parameters(), lr=0.01)

            def step(sched=sched, opt=opt):
                opt.zero_grad()
                sched.step(x) if rank == 0 else sched.step(target=y) if last else sched.step()
                opt.step()
                dist.barrier()
            steps[f"{name}_m{m}"] = step
    return steps


# pipelining's two-rank MLP in rpcmp's own processes (bench._mlp_side_by_side): rank 0 on worker1, which holds
# rpcmp's first stage, rank 1 on the master, which holds its last; gloo over a store of its own.
PIPELINING = {}


def pipelining_mlp_init(rank: int, port: int, x: torch.Tensor, y: torch.Tensor) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    full = mlp()
    module = full[:8] if rank == 0 else full[8:]  # the bench's split, the same seeded weights as its other launches
    PIPELINING.update(store=store, steps=pipelining_steps(module, rank, 2, (1, 4, 8), mse, x, y))


def pipelining_mlp_steps(key: str, n: int) -> list[float]:
    """``n`` steps of schedule ``key`` (``gpipe_m4``); each one's seconds."""
    import time
    times = []
    for _ in range(n):
        start = time.perf_counter()
        PIPELINING["steps"][key]()
        times.append(time.perf_counter() - start)
    return times


def pipelining_mlp_end() -> None:
    import torch.distributed as dist
    dist.destroy_process_group()
    PIPELINING.clear()
