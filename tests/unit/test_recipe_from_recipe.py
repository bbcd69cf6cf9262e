"""``plan --recipe SRC --write-recipe OUT``: OUT is SRC with what the plan decides replaced (pure logic, no rank)."""

from __future__ import annotations

from pathlib import Path

import yaml

from lightning_parallel.planner.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_the_written_recipe_keeps_what_the_plan_does_not_decide(tmp_path: Path) -> None:
    """Before, OUT held the GPT's shape keys only: the source's learning rate, warmup, weight decay, max_steps,
    validation settings, logger, callbacks and parallel options were gone (OUT trained with the GPT's defaults)."""
    src = tmp_path / "src.yaml"
    src.write_text(f"defaults:\n  - {ROOT / 'recipes' / 'quickstart.yaml'}\n"
                   "model:\n  init_args:\n    lr: 1.0e-4\n    warmup_steps: 5\n    weight_decay: 0.0\n"
                   "trainer:\n  max_steps: 7\n  val_check_interval: 3\n"
                   "parallel:\n  collective_timeout: 321\n  pipeline_schedule: interleaved_1f1b\n"
                   "  virtual_pipeline_stages: 2\n")
    out = tmp_path / "out.yaml"
    assert main(["--recipe", str(src), "--hardware", "cpu-2proc", "--write-recipe", str(out)]) == 0
    text = out.read_text()
    recipe = yaml.safe_load(text)
    init = recipe["model"]["init_args"]
    assert (init["lr"], init["warmup_steps"], init["weight_decay"], init["n_layer"]) == (1e-4, 5, 0.0, 4)
    trainer = recipe["trainer"]
    assert (trainer["max_steps"], trainer["val_check_interval"], trainer["strategy"]) == (7, 3, "lp_ddp")
    assert trainer["callbacks"] and trainer["logger"]["class_path"].endswith("CSVLogger")
    parallel = recipe["parallel"]
    assert parallel["collective_timeout"] == 321 and parallel["data_parallel_size"] == 2
    # the source's schedule keys need stages, which the planned layout (one stage) does not have: left out, said so
    assert "virtual_pipeline_stages" not in parallel
    assert "pipeline_schedule" not in parallel
    header = " ".join(line[2:] for line in text.splitlines() if line.startswith("# "))
    assert "left out (the planned layout refuses them): pipeline_schedule, virtual_pipeline_stages" in header
    assert main(["--recipe", str(src), "--hardware", "cpu-2proc", "--write-recipe", str(out), "--max-steps",
                 "3"]) == 0
    assert yaml.safe_load(out.read_text())["trainer"]["max_steps"] == 3


def test_a_source_that_stops_by_epochs_keeps_doing_so(tmp_path: Path) -> None:
    src = tmp_path / "src.yaml"
    src.write_text(f"defaults:\n  - {ROOT / 'recipes' / 'quickstart.yaml'}\ntrainer:\n  max_steps: -1\n"
                   "  max_epochs: 3\n")
    out = tmp_path / "out.yaml"
    assert main(["--recipe", str(src), "--hardware", "cpu-2proc", "--write-recipe", str(out)]) == 0
    trainer = yaml.safe_load(out.read_text())["trainer"]
    assert trainer["max_epochs"] == 3 and trainer["max_steps"] == -1
