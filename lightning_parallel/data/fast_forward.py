"""Exact mid-epoch resume for ordinary DataLoaders: the sampler's indices are fast-forwarded, no sample is loaded.

Lightning restores the loops' counters from a checkpoint but builds the training DataLoader afresh, so a run resumed
mid-epoch starts the epoch again from its first batch (and warns that the DataLoader is not resumable) -- unless the
loader is stateful. :func:`make_resumable` makes a copy of a user's map-style DataLoader that resumes exactly,
without changing the user's code or object and without anything new in the checkpoint: the position is the one
Lightning restores (the epoch, and the batches the training loop ran in it, ``fit_loop.epoch_loop.batch_progress``),
so it works for every checkpoint of every format, older ones included. When the data is loaded before the restore
(a module reading ``trainer.estimated_stepping_batches`` in ``configure_optimizers``), :func:`reload_after_restore`
has Lightning load it again after it.

Its index sampler (``batch_sampler``, or ``sampler`` when ``batch_size=None``) is wrapped by
:class:`FastForwardSampler`, which draws the epoch's order only when the first batch is asked for (setting the
sampler's epoch first: Lightning sets it after it creates a fit's first iterator, whose workers draw at once) and, on
the first iteration of a resumed epoch, skips the batches already run -- as indices
only. A sampler that draws from a seeded ``torch.Generator`` of its own (``RandomSampler(generator=...)``, also inside
the ``DistributedSamplerWrapper`` Lightning inserts, and ``DataLoader(shuffle=True, generator=...)``) starts again
where the user's code seeds it, so on the first iteration of a resumed fit (mid-epoch or after an epoch-end
checkpoint) the draws of the epochs before it are made again first -- the batches of indices each epoch's loop took,
those the loader's workers drew ahead (``prefetch_factor x num_workers``: near an epoch's end they exhaust the sampler,
which makes its last draw then), and the draw each epoch's iterator makes for its workers' base seed where the loader
shares the generator (without persistent workers): the resumed epoch has the order the uninterrupted run had
(since the last reload, with ``reload_dataloaders_every_n_epochs``, whose schedule the resumed fit keeps:
:func:`_align_reloads`; not for a generator made outside
``train_dataloader()`` when the data is loaded before the restore, nor with reloads plus workers or a shared loader
generator: Lightning iterates a reloaded loader twice at its epoch's start). A checkpoint saved after an epoch's last
batch resumes at the next epoch, with nothing to skip -- also when a loader with workers draws before Lightning's loop
moves past the saved epoch (:func:`_finished_on_restore`).
Exact, then, for ``SequentialSampler``, ``RandomSampler`` with a seeded generator, ``DistributedSampler``
(order from ``seed + epoch``) and the samplers Lightning inserts. A ``RandomSampler`` without a generator draws its
order from the global RNG at the epoch's start, a state no checkpoint holds: the batches run are skipped but the rest
of the epoch comes in another order (:func:`process_training_loader` warns). The position is counted in batches of the
loader: it is the same global position under another data-parallel size when the global batch stays the same
(``dp x`` the per-rank ``batch_size``) and the sampler splits one order over the ranks, as ``DistributedSampler`` does.

Left alone: a loader that is already stateful (torchdata's ``StatefulDataLoader``: Lightning saves and restores it),
one whose sampler is the library's :class:`~lightning_parallel.data.ResumableSampler` (its data module skips the
batches itself), and an ``IterableDataset`` (no sampler to fast-forward: :func:`resume_warning` says what resumes).

The library's strategies apply :func:`process_training_loader` to every DataLoader in ``process_dataloader``;
:class:`~lightning_parallel.callbacks.ResumableDataLoaders` does it under any other strategy (the command line adds
it to every run).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from lightning_parallel.data.resumable import resuming

__all__ = ["FastForward", "FastForwardSampler", "fast_forward_of", "forget_early_load", "is_resumable", "loop_batches",
           "make_resumable", "process_training_loader", "reload_after_restore", "resume_warning",
           "trainer_position"]

_ATTACHED = "_lp_fast_forward"
_CHAIN = ("batch_sampler", "sampler", "_sampler", "dataset")  # where a sampler keeps the sampler it draws from


def _generator_holders(root: Any) -> list[Any]:
    """The samplers of a chain that draw from a ``torch.Generator`` of their own (``generator``), depth first."""
    found: list[Any] = []
    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if obj is None or id(obj) in seen or depth > 5 or isinstance(obj, (torch.Tensor, str, int, float)):
            return
        seen.add(id(obj))
        if isinstance(getattr(obj, "generator", None), torch.Generator):
            found.append(obj)
        for name in _CHAIN:
            child = getattr(obj, name, None)
            # a dataset is walked only when it wraps a sampler (Lightning's _DatasetSamplerWrapper)
            if name == "dataset" and not hasattr(child, "_sampler"):
                continue
            walk(child, depth + 1)

    walk(root, 0)
    return found


def _unseeded_random(root: Any) -> bool:
    """A ``RandomSampler`` without a generator in the chain (its order comes from the global RNG)."""
    stack, seen = [root], set()
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, RandomSampler) and obj.generator is None:
            return True
        stack.extend(getattr(obj, name, None) for name in _CHAIN if name != "dataset" or hasattr(
            getattr(obj, name, None), "_sampler"))
    return False


class FastForwardSampler:
    """Wraps a DataLoader's index sampler (see the module docstring): the same items, its length, its attributes
    (``set_epoch`` reaches a ``DistributedSampler`` used without a batch size); after :meth:`FastForward.resume_at`,
    the next iteration of that epoch starts after the batches already run."""

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
    """What :func:`make_resumable` attaches to a DataLoader (``loader._lp_fast_forward``).

    Args:
        current_epoch: ``() -> epoch``, read when an iteration starts.
        epoch_batches: ``() -> batches the loop takes per epoch`` (the loader's length under the Trainer's
            ``limit_train_batches``; None or unset: the whole epoch). The loop stops asking for batches there, so a
            sampler's last draws (made when it is exhausted) happen only if the loop, or the loader's read-ahead,
            exhausts it; a replayed epoch takes as many.
        seed_generator: the loader's ``generator`` when each epoch's iterator draws its workers' base seed from it
            (without persistent workers).
        read_ahead: the batches of indices the loader's workers draw ahead of the loop.
        reload_every: the Trainer's ``reload_dataloaders_every_n_epochs``.
    """

    def __init__(self, current_epoch: Callable[[], int], epoch_batches: Callable[[], int | None] | None = None,
                 seed_generator: torch.Generator | None = None, read_ahead: int = 0, reload_every: int = 0) -> None:
        self.current_epoch = current_epoch
        self._epoch_batches = epoch_batches
        self.reload_every = reload_every
        """The Trainer's ``reload_dataloaders_every_n_epochs`` (0: the loader serves every epoch of the fit)."""
        self.read_ahead = read_ahead
        """Batches of indices a loader with workers draws ahead of the loop (``prefetch_factor x num_workers``): an
        epoch run to within that many batches of its end exhausts the sampler, which makes its last draws then."""
        self.seed_generator = seed_generator
        """The loader's ``generator`` when each epoch's iterator draws its workers' base seed from it (no persistent
        workers): a replayed epoch makes that draw too, after its indices, as the next epoch's iterator did."""
        self.pending: tuple[int, int] | None = None
        self.skipped = 0
        """Batches skipped by the last resumed iteration (0 when none)."""
        self.replayed = 0
        """Earlier epochs (since the loader's reload) whose random draws the last resumed iteration replayed."""

    def reloaded_at(self, epoch: int) -> int:
        """The epoch whose start built the loader serving ``epoch`` (0 unless the Trainer reloads the training data
        every ``n`` epochs: then ``n x (epoch // n)``, where a generator made by ``train_dataloader`` started)."""
        n = int(self.reload_every or 0)
        return n * (epoch // n) if n > 0 else 0

    def epoch_batches(self) -> int | None:
        """How many batches the loop takes from an epoch (None: all of them)."""
        n = self._epoch_batches() if self._epoch_batches is not None else None
        return int(n) if n is not None and n != float("inf") else None

    def resume_at(self, epoch: int, batches: int) -> None:
        """The next iteration (the first of a resumed fit) resumes at ``epoch``: if it is of ``epoch`` it starts after
        its first ``batches`` batches (0: an epoch-end checkpoint); if of a later epoch (the saved one ended, restarted
        "on last") it skips nothing; if the loop's count still reads an earlier epoch (a loader with workers draws
        before Lightning's loop moves past a finished epoch) it serves ``epoch``. The draws of a seeded generator's
        earlier epochs are made again first."""
        self.pending = (int(epoch), int(batches))

    def iterate(self, inner: Any) -> Iterator[Any]:
        """One epoch of ``inner``'s items (a generator: nothing runs before the first batch is asked for)."""
        pending, self.pending = self.pending, None
        epoch = int(self.current_epoch())
        if pending is not None and pending[0] > epoch:
            # a loader with workers draws when its iterator is created, before the restored loop moves past an epoch
            # saved after its last batch: this iterator serves the epoch the resume names
            epoch = pending[0]
        # the epoch's order: Lightning sets the sampler's epoch after it creates the first iterator of a fit, whose
        # workers draw indices at once (with num_workers > 0 a resumed epoch drew epoch 0's order)
        sampler = getattr(inner, "sampler", inner)  # what Lightning's _set_sampler_epoch reaches, set once
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch) and getattr(sampler, "epoch", None) != epoch:
            set_epoch(epoch)
        resumed = pending is not None and pending[0] <= epoch
        skip = pending[1] if pending is not None and pending[0] == epoch else 0
        self.skipped = self.replayed = 0
        if resumed and epoch and _generator_holders(inner):
            # a seeded generator is where the user's code made it, at epoch 0: the epochs before this one are run
            # again as the loop ran them -- as many batches of indices each (and those the loader's workers drew
            # ahead), no sample, and the draw of the next epoch's iterator for its workers' seed where the loader
            # shares the generator -- so the generator has made the same draws and this epoch's order is the one
            # the saved run drew
            per_epoch = self.epoch_batches()
            drawn = None if per_epoch is None else per_epoch + self.read_ahead
            # a resume past the saved epoch (saved after its last batch, restarted "on last") made an iterator for
            # the saved epoch and dropped it: its draw for its workers' seed is one of the draws replayed here
            epochs = epoch - self.reloaded_at(epoch)
            seeds = epochs - (1 if pending is not None and pending[0] < epoch else 0)
            for replayed in range(epochs):
                for _ in itertools.islice(iter(inner), drawn):
                    pass
                if self.seed_generator is not None and replayed < seeds:
                    torch.empty((), dtype=torch.int64).random_(generator=self.seed_generator)
            self.replayed = epochs
        it = iter(inner)
        for _ in range(skip):
            try:
                next(it)
            except StopIteration:
                return
            self.skipped += 1
        yield from it


