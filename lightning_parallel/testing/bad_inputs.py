"""The bad inputs and faults a new user meets, as a table: each must end the command before any rank starts, with
exit code 2 and one message (no traceback) that names the value, what is wrong and the fix.

``tests/unit/test_bad_inputs.py`` runs every case in-process (``lightning_parallel.cli.main``) with process launches
and process-group creation trapped, and prints the table (case, exit code, first line of the message, seconds,
spawned or not; ``pytest -s`` shows it).
"""

from __future__ import annotations

import io
import json
import os
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CASES", "BadInput", "Outcome", "make_fixtures", "run_in_process", "write_dcp_folder"]

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
FIT = ("fit", "--config", QUICKSTART, "--trainer.enable_progress_bar", "false")
PLAN = ("plan", "--model", "gpt3-1.3b", "--gpus-per-node", "8", "--gpu-memory", "40GB")


@dataclass(frozen=True)
class BadInput:
    """One case: the command's arguments (``{dir}`` is the fixture folder) and a fragment the message must hold."""

    name: str
    argv: tuple[str, ...]
    expect: str
    code: int = 2
    """2 for every command's bad input; ``consolidate`` documents 1 for an input it cannot read."""


def _fit(*extra: str) -> tuple[str, ...]:
    return (*FIT, *extra)


def _pp(*extra: str) -> tuple[str, ...]:
    """``fit`` of the quick start under lp_pipeline, 2 stages."""
    return _fit("--trainer.strategy", "lp_pipeline", "--parallel.pipeline_parallel_size", "2", *extra)


def _check(*extra: str) -> tuple[str, ...]:
    return ("check", *FIT[1:], *extra)


_FAULTY = "lightning_parallel.testing.faulty."


def _sharded(stage: int, model: str) -> tuple[str, ...]:
    """``fit`` of the quick start under lp_sharded at ``stage`` with the module ``faulty.<model>``."""
    return _fit("--model", _FAULTY + model, "--trainer.strategy", "lp_sharded", "--parallel.zero_stage", str(stage))


