"""Parameters shared by stages: one parameter in the math, however the model is cut.

[Note: a parameter shared by stages]
A language model's output head is usually its token embedding, transposed (GPT-2, nanoGPT,
Llama with ``tie_word_embeddings``): one ``Parameter`` read by the first stage and by the
last. Each holder stage builds it with the unsplit model's values, so the copies start
equal; to stay one parameter, every holder must step on the *sum* of the holders' gradients
(what autograd gives the one tensor of the unsplit model) with the same optimizer, which
then makes the same update on every copy: they stay equal, bit for bit, step after step.

The sum is made by the master, between the backward (and, with replicas, the average over
the copies) and the optimizer step: it reads each holder's gradient of the shared parameter
from the step's distributed-autograd context, adds them in stage order and writes the sum
back into each context (:func:`sum_shared`). DeepSpeed's ``TiedLayerSpec`` all-reduces
among the holders in a process group of their own instead; here the master already ends
every step, holders may share a process, and a stage that moves to another process (a lost
owner, a re-cut) needs no group rebuilt. The cost is the shared gradient crossing the wire
to the master and back once per holder and step; global-norm clipping counts the parameter
once (:func:`norm_skips`). ``rpcmp plan`` lists what is shared; checkpoints and ``state_dict``
hold the unsplit model's keys, each holder's copy under its own name, all equal.
"""
from __future__ import annotations

import torch.distributed.rpc as rpc

from ..owner import grads as owner_grads
from ..errors import StageError
from ..core.futures import wait_all

__all__ = ["shared_groups", "sum_shared", "norm_skips", "describe"]


def shared_groups(specs) -> dict[str, list[tuple[int, str]]]:
    """The unsplit model's name of each shared parameter -> (stage, its name there), in stage order."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for spec in specs:
        for local, key in spec.tied:
            groups.setdefault(key, []).append((spec.index, local))
    return groups


def sum_shared(pipe, ctx_id: int) -> None:
    """Give every holder of a shared parameter the sum of the holders' gradients in context ``ctx_id``."""
    groups = shared_groups(pipe.specs)
    if not groups:
        return
    asks = [(i, local) for members in groups.values() for i, local in members]
    grads = dict(zip(asks, wait_all([rpc.rpc_async(pipe.places[i].process, owner_grads.shared_grad,
                                                   args=(pipe.pid, i, local, ctx_id)) for i, local in asks])))
    writes = []
    for key, members in groups.items():
        missing = [f"stage {i} ({local})" for i, local in members if grads[(i, local)] is None]
        if missing and len(missing) < len(members):
            raise StageError(f"the shared parameter {key!r} got no gradient on {', '.join(missing)} this step but did on "
                             f"its other holders, so its copies would differ after the step")
        if missing:
            continue
        total = grads[members[0]].clone()
        for member in members[1:]:
            total.add_(grads[member])
        writes += [rpc.rpc_async(pipe.places[i].process, owner_grads.set_shared_grad, args=(pipe.pid, i, local, ctx_id, total))
                   for i, local in members]
    wait_all(writes)


def norm_skips(specs, owners: list[str] | None = None) -> dict:
    """Names of shared parameters the global gradient norm must not count again (every holder
    after the first): per stage, or per owner process (qualified as its ``named_params``) if given."""
    skips: dict = {}
    for members in shared_groups(specs).values():
        for i, local in members[1:]:
            key, name = (i, local) if owners is None else (owners[i], specs[i].prefix + local)
            skips.setdefault(key, set()).add(name)
    return skips if owners is None else {o: tuple(sorted(names)) for o, names in skips.items()}


def describe(specs) -> list[str]:
    """One line per shared parameter, for ``rpcmp plan``."""
    return [f"{key} is shared by " + ", ".join(f"stage {i} (as {local})" for i, local in members)
            for key, members in shared_groups(specs).items()]
