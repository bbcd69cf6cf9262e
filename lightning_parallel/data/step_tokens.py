"""The counted tokens of each optimizer step, known before its first backward: the accumulation window read ahead.

A module whose loss is a mean over counted tokens (it names its token labels in ``context_parallel_plan()``, -100
not counted) is trained on the mean over every counted token of the optimizer step only if each batch's loss is
weighed by its share of the whole step's tokens -- on one device without accumulation that is what the global batch's
mean is. Under gradient accumulation Lightning averages the batches' own means instead (each divided by
``accumulate_grad_batches``), so padded data weighs its tokens by how the step was cut into batches: a run whose
accumulation changes (another data-parallel size for the same global batch, an elastic shrink) would train
differently. The strategies weigh each batch by ``k x n_batch / N_step`` (``k`` the window's batches: the
accumulation, fewer in a short window at an epoch's end, whose loss Lightning still divides by the accumulation --
so with as many counted tokens in every batch the weight is exactly 1 and the training is Lightning's), which needs
``N_step`` -- the tokens of batches not yet run -- before the window's first backward: this module reads the window
ahead.

:func:`attach_step_tokens` swaps the class of a training ``DataLoader`` (the strategies give it a copy of the user's
loader, so the user's object is left as it is; names and length unchanged) for one whose iteration reads each
accumulation window ahead before yielding its first batch -- the windows where Lightning's loop steps:
``accumulate_grad_batches`` batches counted from the epoch's start, the last one shorter at the epoch's end or its
batch limit, and after a mid-epoch resume the resumed position's window only its remaining batches -- counts their
labels (on the host: the batches come from the loader before any transfer) and records the window's count and length
for each of its batches. The strategy's training step takes them in order (:meth:`StepTokens.take`). Nothing is
loaded that the loop would not load, but a window's first batch waits until the whole window is loaded (with fewer
batches queued by the loader's workers than the accumulation, the step waits for the rest) and the window's batches
stay in memory until the loop takes them -- as Hugging Face's ``Trainer`` and torchtitan read a step's batches first.

Not read ahead (the strategies then weigh each batch by its own tokens, summed over dp, and Lightning averages the
accumulated batches): a batch whose labels cannot be counted (the rest of that epoch), and -- decided by the
strategies -- an accumulation of 1 (nothing to read ahead), a fit with several training loaders, anything but a
``DataLoader``, a stateful loader (its saved position would count the batches read ahead), and a module that
overrides a batch-transfer hook (the loop's batch is not the loader's). No collective; no Lightning import.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["StepTokens", "attach_step_tokens", "step_tokens_of"]

_ATTACHED = "_lp_step_tokens"
_CLASSES: dict[type, type] = {}


class StepTokens:
    """What :func:`attach_step_tokens` attaches to a DataLoader (``loader._lp_step_tokens``).

    Args:
        count: ``batch -> counted tokens`` (an int) of one of the loader's batches.
        window: ``() -> (accumulation, batches already run in the epoch, batches the loop takes per epoch or
            None)``, or None when windows do not apply now (the iteration then passes the batches through,
            counting nothing); read when an iteration starts, and the accumulation again at each window.
    """

    def __init__(self, count: Callable[[Any], int],
                 window: Callable[[], tuple[int, int, int | None] | None]) -> None:
        self.count, self.window = count, window
        self._pending: deque[tuple[int, int]] = deque()
        self.error: str | None = None
        """Why the last iteration stopped counting (a batch whose labels could not be counted), or None."""

    def take(self) -> tuple[int, int] | None:
        """``(counted tokens, batches)`` of the window of the next batch the loop runs (this rank's), or None when
        the loader is not iterated through the look-ahead now (then nothing is weighed by windows)."""
        return self._pending.popleft() if self._pending else None

    def iterate(self, batches: Iterator[Any]) -> Iterator[Any]:
        """One epoch of ``batches``, each window read ahead and counted before its first batch is yielded (each
        iteration with its own counts: a new one drops what the last one's loop did not take)."""
        pending: deque[tuple[int, int]] = deque()
        self._pending, self.error = pending, None
        start = self.window()
        if start is None:
            yield from batches
            return
        position = start[1]
        while True:
            now = self.window()  # the accumulation of this window (a scheduler may change it between epochs)
            if now is None:
                break
            accumulation, limit = max(int(now[0]), 1), now[2]
            if limit is not None and position >= limit:
                return
            end = (position // accumulation + 1) * accumulation  # where the loop steps: a multiple from the start
            wanted = end - position if limit is None else min(end, limit) - position
            window = list(itertools.islice(batches, wanted))
            if not window:
                return
            try:
                total = sum(self.count(batch) for batch in window)
            except (ValueError, TypeError, KeyError) as err:  # a batch without countable labels: no windows
                self.error = f"{type(err).__name__}: {err}"  # (the counts already handed out stay: their batches
                yield from window  # may still be on their way to the loop)
                break
            pending.extend([(total, len(window))] * len(window))
            yield from window
            position += len(window)
            if len(window) < wanted:  # the loader ran out inside the window: the epoch's last step
                return
            del window  # the window's batches are the loop's now: not held while the next one is read
        yield from batches


def _windowed_class(original: type) -> type:
    cls = _CLASSES.get(original)
    if cls is None:
        base_iter: Callable[[Any], Iterator[Any]] = original.__iter__  # type: ignore[attr-defined]

        def __iter__(self: Any) -> Iterator[Any]:
            return getattr(self, _ATTACHED).iterate(base_iter(self))

        cls = type(original.__name__, (original,), {"__iter__": __iter__, "_lp_original_class": original})
        cls.__module__ = original.__module__
        cls.__qualname__ = original.__qualname__
        _CLASSES[original] = cls
    return cls


def attach_step_tokens(loader: Any, *, count: Callable[[Any], int],
                       window: Callable[[], tuple[int, int, int | None] | None]) -> StepTokens | None:
    """Make ``loader`` (a ``DataLoader``) read each accumulation window ahead and count its tokens (module
    docstring), in place -- pass a copy (``copy.copy``) to leave the user's object as it is; returns its
    :class:`StepTokens` (the same one when already attached), or None for anything but a ``DataLoader``."""
    if not isinstance(loader, DataLoader):
        return None
    owner = step_tokens_of(loader)
    if owner is None:
        owner = StepTokens(count, window)
        object.__setattr__(loader, _ATTACHED, owner)
        loader.__class__ = _windowed_class(type(loader))
    else:
        owner.count, owner.window = count, window
    return owner


def step_tokens_of(loader: Any) -> StepTokens | None:
    """The :class:`StepTokens` attached by :func:`attach_step_tokens`, or None."""
    owner = getattr(loader, _ATTACHED, None)
    return owner if isinstance(owner, StepTokens) else None