CASES: tuple[BadInput, ...] = (
    # --- layout
    BadInput("dp x pp x tp != world size", _fit("--parallel.data_parallel_size", "3"),
             "data_parallel_size (3) x pipeline_parallel_size (1) x tensor_parallel_size (1) = 3"),
    BadInput("unknown parallel key (command line)", _fit("--parallel.tensor_paralel_size", "2"),
             "Did you mean 'tensor_parallel_size'?"),
    BadInput("unknown parallel key (recipe)", ("fit", "--config", "{dir}/typo_key.yaml"),
             "Did you mean 'zero_stage'?"),
    BadInput("zero_stage 4", _fit("--parallel.zero_stage", "4"), "zero_stage"),
    BadInput("global batch the world cannot keep", _fit("--parallel.global_batch_size", "48"),
             "parallel.global_batch_size=48 cannot be kept on this world"),
    BadInput("NVMe offload without nvme_path", _fit("--trainer.strategy", "lp_zero_offload", "--parallel.zero_stage",
                                                    "3", "--parallel.offload", "nvme"), "needs parallel.nvme_path"),
    BadInput("lp_ddp given zero_stage 2", _fit("--parallel.zero_stage", "2"), "lp_sharded"),
    BadInput("tp does not divide heads", _fit("--trainer.strategy", "lp_tensor", "--trainer.devices", "3",
                                              "--parallel.tensor_parallel_size", "3"), "n_head"),
    BadInput("more stages than layers", _fit("--trainer.strategy", "lp_pipeline", "--trainer.devices", "8",
                                             "--parallel.pipeline_parallel_size", "8"), "returns 6 layers"),
    BadInput("pipeline with offload", _fit("--trainer.strategy", "lp_pipeline", "--parallel.pipeline_parallel_size",
                                           "2", "--parallel.zero_stage", "2", "--parallel.offload", "cpu"),
             "DeepSpeed engine"),
    BadInput("HSDP shard size that does not divide dp", _fit("--trainer.strategy", "lp_sharded", "--trainer.devices",
                                                             "4", "--parallel.zero_stage", "3",
                                                             "--parallel.data_parallel_shard_size", "3"), "4 % 3"),
    BadInput("micro-batches do not divide the batch", _fit("--trainer.strategy", "lp_pipeline",
                                                           "--parallel.pipeline_parallel_size", "2",
                                                           "--parallel.num_micro_batches", "5"), "% 5"),
    BadInput("BackboneFinetuning under flat ZeRO-1", _fit("--trainer.strategy", "lp_sharded", "--parallel.zero_stage",
                                                         "1", "--trainer.callbacks+=BackboneFinetuning"),
             "zero_stage=1 keeps one flat shard per param group"),
    BadInput("StochasticWeightAveraging under ZeRO-3", _fit("--trainer.strategy", "lp_sharded", "--parallel.zero_stage",
                                                           "3", "--trainer.callbacks+=StochasticWeightAveraging",
                                                           "--trainer.callbacks.swa_lrs=0.01"),
             "zero_stage=3 shards every parameter over the dp ranks"),
    BadInput("layout given to Lightning's ddp", _fit("--trainer.strategy", "ddp", "--parallel.zero_stage", "1"),
             "does not take a layout"),
    BadInput("unknown strategy name", _fit("--trainer.strategy", "lp_dpp"), "Did you mean 'lp_dp' or 'lp_ddp'"),
    BadInput("negative devices", _fit("--trainer.devices", "-3"), "devices"),
    BadInput("world of one with tp 2", _fit("--trainer.strategy", "lp_tensor", "--trainer.devices", "1",
                                             "--parallel.tensor_parallel_size", "2"), "world size is 1"),
    BadInput("block size not divisible by 2 x cp", _fit("--trainer.devices", "3", "--parallel.context_parallel_size",
                                                        "3"), "block_size is 128: 128 % 6 = 2"),
    BadInput("attention dropout under cp", _fit("--parallel.context_parallel_size", "2", "--model.init_args.dropout",
                                                "0.1"), "dropout on the attention probabilities is not run"),
    # --- data
    BadInput("data path that does not exist", _fit("--data.init_args.path", "{dir}/no_such.txt"), "does not exist"),
    BadInput("empty text file", _fit("--data.init_args.path", "{dir}/empty.txt"), "is empty"),
    BadInput("empty folder", _fit("--data.init_args.path", "{dir}/empty_folder"), "holds no text files"),
    BadInput("corpus smaller than one batch per rank", _fit("--data.init_args.path", "{dir}/tiny.txt"),
             "one batch per data-parallel rank"),
    BadInput("block_size 0", _fit("--data.init_args.block_size", "0", "--model.init_args.block_size", "1"),
             "block_size=0"),
    BadInput("batch_size 0", _fit("--data.init_args.batch_size", "0"), "batch_size=0"),
    BadInput("data block longer than the model's", _fit("--data.init_args.block_size", "256"),
             "block_size"),
    # --- recipes
    BadInput("recipe with a YAML syntax error", ("fit", "--config", "{dir}/broken.yaml"),
             "YAML syntax error at line 4, column 6"),
    BadInput("recipe that does not exist", ("fit", "--config", "{dir}/no_such.yaml"), "no_such.yaml"),
    BadInput("recipe defaults naming a missing file", ("fit", "--config", "{dir}/missing_default.yaml"),
             "does not exist"),
    BadInput("recipe defaults forming a cycle", ("fit", "--config", "{dir}/cycle_a.yaml"), "cycle"),
    BadInput("recipe that is a list", ("fit", "--config", "{dir}/list.yaml"), "mapping"),
    BadInput("parallel: auto beside a named strategy", ("fit", "--config", "{dir}/auto_and_ddp.yaml"),
             "trainer.strategy is 'lp_ddp'"),
    # --- checkpoints
    BadInput("ckpt_path that does not exist", _fit("--ckpt_path", "{dir}/no_such.ckpt"), "no such file or folder"),
    BadInput("ckpt_path of random bytes", _fit("--ckpt_path", "{dir}/random.ckpt"), "not a checkpoint"),
    BadInput("ckpt_path of 0 bytes", _fit("--ckpt_path", "{dir}/empty.ckpt"), "0 bytes"),
    BadInput("ckpt_path truncated", _fit("--ckpt_path", "{dir}/truncated.ckpt"), "truncated"),
    BadInput("ckpt_path with flipped bytes", _fit("--ckpt_path", "{dir}/flipped.ckpt"), "checksum"),
    BadInput("ckpt_path of another model shape", _fit("--ckpt_path", "{dir}/other_shape.ckpt"), "n_layer"),
    BadInput("shape override disagreeing with the checkpoint", _fit("--ckpt_path", "{dir}/good.ckpt",
                                                                     "--model.init_args.n_layer", "2"), "n_layer"),
    BadInput("empty folder as ckpt_path", _fit("--ckpt_path", "{dir}/empty_folder"), "holds nothing"),
    # --- NVMe
    BadInput("NVMe path that cannot be created", _fit("--trainer.strategy", "lp_zero_offload",
                                                      "--parallel.zero_stage", "3", "--parallel.offload", "nvme",
                                                      "--parallel.nvme_path", "{dir}/empty.txt/nvme"),
             "cannot be created"),
    BadInput("NVMe path that is a file", _fit("--trainer.strategy", "lp_zero_offload", "--parallel.zero_stage", "3",
                                              "--parallel.offload", "nvme", "--parallel.nvme_path", "{dir}/empty.txt"),
             "not a folder"),
    # --- planner
    BadInput("plan --params negative", ("plan", "--params", "-7e9"), "must be at least 1"),
    BadInput("plan --params not a number", ("plan", "--params", "seven"), "--params"),
    BadInput("plan --recipe broken", ("plan", "--recipe", "{dir}/broken.yaml", "--gpus-per-node", "2"),
             "YAML syntax error at line 4, column 6"),
    BadInput("plan --recipe missing", ("plan", "--recipe", "{dir}/no_such.yaml"), "no such file"),
    BadInput("plan --write-recipe unwritable", (*PLAN, "--write-recipe", "{dir}/empty.txt/planned.yaml"),
             "cannot write"),
    BadInput("plan --gpu-memory with a bad unit", ("plan", "--model", "gpt3-1.3b", "--gpu-memory", "8 parsecs"),
             "unknown unit"),
    BadInput("plan --hardware unknown", ("plan", "--model", "gpt3-1.3b", "--hardware", "dgx-z"), "no such profile"),
    BadInput("plan without a model", ("plan", "--gpus-per-node", "8"), "--params"),
    BadInput("plan --nodes 0", (*PLAN, "--nodes", "0"), "nodes=0"),
    # --- lp_auto
    BadInput("lp_auto where nothing fits", _fit("--trainer.strategy", "lp_auto", "--planner.gpu_memory", "5MB"),
             "no layout fits"),
    BadInput("lp_auto beside a parallel section", _fit("--trainer.strategy", "lp_auto",
                                                       "--parallel.tensor_parallel_size", "2"),
             "chooses the layout itself"),
    BadInput("lp_auto nodes not dividing the devices", _fit("--trainer.strategy", "lp_auto", "--planner.nodes", "3"),
             "do not split into 3"),
    # --- consolidate
    BadInput("consolidate a missing checkpoint", ("consolidate", "{dir}/no_such.ckpt", "{dir}/out.ckpt"),
             "no_such.ckpt", code=1),
    BadInput("consolidate random bytes", ("consolidate", "{dir}/random.ckpt", "{dir}/out.ckpt"), "not a checkpoint",
             code=1),
    # --- round 3 (issue 26): launch, checkpoints of every format, data, folders, tools, messages
    BadInput("num_nodes 2 without a launcher", _fit("--trainer.max_steps", "3", "--trainer.num_nodes", "2"),
             "nothing starts node 1"),
    BadInput("DCP folder without checksums.json, a byte flipped", _fit("--ckpt_path", "{dir}/dcp_no_manifest"),
             "without checksums.json"),
    BadInput("one-file checkpoint of format version 99", _fit("--ckpt_path", "{dir}/future_version.ckpt"),
             "format version 99; this lightning-parallel"),
    BadInput("DCP folder of format version 99", _fit("--ckpt_path", "{dir}/dcp_future"), "format version 99"),
    BadInput("DCP folder of another shape (n_embd 64 vs 128)", _pp("--ckpt_path", "{dir}/dcp",
                                                                  "--model.init_args.n_embd", "64"),
             "n_embd: configured 64, saved 128"),
    BadInput("check: DCP folder of another shape", _check("--trainer.strategy", "lp_pipeline",
                                                          "--parallel.pipeline_parallel_size", "2",
                                                          "--ckpt_path", "{dir}/dcp", "--model.init_args.n_embd",
                                                          "64"), "n_embd: configured 64, saved 128"),
    BadInput("file resumed with SGD instead of AdamW", _fit("--model", _FAULTY + "OptimizerChoiceGPT",
                                                            "--model.init_args.optimizer", "sgd",
                                                            "--ckpt_path", "{dir}/good.ckpt"),
             "returns SGD (dampening, momentum, nesterov)"),
    BadInput("DCP folder resumed with an added StepLR", _pp("--model", _FAULTY + "OptimizerChoiceGPT",
                                                            "--model.init_args.step_lr", "true",
                                                            "--ckpt_path", "{dir}/dcp"),
             "this run configures 2 (LambdaLR, StepLR)"),
    BadInput("0-d parameter under ZeRO-3", _sharded(3, "ScalarGainGPT"), "'gain' is a 0-d (scalar) parameter"),
    BadInput("two dtypes in one param group under ZeRO-1", _sharded(1, "HalfHeadGPT"),
             "param group 0 has dtypes ['torch.bfloat16', 'torch.float32']"),
    BadInput("two dtypes in one FSDP2 unit under ZeRO-3", _sharded(3, "HalfHeadGPT"),
             "head holds bfloat16 and float32"),
    BadInput("dict batch under lp_pipeline without pipeline_batch", _pp("--data", _FAULTY + "DictBatchTextData"),
             "cannot split a real training batch"),
    BadInput("check: dict batch under lp_pipeline", _check("--trainer.strategy", "lp_pipeline",
                                                           "--parallel.pipeline_parallel_size", "2",
                                                           "--data", _FAULTY + "DictBatchTextData"),
             "cannot split a real training batch"),
    BadInput("default_root_dir that cannot be created", _fit("--trainer.default_root_dir", "{dir}/empty.txt/runs"),
             "trainer.default_root_dir"),
    BadInput("logger folder that cannot be created", _fit("--trainer.logger.init_args.save_dir",
                                                         "{dir}/empty.txt/logs"), "save_dir"),
    BadInput("check: logger folder that cannot be created", _check("--trainer.logger.init_args.save_dir",
                                                                  "{dir}/empty.txt/logs"), "save_dir"),
    BadInput("val_check_interval longer than the epoch", _fit("--trainer.val_check_interval", "100000"),
             "val_check_interval=100000 batches, but an epoch has only"),
    BadInput("check: val_check_interval longer than the epoch", _check("--trainer.val_check_interval", "100000"),
             "val_check_interval=100000 batches"),
    BadInput("limit_train_batches leaving 0 batches", _fit("--trainer.limit_train_batches", "0.0001"),
             "0 training batches per data-parallel rank"),
    BadInput("lp_zero_offload with SGD", _fit("--trainer.strategy", "lp_zero_offload", "--model",
                                              _FAULTY + "OptimizerChoiceGPT", "--model.init_args.optimizer", "sgd"),
             "SGD, which cannot be offloaded"),
    BadInput("DCP folder without .metadata", _fit("--ckpt_path", "{dir}/dcp_no_metadata"),
             ".metadata is missing (listed in checksums.json)"),
    BadInput("consolidate a DCP folder without .metadata",
             ("consolidate", "{dir}/dcp_no_metadata", "{dir}/out_no_metadata.ckpt"), ".metadata is missing", code=1),
    BadInput("pipeline_stage_layers [0, 6]", _pp("--parallel.pipeline_stage_layers", "[0, 6]"),
             "0 is not a positive layer count"),
    BadInput("pipeline_stage_layers [2, 2]", _pp("--parallel.pipeline_stage_layers", "[2, 2]"),
             "2 counts that add up to 6 (e.g. [3, 3])"),
    BadInput("--model class path with a typo", _fit("--model", "lightning_parallel.models.GTP"),
             "Did you mean 'lightning_parallel.models.GPT'"),
    BadInput("sync_batchnorm on CPU", _fit("--trainer.sync_batchnorm", "true"),
             "SyncBatchNorm, which normalises over the whole global batch"),
    BadInput("detect_anomaly under tensor parallelism",
             _fit("--trainer.strategy", "lp_tensor", "--trainer.devices", "2", "--parallel.tensor_parallel_size", "2",
                  "--trainer.detect_anomaly", "true"), "Trainer(detect_anomaly=True) with tensor parallelism"),
    BadInput("plan --micro-batch-size 0", (*PLAN, "--micro-batch-size", "0"), "--micro-batch-size=0 must be"),
    BadInput("plan --seq-len 0", (*PLAN, "--seq-len", "0"), "--seq-len=0 must be"),
    BadInput("consolidate onto an existing file", ("consolidate", "{dir}/good.ckpt", "{dir}/random.ckpt"),
             "pass --force", code=1),
    BadInput("a checkpoint folder under Lightning's own strategy",
             _fit("--trainer.devices", "1", "--trainer.strategy", "auto", "--ckpt_path", "{dir}/dcp"),
             "loads one checkpoint file only"),
    BadInput("predict without predict data", ("predict", *FIT[1:]), "does not define predict_dataloader()"),
    BadInput("consolidate into the input folder", ("consolidate", "{dir}/dcp", "{dir}/dcp/model.ckpt"),
             "the output is inside the input checkpoint folder", code=1),
    BadInput("consolidate to an unwritable path", ("consolidate", "{dir}/good.ckpt", "{dir}/empty.txt/out.ckpt"),
             "cannot write", code=1),
)


