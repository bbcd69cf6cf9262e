"""Alias of :mod:`lightning_parallel.recipe_files` (recipe composition and ``--config`` expansion), kept so that
code importing ``lightning_parallel.recipes`` keeps working."""

from lightning_parallel.recipe_files import (
    BATCH_LIMIT_KEYS,
    compose_recipe,
    expand_config_args,
    written_batch_limits,
)

__all__ = ["BATCH_LIMIT_KEYS", "compose_recipe", "expand_config_args", "written_batch_limits"]
