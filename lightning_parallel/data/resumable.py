"""Data that resumes mid-epoch: the same remaining batches after a restart, under any data-parallel size.

Lightning restores the loops' counters from a checkpoint but restarts the DataLoader at the start of the epoch, so a
run resumed from a mid-epoch checkpoint sees batches again (and others never) -- unless the loader is stateful. Two
pieces fix that for map-style datasets, without a stateful DataLoader:

* :class:`ResumableSampler` -- a ``DistributedSampler`` whose order depends on ``(seed, epoch)`` only, and which can
  start an epoch after its first ``k`` batches. Rank ``r`` of ``n`` takes items ``r, r + n, ...`` of the epoch's
  order, so the ``b * n`` items of global batch ``s`` are the same for every ``n`` (with per-rank batch ``b`` and the
  same global batch ``b * n``): one device and any dp size see the same global batches, which is what lets a
  checkpoint resume exactly under another layout. Lightning keeps a ``DistributedSampler`` it is given.
* :class:`ResumableDataModuleMixin` -- for a ``LightningDataModule``: its ``state_dict`` records the epoch and the
  batches the training loop has run in it (read from the loop, so Lightning's one-batch prefetch does not count);
  ``load_state_dict`` (called when Lightning restores the checkpoint, before the training DataLoader is built) keeps
  it, and :meth:`~ResumableDataModuleMixin.resumable_sampler` skips those batches in that epoch only.

The skipped batches are skipped as indices (no sample is loaded). ``drop_last=True`` in the DataLoader keeps every
global batch full, as one device would see it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = ["ResumableDataModuleMixin", "ResumableSampler", "resuming"]


class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
    """The epoch's order from ``(seed, epoch)`` (shuffled) or ``0..N-1``; rank ``rank`` of ``num_replicas`` takes every
    ``num_replicas``-th item starting at ``rank``; the first ``skip`` items of this rank are left out in epoch
    ``skip_epoch`` only (a resumed epoch). The tail that does not fill ``num_replicas`` is dropped, so every rank has
    the same number of items; with ``multiple`` (the per-rank items of one optimizer step: batch size x gradient
    accumulation) each rank's items are cut to a multiple of it, so that an epoch is whole optimizer steps -- the same
    global batches, the tail dropped, for every data-parallel size and accumulation with one global batch."""

    def __init__(self, dataset: Sized, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
                 skip: int = 0, skip_epoch: int = 0, multiple: int = 1) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,  # type: ignore[arg-type]
                         drop_last=True)
        self.skip, self.skip_epoch, self.multiple = skip, skip_epoch, max(1, int(multiple))

    def _per_rank(self) -> int:
        per_rank = len(self.dataset) // self.num_replicas  # type: ignore[arg-type]
        return per_rank - per_rank % self.multiple

    def _order(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=g).tolist()
        return list(range(n))

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        per_rank = self._per_rank()
        mine = order[self.rank:per_rank * self.num_replicas:self.num_replicas]
        if self.skip and self.epoch == self.skip_epoch:
            mine = mine[self.skip:]
        return iter(mine)

    def __len__(self) -> int:
        """The whole epoch's items on this rank, the skipped ones included: Lightning restores the batches already
        run (its loop counts from there) and ends the epoch at ``len(dataloader)``; a length without them would
        end a resumed epoch that many batches early (its last batches never run)."""
        return self._per_rank()


class ResumableDataModuleMixin:
    """Mix into a ``LightningDataModule`` (before it) to resume mid-epoch exactly: build the training DataLoader
    with ``sampler=self.resumable_sampler(dataset, batch_size)`` and ``drop_last=True``."""

    trainer: Any

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batches", "samples"}``: the epoch, how many of its training batches have run on each rank, and
        the samples they hold together (``batches x batch_size x`` data-parallel ranks; Lightning saves it in the
        checkpoint under the data module's class name). The samples place a resumed run under any per-rank batch
        size, data-parallel size and gradient accumulation (an elastic restart on fewer ranks)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return {}
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        state = {"epoch": int(trainer.current_epoch), "batches": int(progress.processed)}
        geometry = getattr(self, "_lp_geometry", None)
        if geometry is not None:
            state["samples"] = int(progress.processed) * geometry[0] * geometry[1]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        import warnings

        self._lp_resume = (int(state_dict.get("epoch", 0)), int(state_dict.get("batches", 0)))
        self._lp_resume_samples = state_dict.get("samples")
        # Lightning looks for a stateful DataLoader and warns that a mid-epoch resume is unreliable; here the data
        # module holds the position and the sampler skips what was run, so the warning would be wrong
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch")

    def resumable_sampler(self, dataset: Sized, batch_size: int, *, shuffle: bool = True,
                          seed: int = 0) -> ResumableSampler:
        """The sampler for the training DataLoader: rank and size from the strategy's ``distributed_sampler_kwargs``
        (the dp axis under model-parallel layouts), and after a restore the batches already run in the saved epoch
        skipped."""
        trainer = getattr(self, "trainer", None)
        kwargs: dict[str, Any] = {}
        if trainer is not None and trainer.world_size > 1:
            kwargs = dict(trainer.strategy.distributed_sampler_kwargs or {})
        replicas, rank = int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))
        epoch, batches = getattr(self, "_lp_resume", (0, 0))
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1) if trainer is not None else 1
        multiple = batch_size * accumulate  # an epoch of whole optimizer steps (the same global batches on any dp)
        per_rank = len(dataset) // replicas
        per_rank -= per_rank % multiple
        full_batches = per_rank // batch_size
        skip = batches * batch_size if 0 < batches < full_batches else 0
        samples = getattr(self, "_lp_resume_samples", None)
        if samples is not None and batches:  # the position in samples: right under any batch size, dp, accumulation
            items = int(samples) // replicas
            skip = items if 0 < items < full_batches * batch_size else 0
        loop = getattr(trainer, "fit_loop", None)
        if loop is None or resuming(loop):
            # once the loops are restored (data loaded before it, for estimated_stepping_batches, keeps it): a later
            # epoch or reloaded loader starts over
            self._lp_resume, self._lp_resume_samples = (0, 0), None
        self._lp_geometry = (batch_size, replicas)
        sampler = ResumableSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                                   skip=skip, skip_epoch=epoch, multiple=multiple)
        # Lightning creates (and prefetches from) the first iterator before it calls set_epoch: start at the
        # restored epoch so a resumed run's first epoch has that epoch's order
        sampler.set_epoch(int(trainer.current_epoch) if trainer is not None else 0)
        return sampler


def global_batches(n_items: int, batch_size: int, replicas: int) -> int:
    """How many full global batches of ``batch_size * replicas`` items one epoch of :class:`ResumableSampler` has."""
    return math.floor(n_items / replicas) // batch_size


def resuming(fit_loop: Any) -> bool:
    """The fit resumes from a checkpoint: Lightning's loop is restarting, or (after an epoch-end checkpoint, where it
    is not; ``is_resuming`` exists from Lightning 2.5.3 on: before, such a resume is not seen) resuming."""
    return bool(getattr(fit_loop, "restarting", False) or getattr(fit_loop, "is_resuming", False))
