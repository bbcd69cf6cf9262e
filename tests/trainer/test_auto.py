"""`lightning-parallel fit --trainer.strategy lp_auto`: the planner picks, the run trains, the prediction is checked.

Ranks are forked from the test process (``--planner.start_method fork``); the budgets are those of
``tests/unit/test_auto_plan.py``, where every branch is checked without a process group.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_parallel.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
SHORT = ["--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2",
         "--trainer.enable_progress_bar", "false"]


def _summary(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("lightning-parallel: fit done")]
    assert lines, out[-3000:]
    return lines[-1]


def _val_losses(summary: str) -> str:
    match = re.search(r"val_loss (\S+ -> \S+)", summary)
    assert match, summary
    return match.group(1)


def test_lp_auto_chooses_trains_matches_one_device_and_measures_its_prediction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """16 MB per rank: lp_pipeline (dp=1, so the global batch is the one-device batch). Its validation losses equal a
    one-device run's; the model-state bytes it measures equal the planner's; the recipe it writes reproduces it
    without lp_auto (checked by `check`)."""
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", QUICKSTART, "--trainer.strategy", "auto", "--trainer.devices", "1", *SHORT]) == 0
    reference = _val_losses(_summary(capfd.readouterr().out))

    args = ["fit", "--config", QUICKSTART, "--trainer.strategy", "lp_auto", "--planner.gpu_memory", "16MB",
            "--planner.start_method", "fork", "--planner.select", "guide", *SHORT]
    assert main(args) == 0
    out = capfd.readouterr().out
    assert "lp_auto: chosen    lp_pipeline dp=1 pp=2 tp=1 zero=0 recompute=full" in out
    assert out.count("lp_auto: guide branch") == 1  # printed once, by the launching process
    summary = _summary(out)
    assert "strategy lp_pipeline (dp=1 x pp=2 x tp=1 = 2 ranks, recompute=full" in summary
    assert _val_losses(summary) == reference
    ratio = float(re.search(r"measured/predicted (\S+)", out).group(1))  # type: ignore[union-attr]
    assert 0.95 <= ratio <= 1.05, out
    version = tmp_path / "runs" / "quickstart" / "csv" / "version_1"
    recipe = version / "lp_auto_recipe.yaml"
    assert recipe.is_file() and (version / "lp_auto_decision.txt").is_file()
    text = recipe.read_text()
    assert "strategy: lp_pipeline" in text and "lp_auto" not in text.split("\nseed_everything")[1]
    assert main(["check", "--config", str(recipe)]) == 0
    assert "recipe OK | strategy lp_pipeline (dp=1 x pp=2 x tp=1 = 2 ranks, recompute=full" in capfd.readouterr().out


def test_lp_auto_zero_layout_measures_its_prediction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    """20 MB per rank: lp_sharded ZeRO-2 over both ranks; measured model states per rank = the ZeRO formula."""
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", QUICKSTART, "--parallel", "auto", "--planner.gpu_memory", "20MB",
            "--planner.start_method", "fork", "--planner.select", "guide", *SHORT]
    assert main(args) == 0
    out = capfd.readouterr().out
    assert "strategy lp_sharded (dp=2 x pp=1 x tp=1 = 2 ranks, zero=2, recompute=full)" in _summary(out)
    ratio = float(re.search(r"measured/predicted (\S+)", out).group(1))  # type: ignore[union-attr]
    assert 0.95 <= ratio <= 1.05, out


def test_lp_auto_refusals_start_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--config", QUICKSTART, "--trainer.strategy", "lp_auto", "--planner.gpu_memory", "5MB"]) == 2
    captured = capfd.readouterr()
    assert "lightning-parallel: error: lp_auto: no layout fits" in captured.err
    assert "Smallest hardware that fits" in captured.err
    assert "Initializing distributed" not in captured.out + captured.err
    assert main(["fit", "--config", QUICKSTART, "--trainer.strategy", "lp_auto",
                 "--parallel.tensor_parallel_size", "2"]) == 2
    assert "lp_auto chooses the layout itself" in capfd.readouterr().err


@pytest.mark.timeout(900)  # the offload budget may wait for DeepSpeed's op build when it is not cached
@pytest.mark.parametrize(("budget", "strategy", "layout", "extra"), [
    ("1GB", "lp_ddp", "dp=2 x pp=1 x tp=1 = 2 ranks", ()),
    # with 16 sequences per micro-batch given, no pipeline fits these budgets (the data module's 16 split into 8
    # micro-batches of 2 would: tests/unit/test_auto_plan.py), and tensor parallelism, then offload, is the guide's
    ("14MB", "lp_tensor", "dp=1 x pp=1 x tp=2 = 2 ranks, recompute=full", ("--planner.micro_batch_size", "16")),
    ("12MB", "lp_zero_offload", "dp=2 x pp=1 x tp=1 = 2 ranks, zero=3, offload=cpu, recompute=full",
     ("--planner.micro_batch_size", "16")),
])
def test_lp_auto_other_budgets_train_and_measure_their_prediction(
        budget: str, strategy: str, layout: str, extra: tuple[str, ...], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """The quick-start budgets the tests above do not run (``tests/unit/test_auto_plan.py`` checks their choice
    without a process group): each trains under the layout lp_auto chose, and the model-state bytes a rank measures
    are the planner's prediction. Under offload the host part is; DeepSpeed keeps the parameters below its
    persistence threshold whole on the device, which the planner does not count (docs/limits.md, "lp_auto")."""
    if strategy == "lp_zero_offload":
        pytest.importorskip("deepspeed")
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", QUICKSTART, "--trainer.strategy", "lp_auto", "--planner.gpu_memory", budget,
            "--planner.start_method", "fork", "--planner.select", "guide", *extra, *SHORT]
    assert main(args) == 0
    out = capfd.readouterr().out
    summary = _summary(out)
    assert f"strategy {strategy} ({layout}" in summary, summary
    first, last = (float(v) for v in _val_losses(summary).split(" -> "))
    assert last < first, summary  # it trained
    ratio = float(re.search(r"measured/predicted (\S+)", out).group(1))  # type: ignore[union-attr]
    if strategy != "lp_zero_offload":
        assert 0.95 <= ratio <= 1.05, out
        return
    line = next(line for line in out.splitlines() if "model states per rank: predicted" in line)
    predicted, measured = (re.search(rf"{word} .*?\+ host ([^)]+)\)", line) for word in ("predicted", "measured"))
    assert predicted is not None and measured is not None, line
    assert predicted.group(1) == measured.group(1), line  # the host holds what the formula says
    assert "grads 0 B, optimizer 0 B + host" in line.split("measured")[1], line  # nothing of it left on the device
    assert 1.0 <= ratio <= 1.3, line  # the persistent parameters on the device, on top