def is_resumable(loader: Any) -> bool:
    """True when Lightning will save and restore ``loader``'s position (it has ``state_dict``/``load_state_dict``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _uses_resumable_sampler(loader: DataLoader) -> bool:
    from lightning_parallel.data.resumable import ResumableSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    return any(isinstance(s, ResumableSampler)
               for s in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)))


def make_resumable(loader: Any, *, current_epoch: Callable[[], int],
                   epoch_batches: Callable[[], int | None] | None = None, reload_every: int = 0) -> Any:
    """A copy of a map-style ``DataLoader`` able to resume exactly mid-epoch (module docstring; the user's loader is
    left as it is); returns it.
    :meth:`FastForward.resume_at` (``fast_forward_of(loader)``) then sets where the next iteration starts. The
    arguments are :class:`FastForward`'s.

    Left as it is: anything but a ``DataLoader``, a loader already stateful (torchdata's ``StatefulDataLoader``), an
    ``IterableDataset``'s loader, and one drawing from the library's ``ResumableSampler``."""
    if not isinstance(loader, DataLoader) or is_resumable(loader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if _uses_resumable_sampler(loader) or fast_forward_of(loader) is not None:
        return loader
    loader = copy.copy(loader)  # the user's object stays as it is (validation on it, a later fit, predict)
    loader.__dict__["_iterator"] = None  # a persistent workers' iterator of the original is not shared
    # each iterator draws its workers' base seed from the loader's generator (once per fit with persistent workers)
    persistent = loader.persistent_workers and loader.num_workers > 0
    owner = FastForward(current_epoch, epoch_batches, seed_generator=None if persistent else loader.generator,
                        read_ahead=(loader.prefetch_factor or 0) * loader.num_workers if loader.num_workers else 0,
                        reload_every=reload_every)
    attribute = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    # DataLoader refuses to re-set its samplers after __init__ (a guard against changing a running loader); the
    # wrapper yields the same indices, so it is put in place directly
    object.__setattr__(loader, attribute, FastForwardSampler(getattr(loader, attribute), owner))
    object.__setattr__(loader, _ATTACHED, owner)
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
    is made resumable (:func:`make_resumable`) and, on a resume, set to start after the batches the restored loop
    already ran (mid-epoch) and to replay a seeded generator's earlier epochs (any resume); a loader that cannot be
    fast-forwarded exactly gets a warning saying what resumes.
    Other loaders pass unchanged."""
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    if trainer is None or trainer.state.fn != TrainerFn.FITTING or trainer.state.stage != RunningStage.TRAINING:
        return loader
    # the epoch Lightning sets on the sampler (after an epoch-end checkpoint the loop's "current_epoch" still reads
    # the finished one until the loop starts)
    loader = make_resumable(loader, current_epoch=lambda: int(trainer.fit_loop.epoch_progress.current.processed),
                            epoch_batches=lambda: loop_batches(trainer, loader),
                            reload_every=int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0) or 0))
    fit_loop = trainer.fit_loop
    if resuming(fit_loop):  # (after an epoch-end checkpoint Lightning is not "restarting")
        _resume(trainer, loader)
        fit_loop.__dict__.pop(_LOADED_BEFORE_RESTORE, None)
    else:  # perhaps before the checkpoint is restored: see reload_after_restore
        setattr(fit_loop, _LOADED_BEFORE_RESTORE, True)
    return loader


