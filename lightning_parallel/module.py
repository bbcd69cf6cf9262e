"""The hooks a LightningModule implements so pipeline and tensor parallelism can restructure it.

The data-parallel family (``lp_dp``, ``lp_ddp``, ``lp_sharded``, ``lp_zero_offload``) needs none of them: any
LightningModule trains unchanged. Pipeline parallelism needs :meth:`ParallelModuleMixin.pipeline_layers` and
:meth:`ParallelModuleMixin.pipeline_loss`; tensor parallelism needs
:meth:`ParallelModuleMixin.tensor_parallel_plan`. :class:`lightning_parallel.models.GPT` implements all of them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_parallel.config import LayoutError

__all__ = ["TP_STYLES", "ParallelModuleMixin", "require_hook"]

TP_STYLES = ("column", "row", "vocab")
"""How a submodule splits under TP: ``column`` (output features over ``tp``), ``row`` (input features, all-reduce
in forward), ``vocab`` (embedding rows / head columns over ``tp``, with a vocab-parallel loss)."""


class ParallelModuleMixin:
    """Mix into a LightningModule (``class MyModel(ParallelModuleMixin, LightningModule)``) and override the hooks
    the chosen strategy needs."""

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as an ordered sequence of modules, each mapping one tensor to one tensor
        (e.g. ``[embedding, *blocks, head]``); a pipeline cuts it into balanced stages."""
        raise NotImplementedError

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The loss on the last stage's output for one micro-batch (mean over its samples)."""
        raise NotImplementedError

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Submodule name -> one of :data:`TP_STYLES`."""
        raise NotImplementedError

    def parallel_shape(self) -> dict[str, int]:
        """Shape facts the layout is checked against before launch: ``n_layer``, ``n_head``, ``vocab_size``."""
        return {}


def require_hook(module: Any, hook: str, *, strategy: str) -> None:
    """Refuse, before launch, a module that lacks a hook ``strategy`` needs, naming the hook to add."""
    impl = getattr(type(module), hook, None)
    base = getattr(ParallelModuleMixin, hook)
    if impl is None or impl is base:
        raise LayoutError(
            f"{type(module).__name__} cannot run under {strategy}: it does not implement `{hook}()`. "
            f"Fix: subclass lightning_parallel.ParallelModuleMixin and implement `{hook}` "
            f"({getattr(base, '__doc__', '').strip().splitlines()[0]}), as lightning_parallel.models.GPT does."
        )
