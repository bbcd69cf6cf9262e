"""The library's modules under their current names: a package re-exports its modules' public names, and recipes name
callbacks by their current path (the 0.1.0 aliases ``lightning_parallel.module``, ``tiling_callback``, ``recipes`` and
``planner.recipe`` are gone)."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(
    ("module", "package", "names"),
    [
        ("lightning_parallel.callbacks.summary", "lightning_parallel.callbacks",
         ["RunSummary", "WARMUP_BATCHES", "calibrated_peak", "model_flops_per_sample"]),
    ],
)
def test_packages_reexport_their_modules_names(module: str, package: str, names: list[str]) -> None:
    inner, outer = importlib.import_module(module), importlib.import_module(package)
    for name in names:
        assert getattr(inner, name) is getattr(outer, name), name
    assert sorted(inner.__all__) == sorted(names)


def test_recipes_name_callbacks_by_their_current_path() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for path in [*root.glob("recipes/*.yaml"), *root.glob("configs/**/*.yaml")]:
        assert "lightning_parallel.tiling_callback" not in path.read_text(), path
