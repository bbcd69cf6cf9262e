"""The fast-forward of an ordinary DataLoader (no Trainer): a resume position skips indices, not samples, and the
rest of the epoch is the order the uninterrupted loader had, for every kind of sampler with a reproducible order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler

from lightning_parallel.data import ResumableSampler
from lightning_parallel.data.fast_forward import (
    FastForwardSampler,
    _unseeded_random,
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
    """What the Trainer provides: the epoch."""

    def __init__(self) -> None:
        self.epoch = 0

    def attach(self, loader: DataLoader) -> DataLoader:
        return make_resumable(loader, current_epoch=lambda: self.epoch)


def _epochs(make: Any, epochs: int) -> list[list[Any]]:
    """The batches of epochs 0..epochs-1 of a fresh loader (the uninterrupted run)."""
    clock = Clock()
    loader = clock.attach(make(Counting()))
    out = []
    for epoch in range(epochs):
        clock.epoch = epoch
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        out.append([b.tolist() if hasattr(b, "tolist") else b for b in loader])
    return out


SAMPLERS = {
    "sequential": lambda ds: DataLoader(ds, batch_size=4),
    "RandomSampler, seeded generator": lambda ds: DataLoader(
        ds, batch_size=4, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(5))),
    "DistributedSampler shuffled, rank 1 of 2": lambda ds: DataLoader(
        ds, batch_size=3, sampler=DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)),
    "batch_size=None": lambda ds: DataLoader(ds, batch_size=None, sampler=RandomSampler(
        ds, generator=torch.Generator().manual_seed(5))),
}


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_a_resumed_loader_continues_the_epoch_exactly(kind: str) -> None:
    make = SAMPLERS[kind]
    epochs = _epochs(make, 4)

    ds = Counting()  # the resumed process: the user's code builds the loader (and seeds its generator) again
    clock = Clock()
    clock.epoch = 2
    loader = clock.attach(make(ds))
    owner = fast_forward_of(loader)
    assert owner is not None
    owner.resume_at(2, 3)
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(2)
    rest = [b.tolist() if hasattr(b, "tolist") else b for b in loader]
    assert rest == epochs[2][3:], (kind, rest, epochs[2])
    assert ds.loaded == sum(len(b) if isinstance(b, list) else 1 for b in rest)  # skipped indices loaded nothing
    assert owner.skipped == 3
    assert len(loader) == len(epochs[2])  # the whole epoch: Lightning counts from the restored batch

    clock.epoch = 3  # the next epoch is the uninterrupted run's next epoch
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(3)
    assert [b.tolist() if hasattr(b, "tolist") else b for b in loader] == epochs[3]


def test_the_position_applies_to_its_epoch_only() -> None:
    epochs = _epochs(SAMPLERS["sequential"], 1)
    clock = Clock()
    clock.epoch = 1  # Lightning restarted after the end of epoch 0
    loader = clock.attach(SAMPLERS["sequential"](Counting()))
    owner = fast_forward_of(loader)
    assert owner is not None
    owner.resume_at(0, 6)
    assert [b.tolist() for b in loader] == epochs[0] and owner.skipped == 0


def test_an_unseeded_random_sampler_is_seen() -> None:
    ds = Counting()
    assert _unseeded_random(DataLoader(ds, batch_size=4, shuffle=True).batch_sampler)
    assert not _unseeded_random(SAMPLERS["RandomSampler, seeded generator"](ds).batch_sampler)
    assert not _unseeded_random(DataLoader(ds, batch_size=4).batch_sampler)


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
    assert not is_resumable(loader)  # nothing new in the checkpoint: the position is the loop's
