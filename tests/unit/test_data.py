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


def test_a_job_s_collate_makes_its_batches_of_samples_of_different_lengths():
    """Job(collate=...): a language model's samples padded to the longest of each batch (torch's own collate cannot
    stack them); the training batches, the first batch a plan traces with, and the refusal of what is not callable."""
    import pytest
    import rpcmp
    from rpcmp.data import first_batch
    from rpcmp.errors import JobError
    samples = [torch.arange(n) for n in (3, 5, 2, 4)]

    def pad(items):
        x = torch.nn.utils.rnn.pad_sequence([s for s, _ in items], batch_first=True)
        return x, torch.tensor([len(s) for s, _ in items])
    data = [(s, len(s)) for s in samples]
    lazy, _ = step_groups(data, [[0, 1], [2, 3]], first_step=0, accumulate=1, collate=pad)
    assert [tuple(g[0][0].shape) for g in lazy] == [(2, 5), (2, 4)]
    job = rpcmp.Job(stages=[torch.nn.Linear(1, 1)], data=lambda: (data, None), loss=lambda o, y: o, batch_size=2,
                    collate=pad)
    assert first_batch(job).tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]]
    with pytest.raises(JobError, match="Job.collate must be None"):
        rpcmp.Job(stages=[torch.nn.Linear(1, 1)], collate="pad")


def test_a_dataset_whose_samples_are_not_taken_by_index_is_refused_saying_what_to_give():
    """A stream (an IterableDataset) ended the run with TypeError: object of type ... has no len()."""
    import dataclasses

    import pytest

    from helpers import load
    from rpcmp.data import datasets
    from rpcmp.errors import JobError

    class Stream(torch.utils.data.IterableDataset):
        def __len__(self):  # a length does not make it indexable
            return 8

        def __iter__(self):
            yield from ((torch.zeros(16), torch.zeros(8)) for _ in range(8))
    job = load("mlp")
    for train, heldout, role in ((Stream(), None, "training"), (list(job.data()[0]), Stream(), "held-out")):
        with pytest.raises(JobError, match=f"a Stream as its {role} dataset, whose samples are not taken by index.*"
                                           f"map-style dataset"):
            datasets(dataclasses.replace(job, data=lambda: (train, heldout)))
    assert datasets(dataclasses.replace(job, data=lambda: (list(job.data()[0]), None)))[1] is None  # a list is one
