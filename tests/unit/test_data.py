"""The batch order of an epoch: fixed by (seed, epoch), every sample at most once, resumable."""
import torch

from rpcmp.data import epoch_batches, step_groups


def test_an_epochs_batches_are_a_permutation_fixed_by_seed_and_epoch():
    first = epoch_batches(10, 3, seed=1, epoch=0)
    assert [len(b) for b in first] == [3, 3, 3]  # the incomplete batch is dropped
    assert len({i for b in first for i in b}) == 9 and all(0 <= i < 10 for b in first for i in b)
    assert epoch_batches(10, 3, seed=1, epoch=0) == first
    assert epoch_batches(10, 3, seed=1, epoch=1) != first and epoch_batches(10, 3, seed=2, epoch=0) != first


def test_steps_group_batches_and_a_resumed_epoch_starts_at_its_step():
    data = torch.utils.data.TensorDataset(torch.arange(8.0)[:, None], torch.arange(8.0))
    batches = epoch_batches(8, 2, seed=0, epoch=0)
    lazy, steps = step_groups(data, batches, first_step=0, accumulate=2)
    groups = list(lazy)
    assert steps == 2 and len(groups) == 2 and all(len(g) == 2 for g in groups)
    assert sorted(int(v) for g in groups for x, _ in g for v in x.flatten()) == list(range(8))
    lazy, steps = step_groups(data, batches, first_step=1, accumulate=2)
    resumed = list(lazy)
    assert steps == 2 and len(resumed) == 1 and all(torch.equal(a[0], b[0]) for a, b in zip(resumed[0], groups[1]))
