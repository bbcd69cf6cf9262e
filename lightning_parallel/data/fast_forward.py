"""Exact mid-epoch resume for ordinary DataLoaders: the sampler's indices are fast-forwarded, no sample is loaded.

Lightning restores the loops' counters from a checkpoint but builds the training DataLoader afresh, so a run resumed
mid-epoch starts the epoch again from its first batch -- unless the loader is *stateful* (has ``state_dict`` and
``load_state_dict``: Lightning saves it under the fit loop's ``combined_loader`` and restores it before the first
batch). :func:`make_resumable` makes a user's map-style DataLoader stateful without changing the user's code, in
place:

* its index sampler (``batch_sampler``, or ``sampler`` when ``batch_size=None``) is wrapped by
  :class:`FastForwardSampler`, which draws the epoch's order only when the first batch is asked for (after
  Lightning's ``set_epoch``), records the state of every ``torch.Generator`` of the sampler chain and the global RNG
  state at that moment, and after a restore skips the batches already run in the saved epoch -- as indices only;
* ``state_dict()`` is ``{"epoch", "batches", "generators", "rng"}``: the epoch, how many of its batches the training
  loop has run (from the loop, so a prefetched batch does not count), and the RNG states the epoch's order was drawn
  from; ``load_state_dict()`` keeps them for the next iteration of that epoch.

So a resumed epoch has the order the uninterrupted run had and continues after the batches already run, for
``SequentialSampler``, ``RandomSampler`` (with a seeded ``generator``, or none: its seed is drawn from the restored
global RNG), ``DistributedSampler`` (order from ``seed + epoch``) and the samplers Lightning inserts
(``DistributedSampler`` / ``DistributedSamplerWrapper``). The position is counted in batches of the loader; it is the
same global position under another data-parallel size when the global batch stays the same (``dp x`` the per-rank
``batch_size``) and the sampler splits one order over the ranks, as ``DistributedSampler`` does.

Left alone: a loader that is already stateful (torchdata's ``StatefulDataLoader``: Lightning saves and restores it),
one whose sampler is the library's :class:`~lightning_parallel.data.ResumableSampler` (its data module skips the
batches itself), and an ``IterableDataset`` (no sampler to fast-forward: :func:`resume_warning` says what resumes).

The library's strategies apply :func:`make_resumable` to the training DataLoader in ``process_dataloader``;
:class:`~lightning_parallel.callbacks.ResumableDataLoaders` does it under any other strategy (the command line adds
it to every run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

__all__ = ["STATE_KIND", "FastForwardSampler", "is_resumable", "make_resumable", "resume_warning",
           "trainer_position"]

STATE_KIND = "lightning_parallel.fast_forward"
"""The ``kind`` of the state :func:`make_resumable` saves (a checkpoint's ``loops.fit_loop.state_dict.combined_loader``
entry)."""

_ATTACHED = "_lp_fast_forward"
_CHAIN = ("batch_sampler", "sampler", "_sampler", "dataset")  # where a sampler keeps the sampler it draws from


def _generators(root: Any) -> list[torch.Generator]:
    """Every ``torch.Generator`` a sampler chain holds as ``generator``, in a fixed order (depth first)."""
    found: list[torch.Generator] = []
    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if obj is None or id(obj) in seen or depth > 5 or isinstance(obj, (torch.Tensor, str, int, float)):
            return
        seen.add(id(obj))
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and id(gen) not in seen:
            seen.add(id(gen))
            found.append(gen)
        for name in _CHAIN:
            child = getattr(obj, name, None)
            # a dataset is walked only when it wraps a sampler (Lightning's _DatasetSamplerWrapper)
            if name == "dataset" and not hasattr(child, "_sampler"):
                continue
            walk(child, depth + 1)

    walk(root, 0)
    return found


@contextlib.contextmanager
def _global_rng(state: torch.Tensor | None) -> Iterator[None]:
    """Run the block with torch's global CPU RNG set to ``state`` (then put back as it was); no-op for None."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        yield


