"""``ResumableDataMixin``: every strategy of the library makes the training DataLoader of a fit resumable mid-epoch.

Mixed into a Lightning ``Strategy`` subclass before the Lightning base class (so that ``super().process_dataloader``
is Lightning's): the loader's sampler is fast-forwarded past the batches a restored checkpoint already ran
(:mod:`lightning_parallel.data.fast_forward`). No collective.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ResumableDataMixin"]


class ResumableDataMixin:
    """The training DataLoader resumes mid-epoch exactly
    (:func:`~lightning_parallel.data.fast_forward.make_resumable`)."""

    resumes_dataloaders = True
    """Read by the CLI and the resume checks: this strategy's training DataLoader resumes mid-epoch exactly."""

    lightning_module: Any

    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader of a fit, made resumable mid-epoch; other loaders as Lightning processes them."""
        from lightning_parallel.data.fast_forward import process_training_loader

        module = self.lightning_module
        processed = super().process_dataloader(dataloader)  # type: ignore[misc]
        return process_training_loader(module._trainer if module is not None else None, processed)