_LOADED_BEFORE_RESTORE = "_lp_loaded_before_restore"


def reload_after_restore(trainer: Any) -> bool:
    """At the start of a fit's training (``on_train_start``, after the checkpoint is restored): when the training
    data was loaded before the restore -- a module's ``configure_optimizers`` reading the Trainer's
    ``estimated_stepping_batches`` loads it during setup -- and the run resumes mid-epoch, have Lightning load it
    again now (``fit_loop.setup_data`` with its combined loader dropped; the library's strategies then restore the
    RNG states, after the new iterator exists), so the fast-forward, the warnings and a stateful loader's saved
    state see the restored position. Before, such a resumed epoch replayed its first batches. Returns whether it
    did."""
    fit_loop = trainer.fit_loop
    _align_reloads(trainer)
    if not getattr(fit_loop, _LOADED_BEFORE_RESTORE, False):
        return False
    setattr(fit_loop, _LOADED_BEFORE_RESTORE, False)
    if not resuming(fit_loop):  # (an epoch-end checkpoint: resuming, not restarting)
        return False
    fit_loop._combined_loader = None
    fit_loop.setup_data()
    _align_reloads(trainer)  # (setup_data set Lightning's count again)
    return True


def loop_batches(trainer: Any, loader: Any) -> int | None:
    """The batches Lightning's training loop takes from each epoch of ``loader``: its length under the Trainer's
    ``limit_train_batches`` (an int caps it, a fraction scales it), None when it has no length. Computed here rather
    than read from ``trainer.num_training_batches``, which Lightning sets only after it creates the epoch's first
    iterator -- whose workers draw at once."""
    from lightning.fabric.utilities.data import sized_len

    length = sized_len(loader)
    limit = getattr(trainer, "limit_train_batches", 1.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        return length
    if isinstance(limit, int):
        return limit if length is None else min(length, limit)
    return None if length is None else int(length * limit)


def forget_early_load(trainer: Any) -> None:
    """Drop the mark :func:`process_training_loader` leaves when the training data is loaded before the checkpoint is
    restored (at a fit's setup: a mark of an earlier fit must not make this one load its data again)."""
    trainer.fit_loop.__dict__.pop(_LOADED_BEFORE_RESTORE, None)


def _finished_on_restore(fit_loop: Any) -> bool:
    """A loop restored from a checkpoint saved after its epoch's last batch (``on_train_batch_end``): Lightning's
    ``FitLoop.reset`` counts that epoch as processed and runs the next one, without a batch of the saved one (its
    test, read from the same counters before ``reset`` runs; Lightning versions without that rule -- no restart
    stages, before 2.5 -- run the saved epoch's end again, and this is False there)."""
    if not fit_loop.restarting or not hasattr(fit_loop.epoch_loop, "restarted_on_train_batch_end"):
        return False
    epochs, batches = fit_loop.epoch_progress.total, fit_loop.epoch_loop.batch_progress
    mid_epoch = (epochs.started == epochs.ready and epochs.processed == epochs.started - 1
                 and epochs.completed == epochs.processed)
    total = batches.total
    on_batch_end = (total.started == total.ready and total.processed == total.started
                    and total.completed == total.processed - 1)
    return mid_epoch and on_batch_end and bool(batches.is_last_batch)


def _align_reloads(trainer: Any) -> None:
    """On a resumed fit with ``reload_dataloaders_every_n_epochs = n > 1``: Lightning counts the next reload from the
    epoch it resumed at, while the uninterrupted run reloaded at multiples of ``n``; the resumed run is put back on
    that schedule (the loader it serves until then is the one the uninterrupted run built at ``n x (epoch // n)``,
    :meth:`FastForward.reloaded_at`)."""
    fit_loop = trainer.fit_loop
    n = int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0) or 0)
    if n <= 1 or not resuming(fit_loop):
        return
    epoch = int(fit_loop.epoch_progress.current.processed)
    if hasattr(fit_loop, "_last_train_dl_reload_epoch"):  # (set by Lightning to the epoch its setup read)
        fit_loop._last_train_dl_reload_epoch = n * (epoch // n)


def _resume(trainer: Any, loader: Any) -> None:
    """On a resume: set the fast-forward of ``loader`` to start after the batches the restored loop ran in the
    epoch, and warn about what does not resume exactly; at an epoch's boundary, to draw a seeded generator's
    earlier epochs again (nothing to skip)."""
    fit_loop = trainer.fit_loop
    epoch, batches = trainer_position(trainer)
    owner = fast_forward_of(loader)
    if _finished_on_restore(fit_loop):  # the next epoch starts with nothing to skip
        if owner is not None:
            owner.resume_at(int(fit_loop.epoch_progress.current.processed) + 1, 0)
        return
    if fit_loop.epoch_progress.current.processed >= fit_loop.epoch_progress.current.started or batches <= 0:
        # saved at an epoch's boundary: the next epoch is the processed count (the epoch Lightning sets)
        following = int(fit_loop.epoch_progress.current.processed)
        if owner is not None and following > 0:
            owner.resume_at(following, 0)
        return
    messages = [resume_warning(loader, epoch=epoch, batches=batches), partial_step_warning(trainer, batches)]
    if owner is not None:
        owner.resume_at(epoch, batches)
        _silence_lightnings_warning()
        if _unseeded_random(loader.batch_sampler if loader.batch_sampler is not None else loader.sampler):
            messages.append(
                f"lightning-parallel: resuming mid-epoch: the {batches} batch(es) already run in epoch {epoch} are "
                "skipped, but the training DataLoader's RandomSampler has no generator: it draws the epoch's order "
                "from the global RNG at the epoch's start, a state no checkpoint holds, so the rest of this epoch "
                "comes in another order than in the uninterrupted run. Fix: RandomSampler(dataset, "
                "generator=torch.Generator().manual_seed(SEED)) (the resumed epoch then has the saved run's order), "
                "or a DistributedSampler(dataset, shuffle=True, seed=SEED).")
    for message in messages:
        if message and trainer.global_rank == 0:
            import warnings

            warnings.warn(message, UserWarning, stacklevel=2)


def partial_step_warning(trainer: Any, batches: int) -> str:
    """The warning for a resume from a checkpoint written inside an accumulation window (``batches`` run in the epoch
    are not a whole number of windows), or ``""``: the gradients of the window's batches already run are in no
    checkpoint (Lightning saves none), so the resumed run's first step averages the rest of the window only."""
    module = getattr(trainer, "lightning_module", None)
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    if accumulate == 1 or batches % accumulate == 0 or (module is not None and not module.automatic_optimization):
        return ""
    done = batches % accumulate
    return (f"lightning-parallel: resuming from a checkpoint written inside an accumulation window (after {done} of "
            f"its {accumulate} batches, batch {batches} of the epoch): the gradients of those {done} batch(es) are in "
            f"no checkpoint, so the resumed run's first optimizer step averages the window's last {accumulate - done} "
            "batch(es) only, and the run goes on off the uninterrupted one (as Lightning does on one device). Fix: "
            "save on optimizer steps -- ModelCheckpoint(every_n_train_steps=...), a val_check_interval that is a "
            "multiple of accumulate_grad_batches for checkpoints saved after validation, or the library's "
            "PreemptionCheckpoint, which waits for the step's end.")


def _silence_lightnings_warning() -> None:
    """Lightning warns that a mid-epoch resume of a DataLoader without ``state_dict`` is unreliable; this one is
    fast-forwarded, so the warning would be wrong."""
    import warnings

    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch")
