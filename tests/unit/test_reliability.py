"""Reliability pieces without a process group (issue 26): checksum lists in every folder format, format versions,
what a checkpoint was saved from against the configured model, the launch environment, interrupted saves, full-disk
messages, the SIGTERM handler, the non-finite loss check, the planner's recipes and zeros, ``consolidate --force``."""

from __future__ import annotations

import errno
import glob
import io
import json
import os
import signal
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_parallel.checkpoint import CheckpointFormatError, consolidate, detect_format
from lightning_parallel.checkpoint.atomic import disk_errors, interrupted_saves
from lightning_parallel.checkpoint.errors import CheckpointWriteError, UnwritableFolderError
from lightning_parallel.checkpoint.names import FORMAT_VERSION, FORMAT_VERSION_KEY, MANIFEST_FILE
from lightning_parallel.checkpoint.summary import resume_refusal, summarize
from lightning_parallel.checkpoint.verify import UNVERIFIED_ENV, verify_folder, write_manifest
from lightning_parallel.parallel.faults import interrupts
from lightning_parallel.strategies.layout import (
    configured_optimizers,
    launch_environment_refusal,
    report_interrupted_saves,
)
from lightning_parallel.testing.bad_inputs import write_dcp_folder
from lightning_parallel.testing.faulty import OptimizerChoiceGPT
from tests.helpers import tiny_gpt

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A one-file checkpoint of the tiny GPT after one AdamW step (optimizer state and a scheduler), and its DCP
    folder (lp_pipeline's format, written without a process group)."""
    import lightning.pytorch as pl

    from lightning_parallel.strategies import LPDPStrategy
    from tests.helpers import TRAINER_QUIET, SequentialTokens

    folder = tmp_path_factory.mktemp("reliability")
    model = tiny_gpt()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=LPDPStrategy(), max_steps=1, limit_val_batches=0,
                         **TRAINER_QUIET)  # one process, the library's one-file save
    trainer.fit(model, SequentialTokens(batch_size=4))
    trainer.save_checkpoint(folder / "one.ckpt")
    write_dcp_folder(folder / "one.ckpt", folder / "dcp")
    return {"file": folder / "one.ckpt", "dcp": folder / "dcp"}


# ------------------------------------------------------------------------------------------------ versions, lists
def test_every_format_records_its_version_and_refuses_a_newer_one(saved: dict[str, Path], tmp_path: Path) -> None:
    content = torch.load(saved["file"], weights_only=True)
    assert content[FORMAT_VERSION_KEY] == FORMAT_VERSION  # written by the library's one-file save
    assert json.loads((saved["dcp"] / "layout.json").read_text())["format_version"] == FORMAT_VERSION
    for bad, expect in ((FORMAT_VERSION + 1, f"format version {FORMAT_VERSION + 1}; this lightning-parallel"),
                        ("1", "format version '1' is not a version"), (-1, "format version -1")):
        torch.save({**content, FORMAT_VERSION_KEY: bad}, tmp_path / "x.ckpt")
        with pytest.raises(CheckpointFormatError, match=expect):
            detect_format(tmp_path / "x.ckpt")
    del content[FORMAT_VERSION_KEY]  # written before versions existed: read as version 0
    torch.save(content, tmp_path / "old.ckpt")
    assert detect_format(tmp_path / "old.ckpt").format == "lightning"


