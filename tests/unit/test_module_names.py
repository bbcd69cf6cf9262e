"""The library's modules under their current names, and the old names kept as aliases for recipes and users."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(
    ("old", "new", "names"),
    [
        ("lightning_parallel.tiling_callback", "lightning_parallel.callbacks", ["TileLinearLayers"]),
        ("lightning_parallel.callbacks.summary", "lightning_parallel.callbacks", ["RunSummary"]),
        ("lightning_parallel.recipes", "lightning_parallel.recipe_files",
         ["BATCH_LIMIT_KEYS", "compose_recipe", "expand_config_args", "written_batch_limits"]),
        ("lightning_parallel.planner.recipe", "lightning_parallel.planner.recipe_writer",
         ["recipe_dict", "recipe_text", "write_recipe"]),
    ],
)
def test_old_module_names_are_aliases(old: str, new: str, names: list[str]) -> None:
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_module, name) is getattr(new_module, name), name
    assert sorted(old_module.__all__) == sorted(names)


def test_recipes_name_callbacks_by_their_current_path() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for path in [*root.glob("recipes/*.yaml"), *root.glob("configs/**/*.yaml")]:
        assert "lightning_parallel.tiling_callback" not in path.read_text(), path
