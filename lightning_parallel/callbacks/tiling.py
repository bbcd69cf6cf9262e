"""``TileLinearLayers``: Memory Centric Tiling as a callback, so a recipe can tile any model under any strategy.

The callback applies :func:`lightning_parallel.parallel.tiling.tile_linear_layers` to the LightningModule in
``setup`` -- on every rank, before the strategy wraps the model (before ZeRO-3 partitions it), and before
``configure_optimizers`` sees the parameters. With the ``popen`` launcher (the CLI's default: every rank runs the
script) that is all. With ``spawn``/``fork`` launchers the main process's module is not the one trained, and the
trained weights come back to it by state-dict keys: call ``tile_linear_layers`` on the module before ``fit`` there
(the callback then finds it tiled and does nothing).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_parallel.parallel.tiling import TiledLinear, tile_linear_layers

__all__ = ["TileLinearLayers"]


class TileLinearLayers(Callback):
    """Replace every ``nn.Linear`` with at least ``min_params`` weights by a tiled equivalent before training.

    Args:
        min_params: weight count from which a linear is tiled (e.g. the largest layer that fits the device).
        tiles: output tiles, or ``[out_tiles, in_tiles]``.
    """

    def __init__(self, min_params: int = 1_000_000, tiles: int | list[int] | tuple[int, int] = 2) -> None:
        grid = tiles if isinstance(tiles, int) else (int(tiles[0]), int(tiles[1]))
        if isinstance(grid, tuple) and len(tuple(tiles)) != 2:  # type: ignore[arg-type]
            raise ValueError(f"tiles={tiles!r} must be an int or [out_tiles, in_tiles].")
        self.min_params = min_params
        self.tiles: int | tuple[int, int] = grid
        self.replaced: list[str] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        already = any(isinstance(m, TiledLinear) for m in pl_module.modules())
        self.replaced = tile_linear_layers(pl_module, min_params=self.min_params, tiles=self.tiles)
        if self.replaced and not already and isinstance(trainer.strategy.launcher, _MultiProcessingLauncher):
            rank_zero_warn(
                "TileLinearLayers tiled the module inside the worker processes of a spawn/fork launcher; the main "
                "process's module is untiled and will not receive the trained weights. Fix: call "
                "lightning_parallel.parallel.tiling.tile_linear_layers(model, ...) before trainer.fit."
            )
        if self.replaced:
            rank_zero_info(f"[tiling] {len(self.replaced)} linear layer(s) with >= {self.min_params} weights tiled "
                           f"{self.tiles}: {', '.join(self.replaced[:6])}{' ...' if len(self.replaced) > 6 else ''}")
