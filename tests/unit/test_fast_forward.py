"""The fast-forward of an ordinary DataLoader (no Trainer): a restored position skips indices, not samples, and the
rest of the epoch is the order the uninterrupted loader had, for every kind of sampler."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler

from lightning_parallel.data import ResumableSampler
from lightning_parallel.data.fast_forward import (
    STATE_KIND,
    FastForwardSampler,
    fast_forward_of,
    is_resumable,
    make_resumable,
    resume_warning,
)


class Counting(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 24) -> None:
        self.n, self.loaded = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded += 1
        return i


class Clock:
    """What the Trainer provides: the epoch, and how many batches the loop has run in it."""

    def __init__(self) -> None:
        self.epoch, self.batches = 0, 0

    def attach(self, loader: DataLoader) -> DataLoader:
        return make_resumable(loader, position=lambda: (self.epoch, self.batches), current_epoch=lambda: self.epoch)


def _epochs(make: Any, stop_epoch: int, stop_batch: int) -> tuple[list[list[list[int]]], dict[str, Any], Counting]:
    """Run epochs 0..stop_epoch of a fresh loader (as the uninterrupted run), saving the state after ``stop_batch``
    batches of ``stop_epoch``; returns every epoch's batches (the whole last epoch too), the state and the dataset."""
    ds = Counting()
    clock = Clock()
    loader = clock.attach(make(ds))
    epochs, state = [], {}
    for epoch in range(stop_epoch + 1):
        clock.epoch = epoch
        sampler = loader.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        batches = []
        for i, batch in enumerate(loader):
            batches.append(batch.tolist() if hasattr(batch, "tolist") else batch)
            clock.batches = i + 1
            if epoch == stop_epoch and i + 1 == stop_batch:
                state = loader.state_dict()
        epochs.append(batches)
    return epochs, state, ds


SAMPLERS = {
    "sequential": lambda ds: DataLoader(ds, batch_size=4),
    "RandomSampler, seeded generator": lambda ds: DataLoader(
        ds, batch_size=4, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(5))),
    "RandomSampler, no generator": lambda ds: DataLoader(ds, batch_size=4, shuffle=True),
    "DistributedSampler shuffled, rank 1 of 2": lambda ds: DataLoader(
        ds, batch_size=3, sampler=DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)),
    "batch_size=None": lambda ds: DataLoader(ds, batch_size=None, sampler=RandomSampler(
        ds, generator=torch.Generator().manual_seed(5))),
}


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_a_restored_loader_continues_the_saved_epoch_exactly(kind: str) -> None:
    make = SAMPLERS[kind]
    torch.manual_seed(0)
    epochs, state, _ = _epochs(make, stop_epoch=1, stop_batch=2)
    assert state["kind"] == STATE_KIND and (state["epoch"], state["batches"]) == (1, 2)

    torch.manual_seed(123)  # the resumed process: another global RNG state, a fresh generator seeded as before
    ds = Counting()
    clock = Clock()
    clock.epoch = 1
    loader = clock.attach(make(ds))
    loader.load_state_dict(state)
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(1)
    rest = [b.tolist() if hasattr(b, "tolist") else b for b in loader]
    assert rest == epochs[1][2:], (kind, rest, epochs[1])
    assert ds.loaded == sum(len(b) if isinstance(b, list) else 1 for b in rest)  # skipped indices loaded nothing
    owner = fast_forward_of(loader)
    assert owner is not None and owner.skipped == 2
    assert len(loader) == len(epochs[1])  # the whole epoch: Lightning counts from the restored batch

    clock.epoch = 2  # the next epoch starts from its beginning
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(2)
    assert len(list(loader)) == len(epochs[1])


def test_the_position_applies_to_its_epoch_only() -> None:
    epochs, state, _ = _epochs(SAMPLERS["sequential"], stop_epoch=0, stop_batch=6)  # the epoch's last batch
    clock = Clock()
    clock.epoch = 1  # Lightning restarted after the epoch's end
    loader = clock.attach(SAMPLERS["sequential"](Counting()))
    loader.load_state_dict(state)
    assert [b.tolist() for b in loader] == epochs[0]


def test_what_is_left_alone() -> None:
    ds = Counting()
    clock = Clock()
    resumable = DataLoader(ds, batch_size=2, sampler=ResumableSampler(ds))  # its data module skips the batches
    assert clock.attach(resumable) is resumable and fast_forward_of(resumable) is None

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(10))

    stream = DataLoader(Stream(), batch_size=2)
    assert clock.attach(stream) is stream and not is_resumable(stream)
    message = resume_warning(stream, epoch=1, batches=3)
    assert message is not None and "Stream" in message and "3 batch(es) already run" in message
    assert "StatefulDataLoader" in message and "weights, optimizer" in message
    assert resume_warning(stream, epoch=1, batches=0) is None

    class StatefulStream(Stream):
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    message = resume_warning(DataLoader(StatefulStream(), batch_size=2), epoch=0, batches=2)
    assert message is not None and "StatefulStream" in message and "neither saves nor restores" in message
    assert resume_warning(DataLoader(ds, batch_size=2), epoch=0, batches=2) is None  # map-style: fast-forwarded


def test_stateful_dataloader_is_honoured() -> None:
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")
    loader = torchdata.StatefulDataLoader(Counting(), batch_size=2)
    assert Clock().attach(loader) is loader and fast_forward_of(loader) is None and is_resumable(loader)


def test_the_wrapper_keeps_the_sampler_interface() -> None:
    ds = Counting()
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True)
    loader = Clock().attach(DataLoader(ds, batch_size=None, sampler=sampler))
    assert isinstance(loader.sampler, FastForwardSampler)
    loader.sampler.set_epoch(4)  # Lightning's _set_sampler_epoch reaches the DistributedSampler
    assert sampler.epoch == 4 and len(loader) == len(sampler)
    with pytest.raises(ValueError, match="not a fast-forward"):
        loader.load_state_dict({"kind": "other"})
