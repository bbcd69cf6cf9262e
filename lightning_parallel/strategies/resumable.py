"""``ResumableDataMixin``: every strategy of the library makes the training DataLoader of a fit resumable mid-epoch,
and reads its accumulation windows ahead when the module's loss is a token mean.

Mixed into a Lightning ``Strategy`` subclass before the Lightning base class (so that ``super().process_dataloader``
is Lightning's): the loader's sampler is fast-forwarded past the batches a restored checkpoint already ran
(:mod:`lightning_parallel.data.fast_forward`); when the module names its token labels
(``context_parallel_plan()['labels']``), the loader counts each optimizer step's tokens before the step's first batch
(:mod:`lightning_parallel.data.step_tokens`), which the strategy's training step takes as :attr:`step_tokens`. No
collective.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ResumableDataMixin"]


class ResumableDataMixin:
    """The training DataLoader resumes mid-epoch exactly
    (:func:`~lightning_parallel.data.fast_forward.make_resumable`) and, for a module naming its token labels, counts
    each accumulation window's tokens ahead (:attr:`step_tokens`)."""

    resumes_dataloaders = True
    """Read by the CLI and the resume checks: this strategy's training DataLoader resumes mid-epoch exactly."""

    step_tokens: Any = None
    """The :class:`~lightning_parallel.data.step_tokens.StepTokens` of the fit's training DataLoader (None: the
    module names no token labels, or the loader is not a ``DataLoader``): one :meth:`~StepTokens.take` per training
    batch."""

    lightning_module: Any
    _labels_of: Any = None
    _labels: Any = None

    def token_labels(self, module: Any = None) -> Any:
        """The token labels the ``context_parallel_plan()`` of ``module`` (default: the Lightning module) names
        (:func:`~lightning_parallel.parallel.context_parallel.loss_labels`), read once per module; None without."""
        from lightning_parallel.parallel.context_parallel import loss_labels

        module = self.lightning_module if module is None else module
        if module is None:
            return None
        if self._labels_of is not module:
            self._labels_of, self._labels = module, loss_labels(module)
        return self._labels

    def on_train_start(self) -> None:
        """After the checkpoint is restored: the training data loaded before it is loaded again on a mid-epoch
        resume (:func:`~lightning_parallel.data.fast_forward.reload_after_restore`)."""
        from lightning_parallel.data.fast_forward import reload_after_restore

        super().on_train_start()  # type: ignore[misc]
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            reload_after_restore(module._trainer)

    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader of a fit, made resumable mid-epoch (and read ahead by accumulation window when
        the module's loss is a token mean); other loaders as Lightning processes them."""
        from lightning_parallel.data.fast_forward import process_training_loader

        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        processed = process_training_loader(trainer, super().process_dataloader(dataloader))  # type: ignore[misc]
        if trainer is None or module is None or not _training(trainer):
            return processed
        self.step_tokens = None
        read_ahead = _step_tokens(trainer, module, self.token_labels(), processed)
        if read_ahead is None:
            return processed
        self.step_tokens, loader = read_ahead
        return loader


def _training(trainer: Any) -> bool:
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    return bool(trainer.state.fn == TrainerFn.FITTING and trainer.state.stage == RunningStage.TRAINING)


def _step_tokens(trainer: Any, module: Any, labels: Any, loader: Any) -> tuple[Any, Any] | None:
    """A copy of the fit's training loader that reads each accumulation window ahead, counting the labels the module
    names (:func:`~lightning_parallel.data.step_tokens.attach_step_tokens`; the user's loader object is left as it
    is), and its counts; None when it does not apply: no labels named, batch-transfer hooks (the module's or the
    data module's) that make the step's batch differ from the loader's, a ``training_step`` that takes the
    ``dataloader_iter``, a stateful loader (its saved position would count the batches read ahead), or anything but
    a ``DataLoader``. Windows are read only while the accumulation is above 1 and the fit has one
    training loader."""
    import copy

    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
    from torch.utils.data import DataLoader

    from lightning_parallel.data.fast_forward import is_resumable, trainer_position
    from lightning_parallel.data.step_tokens import attach_step_tokens
    from lightning_parallel.parallel.context_parallel import counted_tokens

    hooks = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
    owners = [module, trainer.datamodule] if trainer.datamodule is not None else [module]
    if labels is None or not isinstance(loader, DataLoader) or is_resumable(loader) \
            or any(is_overridden(hook, owner) for hook in hooks for owner in owners) \
            or is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
        return None

    def window() -> tuple[int, int, int | None] | None:
        combined = trainer.fit_loop._combined_loader
        if not (_training(trainer) and trainer.training) or trainer.accumulate_grad_batches <= 1 or (
                combined is not None and len(combined.flattened) != 1):
            return None  # another iteration of this loader (after the fit, a user's), or nothing to read ahead
        limit = trainer.num_training_batches
        return (int(trainer.accumulate_grad_batches), trainer_position(trainer)[1],
                None if limit == float("inf") else int(limit))

    copied = copy.copy(loader)
    copied.__dict__["_iterator"] = None  # a persistent workers' iterator of the original is not shared
    owner = attach_step_tokens(copied, count=lambda batch: int(counted_tokens(batch, labels)), window=window)
    return (owner, copied) if owner is not None else None