def test_a_dcp_folder_without_its_checksum_list_is_refused_unless_asked(saved: dict[str, Path], tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    folder = tmp_path / "dcp"
    shutil.copytree(saved["dcp"], folder)
    verify_folder(folder)
    (folder / "stray.bin").write_bytes(b"x")
    with pytest.raises(CheckpointFormatError, match=r"\['stray.bin'\] not listed in checksums.json"):
        verify_folder(folder)
    (folder / "stray.bin").unlink()
    (folder / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointFormatError, match=f"without {MANIFEST_FILE}.*{UNVERIFIED_ENV}=1"):
        verify_folder(folder)
    with pytest.raises(CheckpointFormatError, match=f"without {MANIFEST_FILE}"):  # the offline tool checks it too
        consolidate(folder, tmp_path / "out.ckpt")
    monkeypatch.setenv(UNVERIFIED_ENV, "1")
    verify_folder(folder)  # the explicit override: loaded unverified, said so
    (folder / ".metadata").rename(folder / "metadata.bak")  # DCP's index gone: named, not blamed on lp_sharded
    with pytest.raises(CheckpointFormatError, match=r"a DCP checkpoint folder .* without \.metadata"):
        detect_format(folder)
    (folder / "metadata.bak").rename(folder / ".metadata")
    write_manifest(folder)
    monkeypatch.delenv(UNVERIFIED_ENV)
    verify_folder(folder)


# ------------------------------------------------------------------------------------------------ fits or not
def test_what_was_saved_is_compared_with_the_configured_model_in_every_message(saved: dict[str, Path]) -> None:
    for kind in ("file", "dcp"):
        summary = summarize(saved[kind])
        same = OptimizerChoiceGPT(**dict(tiny_gpt().hparams))
        conf = configured_optimizers(same)
        assert conf is not None
        assert resume_refusal(summary, module=same, optimizers=conf[0], schedulers=conf[1]) is None
        wider = OptimizerChoiceGPT(**{**dict(tiny_gpt().hparams), "n_embd": 64})
        why = resume_refusal(summary, module=wider)
        assert why and "n_embd: configured 64, saved 32" in why and "--model.init_args.n_embd '32'" in why, why
        sgd = OptimizerChoiceGPT(**dict(tiny_gpt().hparams), optimizer="sgd", step_lr=True)
        conf = configured_optimizers(sgd)
        assert conf is not None
        why = resume_refusal(summary, module=sgd, optimizers=conf[0], schedulers=conf[1])
        assert why and "returns SGD (dampening, momentum, nesterov)" in why and "--resume_weights_only" in why, why
        assert resume_refusal(summary, module=sgd, optimizers=conf[0], schedulers=conf[1], weights_only=True) is None


def test_configure_optimizers_runs_without_the_trainer_on_a_meta_module() -> None:
    with torch.device("meta"):
        model = OptimizerChoiceGPT(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, step_lr=True)
    conf = configured_optimizers(model)
    assert conf is not None
    optimizers, schedulers = conf
    assert [type(o).__name__ for o in optimizers] == ["AdamW"]
    assert [type(s).__name__ for s in schedulers] == ["LambdaLR", "StepLR"]


# ------------------------------------------------------------------------------------------------ launching
def test_several_nodes_need_something_that_starts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

    for key in ("MASTER_ADDR", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    why = launch_environment_refusal(2, LightningEnvironment())
    assert why and "nothing starts node 1" in why and "scripts/launch/torchrun.sh --nnodes 2" in why
    assert "sbatch --nodes 2 scripts/launch/slurm.sbatch" in why
    assert "nodes 1..3" in (launch_environment_refusal(4, LightningEnvironment()) or "")
    assert launch_environment_refusal(1, LightningEnvironment()) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert launch_environment_refusal(2, TorchElasticEnvironment()) is None  # torchrun started the nodes
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    assert launch_environment_refusal(2, LightningEnvironment()) is None  # started by hand on each node


def test_leftovers_of_interrupted_saves_are_named_at_the_next_start(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "runs" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "last.ckpt").mkdir()
    (folder / "last.ckpt.partial").mkdir()
    (folder / "epoch=0-step=9.ckpt.old").write_bytes(b"x")
    assert interrupted_saves([tmp_path]) == [folder / "epoch=0-step=9.ckpt.old", folder / "last.ckpt.partial"]
    trainer = SimpleNamespace(default_root_dir=str(tmp_path / "runs"), loggers=[], callbacks=[], global_rank=0)
    found = report_interrupted_saves(trainer)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert len(found) == 2
    assert "last.ckpt.partial: an interrupted save of last.ckpt (incomplete: never resumed from; last.ckpt is the " \
           "previous, complete checkpoint)" in out, out
    assert "epoch=0-step=9.ckpt.old: the previous epoch=0-step=9.ckpt, moved aside" in out, out
    # where checkpoints go, not a walk of every folder under the root: a lightning_logs layout is found, a leftover's
    # inside, hidden folders and folders 7 deep are not searched
    logs = tmp_path / "lightning_logs" / "version_3" / "checkpoints"
    logs.mkdir(parents=True)
    (logs / "last.ckpt.partial").mkdir()
    (logs / "last.ckpt.partial" / "inner.old").write_bytes(b"x")
    (tmp_path / ".git" / "x.partial").mkdir(parents=True)
    (logs / "config.yaml.old").write_text("a user's backup, not a checkpoint")
    (logs / "data.old").mkdir()  # a user's folder, not a checkpoint moved aside
    deep = tmp_path.joinpath(*"abcdefg")
    deep.mkdir(parents=True)
    (deep / "far.ckpt.partial").mkdir()
    assert interrupted_saves([tmp_path]) == [logs / "last.ckpt.partial", folder / "epoch=0-step=9.ckpt.old",
                                             folder / "last.ckpt.partial"]


def test_a_write_the_disk_refuses_names_the_path_and_the_bytes(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    with pytest.raises(CheckpointWriteError) as raised, disk_errors(target, needed=1234):
        raise OSError(errno.ENOSPC, "No space left on device")
    text = str(raised.value)
    assert f"no space left on device while writing the checkpoint {target}: it needs about 1,234 bytes" in text
    assert "bytes free" in text and raised.value.errno == errno.ENOSPC
    with pytest.raises(CheckpointWriteError, match="file too large"), disk_errors(target, needed=1):
        raise OSError(errno.EFBIG, "File too large")
    with pytest.raises(ValueError, match="other"), disk_errors(target, needed=1):  # anything else passes
        raise ValueError("other")
    from lightning_parallel.checkpoint.atomic import check_writable_dir

    (tmp_path / "file").write_text("")
    with pytest.raises(UnwritableFolderError, match="is a file, not a folder"):
        check_writable_dir(tmp_path / "file" / "logs", what="trainer.default_root_dir")


# ------------------------------------------------------------------------------------------------ signals
def test_sigterm_sets_the_flag_forwards_it_and_runs_no_collective() -> None:
    forwarded: list[int] = []
    trainer = SimpleNamespace(_signal_connector=SimpleNamespace(received_sigterm=False), is_global_zero=False,
                              strategy=SimpleNamespace(launcher=SimpleNamespace(kill=forwarded.append)))
    before = signal.getsignal(signal.SIGTERM)
    interrupts.install(trainer)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert trainer._signal_connector.received_sigterm and forwarded == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)  # a second one: nothing more
        time.sleep(0.05)
        assert forwarded == [signal.SIGTERM]
    finally:
        interrupts.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
    asked: list[bool] = []  # with a guard that agrees on the stop: the request goes there, not to Lightning's flag
    trainer._signal_connector.received_sigterm = False
    interrupts.install(trainer, request_stop=lambda: asked.append(True))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert asked == [True] and not trainer._signal_connector.received_sigterm
    finally:
        interrupts.uninstall()


def test_the_guard_stops_on_a_nan_loss_and_refuses_every_save_after_it() -> None:
    from lightning_parallel.callbacks import NonFiniteLossError, NonFiniteLossGuard
    from lightning_parallel.checkpoint.formats.common import refused_save

    strategy = SimpleNamespace(root_device=torch.device("cpu"), is_global_zero=True)
    trainer: Any = SimpleNamespace(global_step=0, strategy=strategy, world_size=1, received_sigterm=False,
                                   checkpoint_callbacks=[SimpleNamespace(last_model_path="runs/last.ckpt",
                                                                         best_model_path="",
                                                                         _last_global_step_saved=1)],
                                   current_epoch=0, should_stop=False)
    trainer.fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace())
    guard = NonFiniteLossGuard()
    for step, loss in enumerate([2.5, 2.25]):
        trainer.global_step = step
        guard.on_train_batch_start(trainer, None, None, step)  # type: ignore[arg-type]
        guard.on_train_batch_end(trainer, None, {"loss": torch.tensor(loss)}, None, step)  # type: ignore[arg-type]
    assert not refused_save(strategy, "last.ckpt")
    trainer.global_step = 2
    guard.on_train_batch_start(trainer, None, None, 2)  # type: ignore[arg-type]
    with pytest.raises(NonFiniteLossError) as raised:
        guard.on_train_batch_end(trainer, None, {"loss": torch.tensor(float("inf"))}, None, 2)  # type: ignore[arg-type]
    text = str(raised.value)
    assert "became inf in step 3" in text and "the last finite loss was 2.25 at step 2" in text, text
    assert "runs/last.ckpt (after step 1)" in text and "NonFiniteLossGuard(action=skip)" in text, text
    with redirect_stdout(io.StringIO()) as out:
        assert refused_save(strategy, "last.ckpt")  # every library format checks this before it writes
    assert "not saving last.ckpt" in out.getvalue()
    with pytest.raises(ValueError, match="not one of"):
        NonFiniteLossGuard(action="ignore")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ tools
def test_the_guards_numbers_cost_a_step_three_tensor_operations() -> None:
    """The guard's numbers ride in every step's all-reduce: ``[loss, preemption flag, 1]`` from a scalar fp32 loss is
    a detach, a reshape and a concatenation with a cached ``[flag, 1]`` (each operation is a dispatch a step pays;
    they were 16); their sum over the ranks is finite only where every rank's loss is."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_parallel.callbacks import NonFiniteLossGuard

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.names.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    trainer: Any = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), received_sigterm=False)
    guard = NonFiniteLossGuard()
    weight = torch.tensor(2.0, requires_grad=True)
    losses = [weight * 1.5, weight * 1.25]
    first = guard.local_numbers(trainer, {"loss": losses[0]})  # builds the cached [flag, 1]
    with Ops() as ops:
        second = guard.local_numbers(trainer, {"loss": losses[1]})
    assert len(ops.names) <= 3, ops.names
    assert first is not None and second is not None and not second.requires_grad
    assert second.tolist() == [2.5, 0.0, 1.0]
    summed = first + second
    assert NonFiniteLossGuard.agreed_loss(summed).item() == pytest.approx(2.75)
    assert first.tolist() == [3.0, 0.0, 1.0]  # the cached tail was not changed by the sum
    bad = guard.local_numbers(trainer, {"loss": torch.tensor(float("nan"))})
    assert bad is not None and not torch.isfinite(NonFiniteLossGuard.agreed_loss(first + bad))
    trainer.received_sigterm = True
    assert guard.local_numbers(trainer, torch.tensor([1.0, 3.0])).tolist() == [2.0, 1.0, 1.0]  # mean; the flag
    assert guard.local_numbers(trainer, None, counted=False).tolist() == [0.0, 1.0, 0.0]  # a stage without a loss


def test_every_recipe_plans_and_zero_is_not_the_default() -> None:
    from lightning_parallel.planner.cli import main as plan

    recipes = sorted(glob.glob(str(ROOT / "recipes" / "*.yaml")) + glob.glob(str(ROOT / "recipes" / "*" / "*.yaml")))
    assert len(recipes) >= 15
    for recipe in recipes:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = plan(["--recipe", recipe])
        assert "Recommendation" in out.getvalue(), (recipe, err.getvalue())
        assert code == (1 if "Recommendation: none fits" in out.getvalue() else 0), (recipe, code)  # 1: none fits
    for flag in ("--micro-batch-size", "--seq-len", "--micro-batches", "--layers", "--vocab", "--block-size"):
        err = io.StringIO()
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            code = plan(["--model", "gpt3-1.3b", "--gpu-memory", "40GB", flag, "0"])
        assert code == 2 and f"{flag}=0 must be at least 1" in err.getvalue(), (flag, err.getvalue())


def test_consolidate_does_not_overwrite_without_force(saved: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out.ckpt"
    consolidate(saved["file"], out)
    with pytest.raises(FileExistsError, match="pass --force"):
        consolidate(saved["file"], out)
    consolidate(saved["file"], out, overwrite=True)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(NotADirectoryError):
        consolidate(saved["file"], tmp_path / "a_file" / "out.ckpt")
