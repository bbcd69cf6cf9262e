"""Alias of :mod:`lightning_parallel.module_hooks` (the LightningModule hook mixin), kept so that existing imports
and recipes' class paths (``lightning_parallel.module.ParallelModuleMixin``) keep working."""

from lightning_parallel.module_hooks import TP_STYLES, ParallelModuleMixin, require_hook

__all__ = ["TP_STYLES", "ParallelModuleMixin", "require_hook"]
