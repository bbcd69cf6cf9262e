"""The accumulation windows read ahead (``lightning_parallel.data.step_tokens``): which batches each window holds
(from the epoch's start or a resumed position, shorter at the epoch's end, its batch limit or the data's end), that
the loop sees the loader's batches unchanged, and what is left alone. Pure logic: no process group, no Trainer."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.data.step_tokens import StepTokens, attach_step_tokens, step_tokens_of


def _loader(samples: int = 9) -> DataLoader:
    # sample i counts i + 1 tokens: a batch's count names its samples
    labels = torch.full((samples, 10), -100)
    for i in range(samples):
        labels[i, : i + 1] = 1
    return DataLoader(TensorDataset(torch.arange(samples), labels), batch_size=1)


def _count(batch: Any) -> int:
    return int((batch[1] != -100).sum())


def _run(accumulation: int, start: int = 0, limit: int | None = None, samples: int = 9
         ) -> tuple[list[int], list[tuple[int, int] | None]]:
    return _run_with(lambda: (accumulation, start, limit), samples)


def _run_with(window: Any, samples: int) -> tuple[list[int], list[tuple[int, int] | None]]:
    loader = _loader(samples)
    owner = attach_step_tokens(loader, count=_count, window=window)
    assert owner is not None
    seen, taken = [], []
    for batch in loader:
        seen.append(int(batch[0]))
        taken.append(owner.take())
    return seen, taken


def test_windows_from_the_epoch_start_with_a_short_last_one() -> None:
    seen, taken = _run(accumulation=2)
    assert seen == list(range(9))  # the loader's batches, in order, each once
    # windows {0,1} {2,3} {4,5} {6,7} {8}: counts 1+2, 3+4, 5+6, 7+8, 9
    assert taken == [(3, 2), (3, 2), (7, 2), (7, 2), (11, 2), (11, 2), (15, 2), (15, 2), (9, 1)]


def test_a_resumed_position_starts_a_partial_window_and_the_limit_cuts_the_last() -> None:
    # positions 3..6 of the epoch: windows {3} {4,5,6}; the loader here yields samples 0.. (in a real resume its
    # sampler skips the batches run), so the windows hold samples {0} and {1,2,3}, and the limit stops it at 4
    seen, taken = _run(accumulation=4, start=3, limit=7, samples=12)
    assert seen == [0, 1, 2, 3]
    assert taken == [(1, 1), (2 + 3 + 4, 3), (9, 3), (9, 3)]


def test_the_data_ending_inside_a_window_closes_it() -> None:
    _, taken = _run(accumulation=4, samples=6)  # windows {0..3} {4,5}
    assert taken == [(10, 4)] * 4 + [(11, 2)] * 2


def test_a_new_epoch_drops_what_the_last_did_not_take_and_the_class_keeps_its_name() -> None:
    loader = _loader(4)
    owner = attach_step_tokens(loader, count=_count, window=lambda: (2, 0, None))
    assert owner is not None and step_tokens_of(loader) is owner
    assert type(loader).__name__ == "DataLoader" and isinstance(loader, DataLoader) and len(loader) == 4
    next(iter(loader))  # the loop stopped early (max_steps): the window's second count is never taken
    assert owner.take() == (3, 2)
    epoch = iter(loader)
    next(epoch)  # the next epoch starts afresh: its first window only
    assert [owner.take() for _ in range(3)] == [(3, 2), (3, 2), None]
    assert attach_step_tokens(loader, count=_count, window=lambda: (2, 0, None)) is owner  # attached once


def test_no_window_or_uncountable_labels_pass_the_batches_through_uncounted() -> None:
    loader = _loader(5)
    owner = attach_step_tokens(loader, count=_count, window=lambda: None)  # accumulation 1, several loaders
    assert owner is not None
    assert [int(b[0]) for b in loader] == list(range(5)) and owner.take() is None

    def fails(batch: Any) -> int:
        if int(batch[0]) >= 2:
            raise ValueError("no labels")
        return _count(batch)

    owner.count, owner.window = fails, lambda: (2, 0, None)
    seen, taken = [], []
    for batch in loader:
        seen.append(int(batch[0]))
        taken.append(owner.take())
    assert seen == list(range(5))  # every batch still reaches the loop, once
    assert taken == [(3, 2), (3, 2), None, None, None] and owner.error == "ValueError: no labels"


def test_the_accumulation_is_read_again_at_each_window() -> None:
    accumulation = iter([2, 2, 3, 3, 3])  # the start, then one read per window
    _, taken = _run_with(lambda: (next(accumulation), 0, None), samples=6)
    # windows end at multiples of the accumulation from the epoch's start, as Lightning's loop steps: {0,1} with 2,
    # then with 3: {2} (up to 3), {3,4,5}
    assert taken == [(3, 2), (3, 2), (3, 1), (15, 3), (15, 3), (15, 3)]


def test_anything_but_a_dataloader_is_left_alone() -> None:
    assert attach_step_tokens([1, 2, 3], count=_count, window=lambda: (2, 0, None)) is None
    assert StepTokens(_count, lambda: (2, 0, None)).take() is None
