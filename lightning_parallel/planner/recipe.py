"""Alias of :mod:`lightning_parallel.planner.recipe_writer` (the recommended layout written as a recipe), kept so
that code importing ``lightning_parallel.planner.recipe`` keeps working."""

from lightning_parallel.planner.recipe_writer import recipe_dict, recipe_text, write_recipe

__all__ = ["recipe_dict", "recipe_text", "write_recipe"]