def _write(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text)


def _gpt_checkpoint(path: Path, **shape: int) -> None:
    """A one-device Lightning checkpoint of the quick-start GPT (or another shape), trained one step."""
    import lightning.pytorch as pl

    from lightning_parallel.data import TextDataModule
    from lightning_parallel.models import GPT

    pl.seed_everything(0, verbose=False)
    args: dict[str, Any] = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 256, **shape}
    model = GPT(**args)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=TextDataModule(block_size=128, batch_size=4))
    trainer.save_checkpoint(path)


def make_fixtures(folder: Path) -> None:
    """Write the files the cases name into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "empty_folder").mkdir(exist_ok=True)
    _write(folder, "empty.txt", "")
    _write(folder, "tiny.txt", "def f():\n    return 1\n" * 20)
    _write(folder, "typo_key.yaml", f"defaults:\n  - {QUICKSTART}\nparallel:\n  zero_stag: 1\n")
    _write(folder, "broken.yaml", "trainer:\n  devices: 2\n  max_steps: [10\nmodel: {}\n")
    _write(folder, "missing_default.yaml", "defaults:\n  - nothing_here.yaml\ntrainer:\n  devices: 2\n")
    _write(folder, "cycle_a.yaml", "defaults:\n  - cycle_b.yaml\n")
    _write(folder, "cycle_b.yaml", "defaults:\n  - cycle_a.yaml\n")
    _write(folder, "list.yaml", "- trainer\n- model\n")
    _write(folder, "auto_and_ddp.yaml", f"defaults:\n  - {QUICKSTART}\ntrainer:\n  strategy: lp_ddp\nparallel: auto\n")
    (folder / "random.ckpt").write_bytes(bytes(range(256)) * 64)
    (folder / "empty.ckpt").write_bytes(b"")
    good = folder / "good.ckpt"
    if not good.is_file():
        _gpt_checkpoint(good)
    data = good.read_bytes()
    (folder / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    middle = len(flipped) // 2  # inside the weights' bytes
    flipped[middle] ^= 0xFF
    (folder / "flipped.ckpt").write_bytes(bytes(flipped))
    if not (folder / "other_shape.ckpt").is_file():
        _gpt_checkpoint(folder / "other_shape.ckpt", n_layer=2)
    import shutil

    import torch

    from lightning_parallel.checkpoint.names import FORMAT_VERSION_KEY, LAYOUT_FILE, MANIFEST_FILE
    from lightning_parallel.checkpoint.verify import write_manifest

    content = torch.load(good, weights_only=True)
    torch.save({**content, FORMAT_VERSION_KEY: 99}, folder / "future_version.ckpt")
    if not (folder / "dcp").is_dir():
        write_dcp_folder(good, folder / "dcp")
    for name in ("dcp_no_manifest", "dcp_future", "dcp_no_metadata"):
        shutil.rmtree(folder / name, ignore_errors=True)
        shutil.copytree(folder / "dcp", folder / name)
    (folder / "dcp_no_manifest" / MANIFEST_FILE).unlink()
    shard = folder / "dcp_no_manifest" / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    record = json.loads((folder / "dcp_future" / LAYOUT_FILE).read_text())
    (folder / "dcp_future" / LAYOUT_FILE).write_text(json.dumps({**record, "format_version": 99}))
    write_manifest(folder / "dcp_future")  # a folder written by a newer version, whole
    (folder / "dcp_no_metadata" / ".metadata").unlink()


def write_dcp_folder(file: Path, folder: Path, *, strategy: str = "lp_pipeline") -> None:
    """The DCP folder (``lp_pipeline``'s format, one rank) of a one-file checkpoint of the library's GPT, written
    without a process group: the module's tensors and the optimizer state by parameter name, ``meta.pt``,
    ``layout.json`` and ``checksums.json`` -- what a one-stage ``lp_pipeline`` run saves."""
    import torch

    from lightning_parallel.checkpoint.atomic import replace_with
    from lightning_parallel.checkpoint.formats.dcp import _write_shards
    from lightning_parallel.checkpoint.names import DCP_LAYOUT_KEYS, FORMAT_VERSION, FORMAT_VERSION_KEY, LAYOUT_FILE
    from lightning_parallel.checkpoint.resume import optimizer_by_name
    from lightning_parallel.checkpoint.verify import write_manifest
    from lightning_parallel.models import GPT

    checkpoint = torch.load(file, weights_only=True)
    with torch.device("meta"):
        model = GPT(**checkpoint["hyper_parameters"])
    named = list(model.named_parameters())
    names = [[n for n, p in named if p.dim() >= 2], [n for n, p in named if p.dim() < 2]]  # GPT's two groups
    state = checkpoint.pop("state_dict")
    optimizers = [optimizer_by_name(s, names) for s in checkpoint.pop("optimizer_states")]
    layout = {"strategy": strategy, "dp": 1, "pp": 1, "tp": 1, "virtual_pipeline_stages": 1, "zero_stage": 0}
    checkpoint[DCP_LAYOUT_KEYS[strategy]] = layout
    checkpoint[FORMAT_VERSION_KEY] = FORMAT_VERSION
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True)
    _write_shards(partial, model_state=state, optimizer_states=optimizers, meta=checkpoint, rank=0)
    (partial / LAYOUT_FILE).write_text(json.dumps({**layout, "format_version": FORMAT_VERSION}))
    write_manifest(partial)
    replace_with(partial, folder)


@dataclass
class Outcome:
    """What one case did."""

    code: int
    first_line: str
    seconds: float
    spawned: bool
    traceback: str = ""
    output: str = ""


def run_in_process(case: BadInput, folder: Path) -> Outcome:
    """Run ``case`` through :func:`lightning_parallel.cli.main` in this process (the caller may trap the launchers:
    a case must not start a rank)."""
    from lightning_parallel.cli import main

    argv = [a.replace("{dir}", str(folder)) for a in case.argv]
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    traceback_name = ""
    saved_env = dict(os.environ)  # a launcher that got as far as starting ranks sets MASTER_PORT, LOCAL_RANK, ...
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse / jsonargparse end with a message and exit code 2
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception as exc:  # a traceback: a bug by the table's rule
            code, traceback_name = 1, f"{type(exc).__name__}: {exc}"
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
    seconds = time.perf_counter() - start
    text = err.getvalue() + out.getvalue()
    lines = [line for line in err.getvalue().splitlines() if "error" in line.lower()] or text.splitlines() or [""]
    spawned = "Initializing distributed" in text
    return Outcome(code=code, first_line=lines[0].strip(), seconds=seconds, spawned=spawned,
                   traceback=traceback_name, output=text)
