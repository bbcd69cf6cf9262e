"""Alias of :mod:`lightning_parallel.callbacks.tiling`, kept so that recipes and code naming
``lightning_parallel.tiling_callback.TileLinearLayers`` keep working; new code uses
``lightning_parallel.callbacks.TileLinearLayers``."""

from lightning_parallel.callbacks.tiling import TileLinearLayers

__all__ = ["TileLinearLayers"]
