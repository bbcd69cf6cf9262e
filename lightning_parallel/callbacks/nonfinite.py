"""``NonFiniteLossGuard``: a training loss that becomes NaN or infinite stops the run on the step it happens, on every
rank, and never reaches a checkpoint.

Every strategy of the library installs one (``action="stop"``) when training starts, unless the Trainer already has
one (a recipe may name ``lightning_parallel.callbacks.NonFiniteLossGuard`` with ``action: skip`` or ``off``).

How (``stop``): at the end of each training batch -- before ``ModelCheckpoint`` saves, which Lightning runs last --
the loss the step returned is checked on every rank. In a multi-rank run the ranks agree in one all-reduce of three
numbers (this rank's loss, its preemption flag, 1): the sum of the losses is finite only where every rank's is, and
only then is the batch's mean loss the sum over the count. That all-reduce *replaces* Lightning's per-batch
broadcast of the preemption flag (``_broadcast_sigterm_tensor``, one collective and one host sync per batch): the
check adds no collective and no host synchronisation (nor is it booked by the communication counter: it is control
traffic, as the broadcast it replaces). The library's strategies sum these numbers in the all-reduce of the step's
logged values at the end of the training step (:meth:`NonFiniteLossGuard.local_numbers`,
:meth:`NonFiniteLossGuard.agree`): one collective per batch for both; a pipeline's loss rides in them too (its last
stage's ranks count their loss, the others only their preemption flag) in place of the loss's broadcast over ``pp``.
Only where no strategy does (``lp_dp``'s one process, another library's strategy) the batch's end all-reduces them
alone. A preemption (SIGTERM) agreed there stops every rank at the start of the next
batch, where Lightning stops it -- after the batch that ends an optimizer step: in the middle of a gradient
accumulation the ranks go on to the window's last batch first, so that a preemption checkpoint never holds part of a
step's batches (its resumed run would lose their gradient). A single process reads the loss once per batch
(``.item()``); there Lightning's own flag stops the run at the next batch, accumulation or not.

On a non-finite loss every rank raises :class:`NonFiniteLossError` naming the step, the last finite loss and its
step, and the newest checkpoint saved before it; from then on every library format's ``save`` writes nothing (a
``ModelCheckpoint(save_on_exception=True)`` included), so ``last.ckpt`` keeps the last finite state.

``skip``: a step whose loss is not finite on any rank skips its optimizer update on every rank (weights and optimizer
state unchanged; the step still counts, so LR schedules advance) and training goes on; the skipped steps are counted
and printed. It costs one more all-reduce per optimizer step (the check must come before the update). Not for
``lp_zero_offload``, whose DeepSpeed engine owns the step (refused before any rank starts).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from typing_extensions import override

from lightning_parallel.checkpoint.formats.common import REFUSE_SAVES_ATTR
from lightning_parallel.parallel.counters import uncounted_all_reduce
from lightning_parallel.parallel.tensor.local import plain

__all__ = ["NoTrainingStepError", "NonFiniteLossError", "NonFiniteLossGuard", "SkippedStep", "install"]

Action = Literal["stop", "skip", "off"]


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the message says where, the last finite loss and the checkpoint to
    resume from. Raised on every rank at the same step."""

    every_rank_stops = True
    """Read by the watchdog: no rank is to blame or to end."""


class NoTrainingStepError(RuntimeError):
    """``fit`` ended after 0 training steps although it was asked to train (an empty or iterable training set that
    gave no batch): an error on every rank, not a silent success."""

    every_rank_stops = True


class SkippedStep(Exception):
    """Raised inside the optimizer step (``action="skip"``) so that the update does not happen; the library's
    strategies catch it around the optimizer step."""


