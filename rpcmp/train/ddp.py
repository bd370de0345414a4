"""DDP mode: the data-parallel case from the same job file (``--mode ddp``).

Every rank builds the whole model (seeded, so all start equal), wraps it in
``DistributedDataParallel`` (gloo on CPU, NCCL on GPU with one device per local rank)
and reads its share of every batch through a ``DistributedSampler``. ``Job.batch_size``
stays the global batch: each rank takes ``batch_size / world_size`` samples, so a job
trains on the same number of samples per step in either mode. Losses and metrics are
averaged over ranks (all_reduce), so what rank 0 prints is the global value; only rank
0 shows progress and writes checkpoints, in the format pipeline mode writes.

[Note: a parameter without a gradient in DDP mode]
DDP's reduction by default expects every parameter to get a gradient in every step; one the loss does
not reach (a part of the model read through ``detach`` or ``torch.no_grad()``, a head left unused)
failed the second step with DDP's "Expected to have finished reduction in the prior iteration" and
its advice to pass ``find_unused_parameters=True``, which rpcmp's user cannot. So the first step of a
run runs without DDP's reduction and looks: where a rank has a parameter without a gradient, every
rank wraps the model again with ``find_unused_parameters=True`` (DDP then walks the graph each step);
the first step's gradients are averaged here as DDP would have: the mean over ranks, a rank without
one adding zeros, and none where no rank has one (an optimizer leaves it alone, as the single model).
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from ..core.checkpoint import fill_tied, read_state_file
from ..plan.materialize import build_whole, tensor_aliases
from ..errors import JobError, RunAbortedError
from ..job import loss_of
from ..errors import WorkerLostError
from ..core.store import launch_store
from ..core.served import current
from ..owner.state import rng_state as process_rng_state, set_rng_state as set_process_rng_state
from ..core.groups import plan_groups
from ..core.hparams import load_scheduler_state, make_scheduler, scheduler_state
from ..core.microbatch import batch_size, to_device
from ..core.policy import NonFinite
from ..data import data_loader, step_groups

__all__ = ["DDPEngine", "init_ddp", "join", "leave"]


def init_ddp(rank: int, world_size: int, collective_timeout: float, local_rank: int | None = None) -> torch.device:
    """Join the process group (env://) and pick this rank's device. A collective may wait ``collective_timeout``
    (Job.call_timeout): a rank that froze is found sooner by the heartbeats (Job.hang_timeout), which a pause of
    every rank does not fool (see [Note: a paused job goes on] in rpcmp/job.py)."""
    cuda = torch.cuda.is_available()
    local_rank = rank if local_rank is None else local_rank
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout))
    return device


def join(rank: int, world_size: int, hang_timeout: float, collective_timeout: float, local_rank: int | None = None) -> None:
    """Make this process DDP rank ``rank``: process group, device, heartbeats to its peers."""
    from ..core.health import Heartbeats
    served = current()
    served.device = init_ddp(rank, world_size, collective_timeout, local_rank)
    store_s = min(30.0, max(hang_timeout, 2.0)) if hang_timeout else 30.0  # a store call never waits past a hang
    beats = served.heartbeats = Heartbeats(rank, world_size, hang_timeout, launch_store(store_s), served.status,
                                           store_timeout=store_s)
    beats._beat()
    beats.start()


def leave() -> None:
    served = current()
    if served.heartbeats is not None:
        served.heartbeats.stop()
    served.heartbeats = served.device = None
    dist.destroy_process_group()


class DDPEngine:
    """What the trainer drives in DDP mode (pipeline mode drives a :class:`~rpcmp.Pipeline`)."""

    mode = "ddp"

    def __init__(self, job, device: torch.device | None = None):
        self.job, self.rank, self.world = job, dist.get_rank(), dist.get_world_size()
        self.served = current()
        self.status = self.served.status
        self.device = device or self.served.device or torch.device("cpu")
        if job.batch_size % self.world:
            raise JobError(f"DDP mode splits Job.batch_size ({job.batch_size}) over {self.world} ranks: "
                           f"make batch_size a multiple of {self.world}")
        self.local_batch = job.batch_size // self.world
        if job.model is None:
            raise JobError("DDP mode builds the whole model on every rank: give Job(model=<factory>)")
        module = build_whole(job, compiled=True)
        if job.init_from:
            module.load_state_dict(fill_tied(read_state_file(job.init_from), tensor_aliases(module)), strict=True)
        module = module.to(self.device)
        if job.sync_batchnorm:
            if self.device.type != "cuda":
                raise JobError("sync_batchnorm=True needs GPUs (PyTorch's SyncBatchNorm runs on CUDA only); "
                               "drop --sync-batchnorm on the CPU")
            module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
        self.module = module
        self.model = self._wrap(find_unused=False)
        self.checked = False  # whether the first step looked for parameters without a gradient
        cls, kwargs = job.optimizer
        groups = plan_groups(job, self.module)  # see [Note: parameter groups]
        self.optimizer = cls(groups.split(self.module.named_parameters()) if groups else self.model.parameters(), **kwargs)
        self.scheduler = make_scheduler(job.scheduler, self.optimizer) if job.scheduler else None
        if job.precision == "fp16" and self.device.type != "cuda":
            raise JobError("precision='fp16' needs a GPU (loss scaling); use precision='bf16' on the CPU")
        self.scaler = torch.amp.GradScaler("cuda") if job.precision == "fp16" else None
        self.is_main = self.rank == 0
        self.nonfinite = NonFinite(job.nonfinite, " (DDP mode)")

    # -- data ------------------------------------------------------------------
    def epoch_loader(self, dataset, epoch: int, first_batch: int):
        sampler = DistributedSampler(dataset, num_replicas=self.world, rank=self.rank, shuffle=True,
                                     seed=self.job.seed, drop_last=True)
        sampler.set_epoch(epoch)
        batches = list(torch.utils.data.BatchSampler(sampler, self.local_batch, drop_last=True))
        return step_groups(dataset, batches, first_batch, self.job.accumulate, self.job.collate)

    def steps_per_epoch(self, n: int) -> int:
        return (n // self.world // self.local_batch) // self.job.accumulate

    # -- training ------------------------------------------------------------------
    def train_step(self, group: list) -> tuple[float, int]:
        """One optimizer step over ``accumulate`` local batches; returns (global mean loss, samples)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(group):
            last = i == len(group) - 1
            sync = contextlib.nullcontext() if last and self.checked else self.model.no_sync()
            with sync, self._autocast():
                out = self.model(to_device(x, self.device))
                loss = loss_of(self.job, out, to_device(y, self.device)) / len(group)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach().float()
        if not self.checked:
            self._first_reduce()
        dist.all_reduce(total)
        total /= self.world
        if not self.nonfinite.allows(total):  # every rank sees the same reduced loss: all skip, or all stop
            return total.item(), self.job.batch_size * len(group)
        if self.job.clip_grad_norm:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.clip_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.nonfinite.updated = True
        if self.scheduler is not None:
            self.scheduler.step()
        return total.item(), self.job.batch_size * len(group)

    def _wrap(self, find_unused: bool) -> DistributedDataParallel:
        return DistributedDataParallel(self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                                       find_unused_parameters=find_unused)

    def _first_reduce(self) -> None:
        """Average the first step's gradients as DDP would; wrap the model again where a parameter got none
        (see [Note: a parameter without a gradient in DDP mode])."""
        self.checked = True
        params = [p for p in self.module.parameters() if p.requires_grad]
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=self.device)
        dist.all_reduce(used)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for dtype in {p.dtype for p in params}:
            grads = [p.grad for p in params if p.dtype == dtype]
            flat = torch._utils._flatten_dense_tensors(grads).div_(self.world)  # as DDP's hook: divide, then sum
            dist.all_reduce(flat)
            for g, mean in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(mean)
        for p, ranks in zip(params, used.tolist()):
            if not ranks:
                p.grad = None
        if min(used.tolist(), default=self.world) < self.world:
            self.model = self._wrap(find_unused=True)  # which also takes rank 0's buffers, as a forward would
        else:  # a forward under no_sync leaves the buffers to the forward after the next synced one: take them now
            self.model.require_forward_param_sync = True

    def _autocast(self):
        if self.job.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.job.precision == "bf16" else torch.float16
            return torch.autocast(self.device.type, dtype=dtype)
        return contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self, dataset, between_epochs: bool = False) -> float:
        """The metric over the whole held-out set: each rank scores every world-th sample (nothing to roll back)."""
        self.model.eval()
        mine = list(range(self.rank, len(dataset), self.world))
        acc = torch.zeros(2, dtype=torch.float64)
        for x, y in data_loader(torch.utils.data.Subset(dataset, mine), batch_size=self.local_batch,
                                collate_fn=self.job.collate):
            with self._autocast():
                out = self.model.module(to_device(x, self.device))
            n = batch_size(x)
            acc += torch.tensor([float(self.job.metric(out.float().cpu(), y)) * n, n], dtype=torch.float64)
        acc = acc.to(self.device)  # NCCL reduces device tensors only
        dist.all_reduce(acc)
        self.model.train()
        return (acc[0] / acc[1].clamp(min=1)).item()

    def train(self) -> None:
        self.model.train()

    # -- state (the checkpoint format of every mode) -------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def state_meta(self) -> dict[str, torch.Tensor]:
        return {k: torch.empty_like(v, device="meta") for k, v in self.module.state_dict().items()}

    def write_state(self, directory: str, step: int, keep_last: int, run: str) -> dict:
        """Rank 0 holds the whole model: its checkpoint holds it too."""
        return {"model": self.state_dict(), "optimizer": {"state": self.optimizer_state()}}

    def load_state(self, ckpt: dict) -> None:
        self.load_state_dict(ckpt["model"])
        self.load_optimizer_state(ckpt["optimizer"]["state"])

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state, strict=True)

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        names = {p: n for n, p in self.module.named_parameters()}
        return {names[p]: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                for p, s in self.optimizer.state.items()}

    def load_optimizer_state(self, state: dict[str, dict[str, Any]]) -> None:
        for name, p in self.module.named_parameters():
            if name in state:
                self.optimizer.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() else v
                                           for k, v in state[name].items()}

    def rng_state(self) -> dict[str, Any]:
        """Every rank's RNG state (called on every rank: a collective)."""
        states = [None] * self.world
        dist.all_gather_object(states, process_rng_state())
        return {"processes": {f"rank{r}": s for r, s in enumerate(states)}, "stages": {"ddp": [str(self.world)]}}

    def load_rng_state(self, saved: dict[str, Any] | None) -> bool:
        """Restore this rank's RNG if the checkpoint came from as many DDP ranks."""
        if not saved or saved.get("stages") != {"ddp": [str(self.world)]}:
            return False
        set_process_rng_state(saved["processes"][f"rank{self.rank}"])
        return True

    def step_metrics(self) -> dict:
        return {"lr": self.optimizer.param_groups[0]["lr"]}

    def epoch_metrics(self) -> dict:
        import resource
        return {"rank0_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

    def scheduler_state(self) -> dict:
        return scheduler_state(self.scheduler, self.optimizer)

    def load_scheduler_state(self, state) -> None:
        load_scheduler_state(self.scheduler, self.optimizer, state)

    @property
    def loss_scale(self) -> float | None:
        """fp16's GradScaler scale (None without fp16), so checkpoints carry it as in pipeline mode."""
        return self.scaler.get_scale() if self.scaler is not None else None

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        if self.scaler is not None:
            self.scaler.update(value)

    def summary(self, console) -> None:
        """Nothing per rank to add to the run's summary."""

    def describe(self) -> str:
        return (f"DDP on {self.world} ranks ({'nccl' if self.device.type == 'cuda' else 'gloo'}), "
                f"{self.local_batch} samples per rank, accumulate {self.job.accumulate}, {self.job.precision}")

    def explain(self, exc: BaseException) -> BaseException:
        beats = self.served.heartbeats
        return beats.explain(exc) if beats is not None else exc

    def barrier(self) -> None:
        dist.barrier()

    # [Note: DDP checkpoints are rank 0's]
    # Checkpoint folders may be node-local: only rank 0 writes, and on resume rank 0 reads
    # its latest checkpoint and sends it to every rank, so no rank resumes at another step
    # from a folder of its own. While rank 0 writes, the others wait on a key of the
    # rendezvous store, not in the next collective: a write longer than the collective
    # timeout (a slow disk, a big model) must not fail the job. They stop waiting when
    # rank 0 says the write ended (or failed), or when rank 0's heartbeats have been silent
    # for hang_timeout (300 s if unset).
    @contextlib.contextmanager
    def saving(self, step: int):
        beats = self.served.heartbeats
        key = f"rpcmp/saved/{step}"
        if self.is_main:
            ok = False
            try:
                yield True
                ok = True
            finally:
                if beats is not None:
                    beats.store.set(key, "ok" if ok else "failed")
            return
        yield False
        if beats is None:
            return
        while not beats.store.check([key]):
            if beats.silent(self.job.hang_timeout or 300.0, ranks=[0]):
                raise WorkerLostError(self.status.describe(["master"], "stopped answering while writing a checkpoint"))
            time.sleep(0.05)
        if beats.store.get(key) != b"ok":
            raise RunAbortedError(f"rank {self.rank}: rank 0 failed to write the checkpoint of step {step} (its log says why)")

    def after_step(self, step: int, position: tuple[int, int], first: bool = False) -> str | None:
        """DDP mode has no stages to snapshot (Job.spares is pipeline mode's)."""

    def remove_incomplete(self, directory: str) -> list[tuple[str, int]]:
        """Rank 0 writes every file of a DDP checkpoint: it removes what an interrupted save left."""
        from ..core.checkpoint import complete_stems, remove_incomplete
        return remove_incomplete(directory, complete_stems(directory)) if self.is_main else []

    def resume_checkpoint(self, directory: str, run: str | None = None) -> dict | None:
        """Rank 0's latest checkpoint (of run ``run`` if given; or None), on every rank: see [Note: DDP
        checkpoints are rank 0's]."""
        from ..core.checkpoint import latest_checkpoint, load_checkpoint
        box = [None]
        if self.is_main:
            path = latest_checkpoint(directory, run)
            box[0] = load_checkpoint(path) if path else None
        dist.broadcast_object_list(box, src=0)
        return box[0]