class FastForwardSampler:
    """Wraps a DataLoader's index sampler (see the module docstring): the same items, its length, its attributes
    (``set_epoch`` reaches a ``DistributedSampler`` used without a batch size); after :meth:`FastForward.load`, the
    next iteration of the saved epoch starts after the batches already run, with the saved RNG states."""

    def __init__(self, inner: Any, owner: FastForward) -> None:
        self.inner = inner
        self._owner = owner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        return self._owner.iterate(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "_owner"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class FastForward:
    """The state attached to a resumable DataLoader (``loader._lp_fast_forward``).

    Args:
        position: ``() -> (epoch, batches run in it)``, read when Lightning saves a checkpoint.
        current_epoch: ``() -> epoch``, read when an iteration starts (a restored position applies to its epoch only).
    """

    def __init__(self, position: Callable[[], tuple[int, int]], current_epoch: Callable[[], int]) -> None:
        self.position, self.current_epoch = position, current_epoch
        self.pending: dict[str, Any] | None = None
        self.drawn_from: dict[str, Any] = {"generators": [], "rng": None}
        """The RNG states the current epoch's order was drawn from (saved with the position)."""
        self.skipped = 0
        """Batches skipped by the last restored iteration (0 when none)."""

    def state_dict(self) -> dict[str, Any]:
        epoch, batches = self.position()
        return {"kind": STATE_KIND, "epoch": int(epoch), "batches": int(batches),
                "generators": [g.clone() for g in self.drawn_from["generators"]], "rng": self.drawn_from["rng"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != STATE_KIND:
            raise ValueError(f"not a fast-forward DataLoader state (kind {state.get('kind')!r}, keys {sorted(state)}); "
                             "the checkpoint's training DataLoader was another stateful loader.")
        self.pending = dict(state)

    @staticmethod
    def fallback_note(epoch: int, batches: int) -> str:
        """The warning for a checkpoint without this loader's saved state whose sampler draws a random order."""
        return (f"lightning-parallel: the checkpoint holds no position of the training DataLoader (written before it "
                f"was made resumable, or by another loader); the run skips the {batches} batch(es) already run in "
                f"epoch {epoch}, but the sampler draws its random order now, not from the RNG state of the saved "
                "run, so the remaining batches of this epoch may differ from the uninterrupted run's. Checkpoints "
                "written from now on hold the position and its RNG state.")

    def iterate(self, inner: Any) -> Iterator[Any]:
        """One epoch of ``inner``'s items (a generator: nothing runs before the first batch is asked for)."""
        pending, self.pending = self.pending, None
        if pending is not None and int(pending["epoch"]) != int(self.current_epoch()):
            pending = None  # saved at an epoch's end: the next epoch starts from its beginning
        generators = _generators(inner)
        saved = pending.get("generators") if pending is not None else None
        if saved is not None and len(saved) == len(generators):
            for gen, state in zip(generators, saved, strict=True):
                gen.set_state(state)
        rng = pending.get("rng") if pending is not None else None
        self.drawn_from = {"generators": [g.get_state() for g in generators],
                           "rng": rng if rng is not None else torch.get_rng_state()}
        skip = int(pending["batches"]) if pending is not None else 0
        self.skipped = 0
        it = iter(inner)
        with _global_rng(rng):  # a RandomSampler without a generator draws its seed here, as in the saved run
            for _ in range(skip):
                try:
                    next(it)
                except StopIteration:
                    return
                self.skipped += 1
            try:
                first = next(it)
            except StopIteration:
                return
        yield first
        yield from it


def is_resumable(loader: Any) -> bool:
    """True when Lightning will save and restore ``loader``'s position (it has ``state_dict``/``load_state_dict``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _uses_resumable_sampler(loader: DataLoader) -> bool:
    from lightning_parallel.data.resumable import ResumableSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    return any(isinstance(s, ResumableSampler)
               for s in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)))


def make_resumable(loader: Any, *, position: Callable[[], tuple[int, int]],
                   current_epoch: Callable[[], int]) -> Any:
    """Make a map-style ``DataLoader`` resume exactly mid-epoch (module docstring), in place; returns it.

    Left as it is: anything but a ``DataLoader``, a loader already stateful (torchdata's ``StatefulDataLoader``), an
    ``IterableDataset``'s loader, and one drawing from the library's ``ResumableSampler``."""
    if not isinstance(loader, DataLoader) or is_resumable(loader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if _uses_resumable_sampler(loader):
        return loader
    owner = FastForward(position, current_epoch)
    attribute = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    # DataLoader refuses to re-set its samplers after __init__ (a guard against changing a running loader); the
    # wrapper yields the same indices, so it is put in place directly
    object.__setattr__(loader, attribute, FastForwardSampler(getattr(loader, attribute), owner))
    object.__setattr__(loader, _ATTACHED, owner)
    loader.state_dict = owner.state_dict  # type: ignore[method-assign]
    loader.load_state_dict = owner.load_state_dict  # type: ignore[attr-defined]
    return loader


def fast_forward_of(loader: Any) -> FastForward | None:
    """The :class:`FastForward` attached by :func:`make_resumable`, or None."""
    owner = getattr(loader, _ATTACHED, None)
    return owner if isinstance(owner, FastForward) else None


def resume_warning(loader: Any, *, epoch: int, batches: int) -> str | None:
    """What a run resumed at batch ``batches`` of epoch ``epoch`` with ``loader`` cannot restore, or None.

    An ``IterableDataset`` has no sampler to fast-forward: without a stateful loader its data restarts from the
    beginning of the stream."""
    if batches <= 0 or not isinstance(loader, DataLoader) or is_resumable(loader):
        return None
    dataset = loader.dataset
    if not isinstance(dataset, IterableDataset):
        return None
    name = type(dataset).__name__
    restored = (f"the weights, optimizer, LR schedulers, RNG states and loop counters come back (epoch {epoch}, "
                f"{batches} batch(es) into it)")
    if is_resumable(dataset):
        return (f"lightning-parallel: resuming mid-epoch, {restored}, but the training DataLoader reads the "
                f"IterableDataset {name}, whose state_dict() a plain DataLoader neither saves nor restores: its data "
                f"restarts from the beginning of the stream, so the {batches} batch(es) already run in this epoch are "
                "seen again. Fix: wrap it in torchdata's StatefulDataLoader (it saves and restores the dataset's "
                "state_dict, and Lightning keeps it in the checkpoint).")
    return (f"lightning-parallel: resuming mid-epoch, {restored}, but the training DataLoader reads the "
            f"IterableDataset {name}, which has no state_dict()/load_state_dict(): nothing records how far into the "
            f"stream the run was, so its data restarts from the beginning and the {batches} batch(es) already run "
            "in this epoch are seen again. Fix: give the dataset state_dict()/load_state_dict() and load it with "
            "torchdata's StatefulDataLoader, or use a map-style dataset (a sampler's position is fast-forwarded "
            "exactly), or resume from an end-of-epoch checkpoint.")


def trainer_position(trainer: Any) -> tuple[int, int]:
    """``(epoch, training batches run in it)`` of a Lightning Trainer (what a checkpoint saved now resumes from)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return int(trainer.current_epoch), int(progress.processed)


def process_training_loader(trainer: Any, loader: Any) -> Any:
    """What a strategy's ``process_dataloader`` does with ``loader`` (any stage): the training DataLoader of a fit
    is made resumable (:func:`make_resumable`); on a mid-epoch resume, a loader that cannot be fast-forwarded gets
    :func:`resume_warning`. Other loaders pass unchanged."""
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    if trainer is None or trainer.state.fn != TrainerFn.FITTING or trainer.state.stage != RunningStage.TRAINING:
        return loader
    loader = make_resumable(loader, position=lambda: trainer_position(trainer),
                            current_epoch=lambda: int(trainer.current_epoch))
    fit_loop = trainer.fit_loop
    if not fit_loop.restarting:
        return loader
    epoch, batches = trainer_position(trainer)
    if fit_loop.epoch_progress.current.processed >= fit_loop.epoch_progress.current.started or batches <= 0:
        return loader  # saved at an epoch's boundary: nothing to skip
    messages = [resume_warning(loader, epoch=epoch, batches=batches)]
    owner = fast_forward_of(loader)
    if owner is not None:
        # a checkpoint that holds no position of this loader (written before it was made resumable) still resumes at
        # the loop's restored position; Lightning replaces this with the saved state when the checkpoint has one
        owner.pending = {"kind": STATE_KIND, "epoch": epoch, "batches": batches, "generators": None, "rng": None}
        if _generators(loader.batch_sampler if loader.batch_sampler is not None else loader.sampler) or isinstance(
                getattr(loader, "sampler", None), RandomSampler):
            messages.append(owner.fallback_note(epoch, batches))
    for message in messages:
        if message and trainer.global_rank == 0:
            import warnings

            warnings.warn(message, UserWarning, stacklevel=2)
    return loader