def _loss_of(outputs: Any) -> Tensor | None:
    """The training step's loss, detached; a tensor-parallel loss (a DTensor) as a plain tensor."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(loss, Tensor):
        return None
    return plain(loss.detach())


class NonFiniteLossGuard(Callback):
    """Stop (or skip the step) when the training loss is NaN or infinite.

    Args:
        action: ``stop`` (default): every rank stops on the step it happens with :class:`NonFiniteLossError`, and
            nothing is saved after it. ``skip``: the step's optimizer update is skipped on every rank and training
            goes on (one more all-reduce per step). ``off``: no check.
    """

    def __init__(self, action: Action = "stop") -> None:
        if action not in ("stop", "skip", "off"):
            raise ValueError(f"NonFiniteLossGuard(action={action!r}) is not one of ['stop', 'skip', 'off'].")
        self.action: Action = action
        self.skipped: list[int] = []
        """The steps whose update was skipped (``action="skip"``)."""
        self._trainer: pl.Trainer | None = None
        self._step = 0
        self._batch = 0
        self._last_finite: tuple[int, float] | None = None
        self._sigterm_agreed = False
        self._sigterm_pending = False
        self._sigterm_asked = False
        self._pending_bad: Tensor | bool = False
        self._patched: Any = None
        self._agreed: tuple[int, int, Tensor] | None = None
        self._tails: dict[tuple[torch.device, float], Tensor] = {}
        self._local_loss: Tensor | None = None

    # ------------------------------------------------------------------ wiring
    def attach(self, trainer: pl.Trainer) -> None:
        """Take over Lightning's per-batch preemption broadcast in a multi-rank run (see the module docstring);
        idempotent."""
        if self._trainer is trainer or self.action == "off":
            return
        self._trainer = trainer
        self._sigterm_pending = self._sigterm_agreed = False  # a guard reused by another fit starts unstopped
        loop = trainer.fit_loop.epoch_loop
        if _multi_rank(trainer) and hasattr(loop, "_broadcast_sigterm_tensor"):
            self._patched = loop
            loop._broadcast_sigterm_tensor = self._agreed_sigterm  # type: ignore[method-assign]

    def detach(self) -> None:
        if self._patched is not None and "_broadcast_sigterm_tensor" in vars(self._patched):
            del self._patched._broadcast_sigterm_tensor
        self._patched = None
        self._trainer = None

    @property
    def agrees_on_preemption(self) -> bool:
        """Whether this guard agrees on preemptions for the ranks (a multi-rank run with the check on): the signal
        handlers then call :meth:`request_stop` instead of setting Lightning's flag, which Lightning reads rank by
        rank at the end of a batch -- a rank whose signal came a moment earlier would stop alone."""
        return self._patched is not None

    def request_stop(self) -> None:
        """A preemption asked for on this rank (SIGTERM, the first Ctrl-C): agreed on at the end of this batch."""
        self._sigterm_asked = True

    def _agreed_sigterm(self) -> None:
        """In place of Lightning's broadcast at the start of a batch: the preemption the ranks agreed on at the end of
        the previous one."""
        if self._sigterm_agreed:
            trainer = self._trainer
            connector = getattr(trainer, "_signal_connector", None)
            if connector is not None:
                connector.received_sigterm = True  # what Lightning's loops and callbacks read from now on
            raise SIGTERMException()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.attach(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.detach()
        asked = trainer.max_steps != 0 and trainer.max_epochs != 0 and trainer.limit_train_batches != 0
        # global_step counts the steps taken through Lightning's optimizer wrappers only: a module stepping its
        # own optimizer objects under manual optimization trains with global_step 0, so the batches run count too
        batches = trainer.fit_loop.epoch_loop.batch_progress.total.completed
        if (self.action != "off" and asked and trainer.global_step == 0 and batches == 0
                and not trainer.should_stop):
            raise NoTrainingStepError(
                "fit ended after 0 training steps: the training DataLoader gave no batch (an empty or too small "
                "dataset, or an iterable one that ended at once). Fix: check the data; `lightning-parallel check "
                "--config RECIPE` counts the batches per rank of a sized dataset."
            )

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.detach()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.detach()
        if self.skipped and trainer.is_global_zero:
            print(f"lightning-parallel: skipped {len(self.skipped)} step(s) whose loss was not finite: "
                  f"{self.skipped[:10]}{' ...' if len(self.skipped) > 10 else ''}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the check
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step = int(trainer.global_step) + 1  # the optimizer step this batch belongs to (1-based)
        self._batch = batch_idx

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self.action == "skip":
            bad = ~torch.isfinite(loss.detach()).all()
            self._pending_bad = bad if isinstance(self._pending_bad, bool) and not self._pending_bad else (
                self._pending_bad | bad)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.action != "skip":
            return
        flag = self._pending_bad
        self._pending_bad = False
        local = flag.float().reshape(1) if isinstance(flag, Tensor) else torch.tensor([float(flag)])
        local = local.to(trainer.strategy.root_device)
        if _multi_rank(trainer):
            uncounted_all_reduce(local)
        if float(local.item()) > 0:
            self.skipped.append(self._step)
            raise SkippedStep(f"step {self._step}: the loss is not finite on {int(local.item())} rank(s)")

    def local_numbers(self, trainer: pl.Trainer, outputs: Any, *, counted: bool = True) -> Tensor | None:
        """This rank's numbers of the batch's agreement, to be summed over every rank: its loss (``outputs``: the
        training step's; its mean if it has several elements), its preemption flag, 1 -- summed, the first is finite
        only if every rank's loss is, and over the last it gives the mean loss. ``counted=False``: this rank holds no
        loss of its own (a pipeline stage before the last): only its preemption flag counts. None with the check off.
        The library's strategies sum them in the all-reduce of their logged values and hand the sum to
        :meth:`agree` (a pipeline sums them alone, its loss riding in them); otherwise the batch's end all-reduces
        them alone. Built with as few tensor operations as can be (a step pays each one's dispatch): the loss
        reshaped and concatenated with a cached ``[flag, 1]``."""
        if self.action == "off":
            return None
        device = trainer.strategy.root_device
        sigterm = float(self._sigterm_asked or bool(getattr(trainer, "received_sigterm", False)))
        loss = self._local_loss = _loss_of(outputs) if counted else None
        if loss is None:
            return torch.tensor([0.0, sigterm, 1.0 if counted else 0.0], device=device)
        if loss.numel() != 1:
            loss = loss.float().mean()
        elif loss.dtype != torch.float32:
            loss = loss.float()
        if loss.device != device:
            loss = loss.to(device)
        tail = self._tails.get((device, sigterm))
        if tail is None:  # read only (the all-reduce runs on the concatenation, a new tensor)
            tail = self._tails[(device, sigterm)] = torch.tensor([sigterm, 1.0], device=device)
        return torch.cat((loss.reshape(1), tail))

    def agree(self, numbers: Tensor) -> None:
        """The batch's numbers (:meth:`local_numbers`), already summed over every rank by the strategy."""
        self._agreed = (self._step, self._batch, numbers)

    @staticmethod
    def agreed_loss(numbers: Tensor) -> Tensor:
        """The batch's mean loss over the ranks that counted one, from the summed numbers (not finite where any rank's
        loss was not); no host synchronisation."""
        total, _, ranks = numbers.unbind()
        return total / ranks.clamp(min=1)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.action == "off":
            return
        self.attach(trainer)
        agreed, self._agreed = self._agreed, None
        if agreed is not None and agreed[:2] == (self._step, self._batch):
            numbers = agreed[2]
        else:
            local = self.local_numbers(trainer, outputs)
            assert local is not None
            numbers = local
            if _multi_rank(trainer):
                uncounted_all_reduce(numbers)  # replaces Lightning's per-batch broadcast of the preemption flag
        total, sigterms, ranks = numbers.tolist()  # the one host sync of the batch
        self._sigterm_pending = self._sigterm_pending or sigterms > 0
        # the stop waits for the end of the optimizer step: a step's accumulated batches are saved whole or not at all
        self._sigterm_agreed = self._sigterm_pending and _ended_a_step(trainer)
        if math.isfinite(total):
            if _loss_of(outputs) is not None:
                self._last_finite = (self._step, total / ranks)
            return
        if self.action == "skip":
            return
        # some rank's loss is not finite (or the finite losses' sum overflowed): every rank sees the same sum and
        # comes here, so they can count the ranks whose own loss is not (a second all-reduce, on this path only)
        bad_ranks = self._bad_ranks(trainer)
        if bad_ranks == 0:
            return
        trainer.should_stop = True
        message = self.message(trainer, bad_ranks=int(bad_ranks), ranks=int(ranks), value=_loss_of(outputs))
        setattr(trainer.strategy, REFUSE_SAVES_ATTR,
                f"the training state is not finite since step {self._step} (its loss was not finite)")
        raise NonFiniteLossError(message)

    def _bad_ranks(self, trainer: pl.Trainer) -> int:
        """How many ranks' own loss of this batch (the one :meth:`local_numbers` counted) is not finite: an
        all-reduce every rank runs."""
        loss = self._local_loss
        bad = torch.tensor([0.0 if loss is None else float(not bool(torch.isfinite(loss).all()))],
                           device=trainer.strategy.root_device)
        if _multi_rank(trainer):
            uncounted_all_reduce(bad)
        return int(bad.item())

    def message(self, trainer: pl.Trainer, *, bad_ranks: int, ranks: int, value: Tensor | None) -> str:
        """What :class:`NonFiniteLossError` says: the step, the last finite loss, the newest checkpoint, the fix."""
        shown = "nan"
        if value is not None:
            bad = value[~torch.isfinite(value)]
            shown = str(float(bad[0].item())) if bad.numel() else "nan"
        where = f" on {bad_ranks} of {ranks} ranks" if ranks > 1 else ""
        last = (f"the last finite loss was {self._last_finite[1]:.6g} at step {self._last_finite[0]}"
                if self._last_finite is not None else "no step before it had a finite loss")
        newest = _newest_checkpoint(trainer)
        resume = (f"The newest checkpoint saved before it: {newest[0]} (after step {newest[1]}); resume from it "
                  f"with --ckpt_path {newest[0]}" if newest is not None else
                  "No checkpoint was saved before it; start again")
        return (f"the training loss became {shown} in step {self._step} (batch {self._batch} of epoch "
                f"{trainer.current_epoch}){where}; "
                f"{last}. Training stopped there on every rank; nothing after the last finite step is saved. "
                f"{resume} after lowering the learning rate, clipping gradients (trainer.gradient_clip_val) or "
                "checking the data of that step -- or skip such steps with the callback "
                "lightning_parallel.callbacks.NonFiniteLossGuard(action=skip).")


def _ended_a_step(trainer: pl.Trainer) -> bool:
    """Whether the training batch that just ended completed an optimizer step: under automatic optimization the last
    batch of its accumulation window (or of the epoch), as Lightning's loop decided for it; under manual optimization
    every batch (the module steps when it likes); ``lp_zero_offload`` sets DeepSpeed's engine to the same windows.
    Every rank decides the same."""
    module = trainer.lightning_module
    should_accumulate = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
    if module is None or not module.automatic_optimization or not callable(should_accumulate):
        return True
    return not should_accumulate()


def _multi_rank(trainer: pl.Trainer) -> bool:
    return dist.is_available() and dist.is_initialized() and trainer.world_size > 1


def _newest_checkpoint(trainer: pl.Trainer) -> tuple[str, int] | None:
    best: tuple[str, int] | None = None
    for callback in trainer.checkpoint_callbacks:
        path = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
        step = getattr(callback, "_last_global_step_saved", None)
        if path and isinstance(step, int) and (best is None or step > best[1]):
            best = (path, step)
    return best


def install(trainer: pl.Trainer) -> NonFiniteLossGuard:
    """The Trainer's :class:`NonFiniteLossGuard` (``stop`` unless it has one of its own), attached: called by every
    library strategy when training starts."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, NonFiniteLossGuard):
            callback.attach(trainer)
            return callback
    guard = NonFiniteLossGuard()
    # first, so that it catches a non-finite step before any callback saves it (ModelCheckpoint, and callbacks that
    # save from on_train_batch_end as PeriodicCheckpoint does) -- but behind a tuner's own callback: Lightning's
    # learning-rate finder runs its fit with [its callback] and reads it back as trainer.callbacks[0]
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    first = 0
    while first < len(callbacks) and _is_tuner_callback(callbacks[first]):
        first += 1
    callbacks.insert(first, guard)
    guard.attach(trainer)
    return guard


def _is_tuner_callback(callback: Any) -> bool:
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

    return (isinstance(callback, (BatchSizeFinder, LearningRateFinder))
            or type(callback).__module__.startswith("lightning.pytorch.tuner"))

