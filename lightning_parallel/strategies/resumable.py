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

    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader of a fit, made resumable mid-epoch (and read ahead by accumulation window when
        the module's loss is a token mean); other loaders as Lightning processes them."""
        from lightning_parallel.data.fast_forward import process_training_loader

        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        processed = process_training_loader(trainer, super().process_dataloader(dataloader))  # type: ignore[misc]
        if trainer is not None and module is not None:
            owner = _step_tokens(trainer, module, processed)
            if owner is not None:
                self.step_tokens = owner
        return processed


def _step_tokens(trainer: Any, module: Any, loader: Any) -> Any:
    """The training loader of a fit read ahead by accumulation window, counting the labels the module names
    (:func:`~lightning_parallel.data.step_tokens.attach_step_tokens`); None when it does not apply: another stage,
    no labels named, or batch-transfer hooks that make the step's batch differ from the loader's."""
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_parallel.data.fast_forward import trainer_position
    from lightning_parallel.data.step_tokens import attach_step_tokens
    from lightning_parallel.parallel.context_parallel import counted_tokens, loss_labels

    if trainer.state.fn != TrainerFn.FITTING or trainer.state.stage != RunningStage.TRAINING:
        return None
    labels = loss_labels(module)
    if labels is None or any(is_overridden(hook, module) for hook in ("on_before_batch_transfer",
                                                                       "on_after_batch_transfer")):
        return None

    def window() -> tuple[int, int, int | None]:
        limit = trainer.num_training_batches
        return (int(trainer.accumulate_grad_batches), trainer_position(trainer)[1],
                None if limit == float("inf") else int(limit))

    return attach_step_tokens(loader, count=lambda batch: int(counted_tokens(batch, labels)), window=window)
