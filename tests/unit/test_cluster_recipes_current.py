"""The planner-written recipes under ``recipes/cluster`` are what the planner writes today: each is rewritten from the
command its first line quotes and compared byte for byte (a change of the planner's model that moves a plan must
rewrite the recipe and the docs that quote it)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from lightning_parallel.planner.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "recipes" / "cluster").glob("*.yaml")
                 if p.read_text().startswith("# written by: lightning-parallel plan "))


def test_there_are_planner_written_recipes() -> None:
    assert len(RECIPES) >= 4, RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_is_what_its_command_writes(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    committed = (ROOT / "recipes" / "cluster" / name).read_text()
    command = committed.splitlines()[0].removeprefix("# written by: lightning-parallel plan ")
    (tmp_path / "recipes" / "cluster").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # the command writes the same relative path, so the quoted command is identical
    assert main(shlex.split(command)) == 0
    capsys.readouterr()
    written = (tmp_path / "recipes" / "cluster" / name).read_text()
    assert written == committed, (f"recipes/cluster/{name} is stale: rerun `lightning-parallel plan {command}` and "
                                  "update the docs that quote it")
