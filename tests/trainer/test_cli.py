"""`lightning-parallel fit`: recipes, layout refusal before spawn, any module / data / strategy by class path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_parallel import LayoutError, LPDDPStrategy, ParallelConfig
from lightning_parallel.cli import LightningParallelCLI, main, resolve_strategy
from lightning_parallel.recipe_files import compose_recipe, expand_config_args, written_batch_limits

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
SHORT = ["--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2"]


def test_bad_layout_fails_at_once_with_sizes_and_world(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["fit", "--config", QUICKSTART, "--parallel.data_parallel_size", "3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "data_parallel_size (3) x pipeline_parallel_size (1) x tensor_parallel_size (1) = 3" in err
    assert "world size is 2 (devices=2 per node x num_nodes=1)" in err


def test_unknown_parallel_key_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--config", QUICKSTART, "--parallel.tensor_paralel_size", "2"]) == 2
    assert "'tensor_paralel_size'. Did you mean 'tensor_parallel_size'?" in capsys.readouterr().err


def test_the_temporary_recipe_files_go_when_the_command_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The composed recipe (``defaults:``) and the ``parallel: auto`` rewrite the parser reads are deleted when the
    command ends, refused or not."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    auto = tmp_path / "auto.yaml"
    auto.write_text(f"defaults:\n  - {QUICKSTART}\nparallel: auto\n")
    assert main(["check", "--config", str(ROOT / "recipes" / "gpt_zero3.yaml"), "--trainer.accelerator", "cpu"]) == 0
    assert main(["check", "--config", str(auto)]) == 2  # composed, rewritten for lp_auto, then refused (lp_ddp)
    assert main(["fit", "--config", QUICKSTART, "--parallel.data_parallel_size", "3"]) == 2
    capsys.readouterr()
    assert not list(scratch.iterdir())


def test_quickstart_recipe_shortened_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capfd: pytest.CaptureFixture[str]) -> None:
    """The quickstart recipe as written, 6 steps, ranks forked from this process (no re-import)."""
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", QUICKSTART, "--trainer.strategy", "lp_ddp_fork", *SHORT]) == 0
    out = capfd.readouterr().out
    summary = [line for line in out.splitlines() if line.startswith("lightning-parallel: fit done")]
    assert summary and "val_loss" in summary[0] and "lp_ddp (dp=2 x pp=1 x tp=1 = 2 ranks)" in summary[0]
    assert "(lower; 2 validations)" in summary[0] and "TFLOP/s" in summary[0]  # MFU or the model rate
    version = tmp_path / "runs" / "quickstart" / "csv" / "version_0"
    assert (version / "metrics.csv").is_file() and (version / "checkpoints" / "last.ckpt").is_file()


def test_quickstart_command_end_to_end(tmp_path: Path) -> None:
    """The real command: Lightning re-launches the script for rank 1 (popen), as torchrun would."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lightning_parallel", "fit", "--config", QUICKSTART, *SHORT]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lightning-parallel: fit done" in proc.stdout and "2 process(es) | 6 steps" in proc.stdout


def test_any_module_data_and_strategy_class_by_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = [
        "fit",
        "--model", "lightning.pytorch.demos.boring_classes.BoringModel",
        "--data", "lightning.pytorch.demos.boring_classes.BoringDataModule",
        "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.max_steps", "2",
        "--trainer.limit_val_batches", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.strategy", "lightning_parallel.LPDDPStrategy",
        "--trainer.strategy.init_args.start_method", "fork",
        "--trainer.strategy.init_args.bucket_cap_mb", "5",
    ]
    assert main(args) == 0


def test_resolve_strategy() -> None:
    layout = ParallelConfig(data_parallel_size=2)
    made = resolve_strategy("lp_ddp_fork", layout)
    assert isinstance(made, LPDDPStrategy) and made.explicit_layout == layout and made._start_method == "fork"
    assert made.layout == layout.replace(zero_stage=0, offload="none")  # the preset fills what was left unset
    assert resolve_strategy("ddp", ParallelConfig()) == "ddp"
    with pytest.raises(LayoutError, match="does not take a layout"):
        resolve_strategy("ddp", layout)
    with pytest.raises(LayoutError, match="given twice"):
        resolve_strategy(LPDDPStrategy(parallel={"data_parallel_size": 4}), layout)


def test_recipe_composition(tmp_path: Path) -> None:
    composed = compose_recipe(QUICKSTART)
    assert composed["trainer"]["strategy"] == "lp_ddp" and composed["trainer"]["max_steps"] == 300
    assert composed["model"]["class_path"] == "lightning_parallel.models.GPT"
    assert composed["data"]["init_args"]["block_size"] == "${model.init_args.block_size}"
    (tmp_path / "a.yaml").write_text("defaults: [b.yaml]\nx: 1\n")
    (tmp_path / "b.yaml").write_text("defaults: [a.yaml]\n")
    with pytest.raises(LayoutError, match="cycle"):
        compose_recipe(tmp_path / "a.yaml")


def test_integer_batch_limits_keep_their_type() -> None:
    """Trainer's signature says float | int, so the parser makes `1` a float, which Lightning reads as 100%."""
    args = ["--config", QUICKSTART, "--trainer.limit_val_batches", "1", "--trainer.limit_train_batches", "0.5"]
    expanded = expand_config_args(args)
    assert written_batch_limits(expanded) == {"limit_val_batches": 1}
    cli = LightningParallelCLI(args=expanded, run=False, written_limits=written_batch_limits(expanded))
    assert cli.trainer.limit_val_batches == 1 and isinstance(cli.trainer.limit_val_batches, int)
    assert cli.trainer.limit_train_batches == 0.5


def test_interpolations_follow_command_line_overrides() -> None:
    expanded = expand_config_args(["fit", "--config", QUICKSTART, "--model.init_args.block_size", "64"])
    composed = Path(expanded[2]).read_text()
    assert "block_size: 64" in composed and "block_size: ${model.init_args.block_size}" in composed


def test_unknown_names_are_refused_with_the_nearest_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown strategy name, an unknown --parallel key and an unknown key in a recipe's parallel section: one
    message each, exit code 2, the nearest valid name, no traceback, nothing started."""
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    assert main(["fit", "--config", recipe, "--trainer.strategy", "lp_ddpp"]) == 2
    err = capsys.readouterr().err
    assert "trainer.strategy='lp_ddpp' is not a registered strategy. Did you mean 'lp_ddp'" in err
    assert "Traceback" not in err
    assert main(["fit", "--config", recipe, "--parallel.data_paralel_size", "2"]) == 2
    assert "Did you mean 'data_parallel_size'?" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"defaults:\n  - {recipe}\nparallel:\n  zero_stag: 2\n")
    assert main(["fit", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"parallel.zero_stag in {bad}" in err and "Did you mean 'zero_stage'?" in err
