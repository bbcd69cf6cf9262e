"""The decision guide (docs/formulas.md, "Choosing a strategy"): one test per branch, the CLI, the JSON object and
the recipe."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml

from lightning_parallel.config import ParallelConfig
from lightning_parallel.layouts import available_strategies
from lightning_parallel.planner import (
    MODEL_PRESETS,
    ModelShape,
    ModelSpec,
    TrainingSettings,
    estimate_memory,
    load_profile,
    make_hardware,
    make_plan,
    model_states,
)
from lightning_parallel.planner import plan as plan_module
from lightning_parallel.planner.cli import main
from lightning_parallel.planner.plan import Plan
from lightning_parallel.planner.report import plan_json

ADAMW_BF16 = TrainingSettings()


def _plan(model: ModelSpec, **hardware: object) -> Plan:
    return make_plan(model, ADAMW_BF16, make_hardware(**hardware))


def _preset(name: str) -> ModelSpec:
    return ModelSpec.from_shape(MODEL_PRESETS[name], name=name)


def _rec(plan: Plan, *, guide: bool = False) -> tuple[str, int, int, int, int, str]:
    """The recommendation (or, ``guide=True``, the guide's own first choice, whether its strategy exists yet)."""
    c = plan.guide_choice if guide else plan.recommended
    assert c is not None, plan.reason
    if not guide:
        assert c.available and (c.strategy == "single_device" or c.strategy in available_strategies()), c.strategy
    lay = c.layout
    return (c.strategy, int(lay.data_parallel_size), lay.pipeline_parallel_size, lay.tensor_parallel_size,
            lay.zero_stage, lay.offload)


# --------------------------------------------------------------------------- one GPU
def test_one_gpu_fits_trains_normally() -> None:
    plan = _plan(_preset("gpt3-125m"), gpu_memory="24GB")
    assert plan.branch == "one-gpu/fits"
    assert _rec(plan) == ("single_device", 1, 1, 1, 0, "none")


def test_one_gpu_does_not_fit_uses_zero_offload() -> None:
    plan = _plan(ModelSpec.from_params(7_500_000_000), gpu_memory="24GB", cpu_memory_per_node="512GB")
    assert plan.branch == "one-gpu/does-not-fit"
    strategy, dp, _, _, zero, offload = _rec(plan)
    assert (strategy, dp, offload) == ("lp_zero_offload", 1, "cpu") and zero in (2, 3)


def test_one_gpu_nvme_when_host_memory_is_too_small() -> None:
    plan = _plan(ModelSpec.from_params(7_500_000_000), gpu_memory="24GB", cpu_memory_per_node="64GB", nvme=True)
    assert _rec(plan)[-1] == "nvme"


def test_one_gpu_largest_layer_does_not_fit_tiles_it() -> None:
    model = ModelSpec.from_params(30_000_000_000, largest_layer_params=7_000_000_000)  # 28 GB of weights + grads
    plan = _plan(model, gpu_memory="24GB", cpu_memory_per_node="1TB")
    assert plan.branch == "one-gpu/largest-layer-does-not-fit"
    assert _rec(plan) == ("lp_zero_offload", 1, 1, 1, 3, "cpu")
    assert plan.recommended is not None and plan.recommended.tiled_layers


# --------------------------------------------------------------------------- one node
def test_one_node_fits_uses_ddp() -> None:
    plan = _plan(_preset("gpt3-125m"), gpus_per_node=8, gpu_memory="24GB")
    assert plan.branch == "one-node/fits"
    assert _rec(plan) == ("lp_ddp", 8, 1, 1, 0, "none")
    families = [c.family for c in plan.candidates if c.fits]
    assert next(f for f in families if f != "ddp") == "zero"  # the alternative the guide names comes next


def test_one_node_does_not_fit_nvlink_prefers_zero() -> None:
    plan = make_plan(_preset("gpt3-6.7b"), ADAMW_BF16, load_profile("dgx-a100-80gb"))
    assert plan.branch == "one-node/does-not-fit/nvlink"
    assert plan.recommended is not None and plan.recommended.family == "zero"
    assert _rec(plan)[0] in ("lp_sharded", "lp_zero_offload")


def test_one_node_does_not_fit_pcie_prefers_pipeline() -> None:
    plan = make_plan(_preset("gpt3-6.7b"), ADAMW_BF16, load_profile("dgx-a100-80gb", intra_node="pcie"))
    assert plan.branch == "one-node/does-not-fit/pcie"
    strategy, dp, pp, tp, zero, _ = _rec(plan, guide=True)
    assert (strategy, tp, zero) == ("lp_pipeline", 1, 0) and pp > 1 and dp * pp == 8
    assert _rec(plan) == _rec(plan, guide=True)  # lp_pipeline exists: the guide's choice is the recommendation


def test_one_node_largest_layer_does_not_fit_uses_tiled_zero() -> None:
    model = ModelSpec.from_params(30_000_000_000, largest_layer_params=22_000_000_000)
    plan = _plan(model, gpus_per_node=8, gpu_memory="80GiB")
    assert plan.branch == "one-node/largest-layer-does-not-fit"
    assert _rec(plan) == ("lp_sharded", 8, 1, 1, 3, "none")  # plain ZeRO-3 is lp_sharded's, not the offload engine's
    assert plan.recommended is not None and plan.recommended.tiled_layers


def test_one_node_largest_layer_falls_back_to_tp_without_zero() -> None:
    model = ModelSpec.from_params(30_000_000_000, largest_layer_params=22_000_000_000)
    plan = _plan(model, gpus_per_node=8, gpu_memory="80GiB")
    tp = [c for c in plan.candidates if c.fits and c.family == "tp"]
    assert tp and all(c.layout.tensor_parallel_size >= 2 and not c.tiled_layers for c in tp)


# --------------------------------------------------------------------------- several nodes
def test_several_nodes_fits_uses_ddp() -> None:
    plan = _plan(_preset("gpt3-125m"), nodes=2, gpus_per_node=8, gpu_memory="24GB")
    assert plan.branch == "several-nodes/fits"
    assert _rec(plan) == ("lp_ddp", 16, 1, 1, 0, "none")


def test_several_nodes_fast_uses_zero_as_the_zero_paper() -> None:
    plan = _plan(ModelSpec.from_params(7_500_000_000), nodes=8, gpus_per_node=8, gpu_memory="32GB")
    assert plan.branch == "several-nodes/does-not-fit/fast"
    # HSDP: ZeRO-3 sharded inside each node of 8, replicated across the 8 nodes -- only the all-reduce of the
    # gradient shards crosses nodes, so it beats plain ZeRO-3 over all 64 ranks. Plain ZeRO-2 does not fit: the
    # library's ZeRO-2 keeps fp32 weights under autocast, 4 P + 12 P / 64 = 31.4 GB of states (the ZeRO paper's
    # 16-bit weights with an fp32 master in the optimizer, 2 P + 14 P / 64 = 16.6 GB, would)
    assert _rec(plan) == ("lp_sharded", 64, 1, 1, 3, "none")
    assert plan.recommended is not None and plan.recommended.layout.data_parallel_shard_size == 8
    plain = [c for c in plan.candidates if c.layout.data_parallel_shard_size is None and c.family == "zero"]
    fitting = [c for c in plain if c.fits]
    assert fitting[0].layout.zero == 3 and fitting[0].cost.step_s > plan.recommended.cost.step_s
    zero2 = next(c for c in plain if c.layout.zero == 2)
    assert not zero2.fits and zero2.memory.model_states == 4 * 7_500_000_000 + 12 * 7_500_000_000 // 64
    paper = make_plan(ModelSpec.from_params(7_500_000_000), TrainingSettings(master_weights="optimizer"),
                      make_hardware(nodes=8, gpus_per_node=8, gpu_memory="32GB"))
    assert next(c for c in paper.candidates if c.fits and c.layout.data_parallel_shard_size is None
                and c.family == "zero").layout.zero == 2


def test_several_nodes_slow_uses_dp_pp_tp_zero1() -> None:
    plan = make_plan(_preset("gpt3-175b"), ADAMW_BF16, load_profile("dgx-a100-80gb", nodes=16, inter_node="slow"))
    assert plan.branch == "several-nodes/does-not-fit/slow"
    strategy, dp, pp, tp, zero, _ = _rec(plan, guide=True)
    assert (strategy, zero) == ("lp_hybrid", 1) and dp > 1 and pp > 1 and 1 < tp <= 8
    assert _rec(plan)[0] in available_strategies() and "lp_hybrid" in plan.reason
    assert 96 % pp == 0 and dp * pp * tp == 128


@pytest.mark.parametrize(("link", "family"), [("fast", "zero"), ("slow", "3d-zero1")])
def test_several_nodes_largest_layer_does_not_fit(link: str, family: str) -> None:
    model = ModelSpec.from_params(30_000_000_000, largest_layer_params=22_000_000_000)
    plan = _plan(model, nodes=2, gpus_per_node=8, gpu_memory="80GiB", inter_node=link)
    assert plan.branch == f"several-nodes/largest-layer-does-not-fit/{link}"
    assert plan.guide_choice is not None and plan.guide_choice.family == family
    assert plan.guide_choice.tiled_layers == (family == "zero")
    assert plan.recommended is not None and plan.recommended.available


def test_nothing_fits_says_so_and_names_the_nearest() -> None:
    plan = _plan(_preset("gpt3-175b"), gpus_per_node=2, gpu_memory="16GB", cpu_memory_per_node="64GB")
    assert plan.recommended is None
    assert "No layout fits" in plan.reason and "Fix:" in plan.reason


def test_every_candidate_is_a_valid_layout_with_tp_inside_a_node() -> None:
    plan = make_plan(_preset("gpt3-13b"), ADAMW_BF16, load_profile("dgx-a100-80gb", nodes=2))
    for c in plan.candidates:
        lay = c.layout
        assert ParallelConfig.from_dict(lay.to_dict()) == lay
        assert lay.tensor_parallel_size <= 8 and 40 % lay.pipeline_parallel_size == 0
        assert int(lay.data_parallel_size) * lay.pipeline_parallel_size * lay.tensor_parallel_size == 16


def test_fixed_micro_batches_leave_out_deeper_pipelines(capsys: pytest.CaptureFixture[str]) -> None:
    # --micro-batches 16 on 64 x 8 GPUs: 32- and 64-stage pipelines cannot run 1F1B on 16 micro-batches; they are left
    # out instead of failing the whole plan with the layout's refusal
    argv = ["--layers", "128", "--hidden", "4096", "--heads", "32", "--nodes", "64", "--gpus-per-node", "8",
            "--gpu-memory", "80GB", "--micro-batches", "16", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    stages = {c["pipeline_parallel_size"] for c in out["candidates"]}
    assert max(stages) == 16 and 2 in stages


# --------------------------------------------------------------------------- CLI, JSON, recipe
def test_cli_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "7.5e9", "--nodes", "8", "--gpus-per-node", "8", "--gpu-memory", "32GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the library's engines keep fp32 weights under bf16-mixed: 8 P + 8 P / N, 4 P + 12 P / N (not the ZeRO paper's
    # 16-bit weights: 31.4 and 16.6 GB)
    assert out["model_states_bytes"] == {"ddp": 120_000_000_000, "zero1": 60_937_500_000,
                                         "zero2": 31_406_250_000, "zero3": 1_875_000_000}
    rec = out["recommendation"]
    for key in ("strategy", "data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size", "zero_stage",
                "offload", "tiled_layers", "branch", "reason"):
        assert key in rec
    assert rec["strategy"] == "lp_sharded" and rec["zero_stage"] == 3 and rec["tiled_layers"] is False
    assert rec["data_parallel_shard_size"] == 8  # HSDP inside each node (see the test above)


def test_plan_json_lives_in_report_and_plan_does_not_import_it() -> None:
    """``plan_json`` gives the JSON the CLI prints; ``plan.py`` never imports ``report.py`` (no import circle)."""
    plan = _plan(ModelSpec.from_params(7_500_000_000), nodes=8, gpus_per_node=8, gpu_memory="32GB")
    out = plan_json(plan)
    assert out["model_states_bytes"] == plan.model_states_bytes
    assert out["recommendation"]["strategy"] == "lp_sharded" and len(out["candidates"]) == len(plan.candidates)
    json.dumps(out)  # serializable as it is
    tree = ast.parse(Path(plan_module.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "lightning_parallel.planner.report" not in imported, imported


def test_cli_table_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "gpt3-125m", "--gpus-per-node", "1", "--gpu-memory", "24GB"]) == 0
    out = capsys.readouterr().out
    assert "Recommendation: single_device" in out and "Branch: one-gpu/fits" in out and "params" in out
    assert main(["--params", "7.5e9", "--gpu-memory", "32XB"]) == 2
    assert "GiB" in capsys.readouterr().err
    assert main(["--params", "7.5e9", "--model", "gpt3-125m", "--gpu-memory", "32GB"]) == 2
    assert "exactly one model" in capsys.readouterr().err


def test_write_recipe_for_ddp_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "planned.yaml"
    argv = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq-len", "64",
            "--hardware", "cpu-2proc", "--precision", "fp32", "--micro-batch-size", "8", "--write-recipe", str(path)]
    assert main(argv) == 0
    recipe = yaml.safe_load(path.read_text())
    assert recipe["trainer"]["strategy"] == "lp_ddp" and recipe["trainer"]["accelerator"] == "cpu"
    assert recipe["trainer"]["devices"] == 2 and recipe["trainer"]["precision"] == "32-true"
    layout = ParallelConfig.from_dict(recipe["parallel"])
    assert (layout.data_parallel_size, layout.zero_stage) == (2, 0)
    assert recipe["model"]["init_args"]["n_layer"] == 2 and recipe["data"]["init_args"]["batch_size"] == 8
    assert path.read_text().startswith("# written by: lightning-parallel plan")
    capsys.readouterr()
    # the recipe's model section reads back as the same model
    assert main(["--recipe", str(path), "--hardware", "cpu-2proc", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommendation"]["strategy"] == "lp_ddp"


def test_write_recipe_needs_a_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--params", "1e8", "--gpu-memory", "24GB", "--write-recipe", str(tmp_path / "r.yaml")]
    assert main(argv) == 2
    assert "needs the model's shape" in capsys.readouterr().err


def test_the_runtime_allowance_scales_is_printed_and_can_be_set(capsys: pytest.CaptureFixture[str]) -> None:
    """A fixed 1 GiB allowance made small budgets contradict themselves ("the largest layer needs 528 KB" yet "the
    largest layer does not fit" in 200 MB): the default is now min(1 GiB, 5% of the device), 0 on CPU, or given."""
    assert make_hardware(gpu_memory="80GiB").reserved == 2**30
    assert make_hardware(gpu_memory="200MB").reserved == 10_000_000
    assert make_hardware(gpu_memory="200MB", accelerator="cpu").reserved == 0
    assert make_hardware(gpu_memory="200MB", reserved_memory="50MB").reserved == 50_000_000
    model = ModelSpec.from_params(874_752, largest_layer_params=66_048)
    plan = make_plan(model, ADAMW_BF16, make_hardware(gpus_per_node=2, gpu_memory="200MB"))
    assert plan.situation.largest_layer_fits and plan.recommended is not None
    squeezed = make_plan(model, ADAMW_BF16, make_hardware(gpus_per_node=2, gpu_memory="200MB",
                                                           reserved_memory="199.9MB"))
    assert not squeezed.situation.largest_layer_fits
    assert "with the 199.9 MB reserved per device for the runtime that is" in squeezed.reason
    assert main(["--params", "874752", "--largest-layer-params", "66048", "--gpu-memory", "200MB"]) == 0
    out = capsys.readouterr().out
    assert "Allowance per device (the buffers column): 10.0 MB (default: min(1 GiB, 5% of 200.0 MB)" in out


def test_when_nothing_fits_the_fix_names_only_what_was_not_given() -> None:
    model = ModelSpec.from_params(7_500_000_000, largest_layer_params=10**8)
    tried = TrainingSettings(precision="bf16-mixed", micro_batch_size=1, activation_checkpointing="full")
    plan = make_plan(model, tried, make_hardware(gpus_per_node=2, gpu_memory="1GB", nvme=True,
                                                 cpu_memory_per_node="1GB"))
    assert plan.recommended is None
    fix = plan.reason.split("Fix: ")[1]
    assert "more devices or more memory per device" in fix
    for already in ("activation checkpointing", "smaller micro-batch", "NVMe", "--reserved-memory"):
        assert already not in fix, fix
    untried = TrainingSettings(precision="bf16-mixed", micro_batch_size=8, activation_checkpointing="none")
    hardware = make_hardware(gpus_per_node=2, gpu_memory="1GB", cpu_memory_per_node="1GB", reserved_memory="100MB")
    from lightning_parallel.planner.model import MODEL_PRESETS

    shaped = ModelSpec.from_shape(MODEL_PRESETS["gpt3-6.7b"])  # activations counted: recomputation and batch matter
    fix = make_plan(shaped, untried, hardware).reason.split("Fix: ")[1]
    for offered in ("activation checkpointing", "a smaller micro-batch (now 8)", "NVMe", "--reserved-memory"):
        assert offered in fix, fix
    # a bare parameter count: activations are not counted, so neither would change the verdict
    fix = make_plan(model, untried, hardware).reason.split("Fix: ")[1]
    assert "activation checkpointing" not in fix and "micro-batch" not in fix and "NVMe" in fix, fix


def test_a_recipes_batch_is_per_replica_and_a_pipeline_splits_it(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --recipe``: the data module's ``batch_size`` is sequences per data-parallel rank and step, as
    ``fit`` runs it; a pipeline layout splits it into micro-batches (before, it was read as the micro-batch: a
    pipeline of m micro-batches was planned with m times the run's tokens). ``--micro-batch-size`` gives the
    micro-batch itself."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"class_path": "lightning_parallel.models.GPT",
                  "init_args": {"n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 32, "vocab_size": 256}},
        "data": {"class_path": "lightning_parallel.data.TextDataModule", "init_args": {"batch_size": 16}}}))
    assert main(["--recipe", str(path), "--hardware", "cpu-2proc", "--json"]) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert (training["batch_per_replica"], training["micro_batch_size"]) == (16, 16)
    assert main(["--recipe", str(path), "--hardware", "cpu-2proc", "--micro-batch-size", "4", "--json"]) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert (training["batch_per_replica"], training["micro_batch_size"]) == (None, 4)
    split = TrainingSettings(micro_batch_size=16, batch_per_replica=16).for_pipeline(2)
    assert split.micro_batch_size * split.micro_batches(2) == 16 and split.micro_batches(2) > 1


def test_accumulation_keeps_zero2_and_zero3_gradients_whole(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """ZeRO-2/3 (without offload) reduce once per step, after its last batch: with accumulation the peak holds the
    whole local gradient (measured for the flat ZeRO-2 in tests/trainer/test_sharded.py). DDP, ZeRO-1 and the
    offload engine (which reduces every batch) keep their figures; a pipeline already held the whole gradient."""
    psi, fp32 = 1000, TrainingSettings(precision="fp32").state_bytes
    for zero in (2, 3):
        alone = model_states(psi, fp32, dp=4, zero_stage=zero)
        accumulating = model_states(psi, fp32, dp=4, zero_stage=zero, accumulate=True)
        assert (alone.grads, accumulating.grads) == (4 * 250, 4 * psi)
        assert (accumulating.params, accumulating.optimizer) == (alone.params, alone.optimizer)
        offloaded = model_states(psi, fp32, dp=4, zero_stage=zero, offload="cpu", accumulate=True)
        assert offloaded == model_states(psi, fp32, dp=4, zero_stage=zero, offload="cpu")
        in_pipeline = model_states(psi, fp32, dp=4, zero_stage=zero, pipeline=True)
        assert model_states(psi, fp32, dp=4, zero_stage=zero, pipeline=True, accumulate=True) == in_pipeline
    for zero in (0, 1):
        assert (model_states(psi, fp32, dp=4, zero_stage=zero, accumulate=True)
                == model_states(psi, fp32, dp=4, zero_stage=zero))
    # how many batches a layout accumulates: as given, or the run's rule global / (batch x dp)
    assert TrainingSettings(accumulate_grad_batches=3).accumulation(dp=8) == 3
    fixed = TrainingSettings(batch_per_replica=4, global_batch_size=64)
    assert [fixed.accumulation(dp) for dp in (1, 2, 4, 8, 16, 32)] == [16, 8, 4, 2, 1, 1]
    assert TrainingSettings(micro_batch_size=2, num_micro_batches=4, global_batch_size=64).accumulation(2, pp=2) == 4
    with pytest.raises(ValueError, match="accumulate_grad_batches=0 must be a positive integer"):
        TrainingSettings(accumulate_grad_batches=0)
    # estimate_memory applies it per layout; the CLI takes it from the flag or the recipe (trainer, parallel)
    model = ModelSpec.from_shape(ModelShape(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=256))
    hw = make_hardware(gpus_per_node=8, gpu_memory="80GB")
    zero3 = ParallelConfig(data_parallel_size=8, zero_stage=3)
    grads = [estimate_memory(model, t, hw, zero3).grads for t in (
        TrainingSettings(), TrainingSettings(accumulate_grad_batches=2),
        TrainingSettings(batch_per_replica=4, global_batch_size=32), TrainingSettings(batch_per_replica=4,
                                                                                     global_batch_size=64))]
    # bf16-mixed: the whole gradient is kept in fp32 (FSDP2's reduce_dtype, the flat ZeRO-2's autocast), 4 bytes
    assert grads[0] == grads[2] < grads[1] == grads[3] == 4 * model.n_params
    each = ParallelConfig(data_parallel_size=8, zero_stage=3, reduce_each_batch=True)  # the shard kept, not the whole
    assert estimate_memory(model, TrainingSettings(accumulate_grad_batches=2), hw, each).grads == grads[0]
    def recipe(name: str, **sections: object) -> str:
        path = tmp_path / name
        path.write_text(yaml.safe_dump({
            "model": {"class_path": "lightning_parallel.models.GPT",
                      "init_args": {"n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 32, "vocab_size": 256}},
            "trainer": {"accumulate_grad_batches": 4},
            "data": {"class_path": "lightning_parallel.data.TextDataModule", "init_args": {"batch_size": 16}},
            **sections}))
        return str(path)

    fixed_recipe = recipe("fixed.yaml", parallel={"global_batch_size": 64})
    assert main(["--recipe", fixed_recipe, "--hardware", "cpu-2proc", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    training = out["training"]
    assert (training["accumulate_grad_batches"], training["global_batch_size"]) == (4, 64)
    # each candidate (and the recommendation) says what it accumulates: 64 / (16 x dp) on cpu-2proc's 2 ranks
    accumulated = {(c["data_parallel_size"], c["pipeline_parallel_size"]): c["accumulate_grad_batches"]
                   for c in out["candidates"]}
    assert accumulated[(2, 1)] == 2 and accumulated[(1, 1)] == 4, accumulated
    rec = out["recommendation"]
    assert rec["accumulate_grad_batches"] == 64 // (16 * rec["data_parallel_size"])
    # a misspelt layout key of the recipe is refused as fit refuses it (the plan ignored it)
    assert main(["--recipe", recipe("typo.yaml", parallel={"data_paralel_size": 2}), "--hardware", "cpu-2proc"]) == 2
    assert "unknown layout key 'data_paralel_size'. Did you mean 'data_parallel_size'?" in capsys.readouterr().err
    # sequences longer than the model's positions (fit refuses them; the plan planned them)
    assert main(["--model", "gpt3-13b", "--seq-len", "4096", "--block-size", "2048", "--gpu-memory", "80GB"]) == 2
    assert "--seq-len 4096 exceeds the model's block_size 2048" in capsys.readouterr().err
    # a global batch no number of replicas can make: refused with the arithmetic (it planned "none fits" and offered
    # more memory, exit 0)
    assert main(["--model", "gpt3-125m", "--gpu-memory", "80GB", "--gpus-per-node", "8", "--global-batch-size", "3",
                 "--micro-batch-size", "2"]) == 2
    assert ("--global-batch-size 3 is not a multiple of the batch each replica reads (2, --micro-batch-size): 3 % 2 "
            "= 1" in capsys.readouterr().err)
    assert main(["--recipe", fixed_recipe, "--hardware", "cpu-2proc", "--accumulate-grad-batches", "2",
                 "--global-batch-size", "128"]) == 0
    text = capsys.readouterr().out
    assert "global batch 128 (each layout accumulates" in text
    header = next(line for line in text.splitlines() if line.lstrip().startswith("# "))
    assert header.split()[header.split().index("recompute") + 1] == "acc", header
    # on two nodes (an `order` column before it) each row's cell is its own accumulation: 64 / (batch x dp), the
    # batch a micro-batch of 1 (x the pipeline's 4 x pp micro-batches)
    assert main(["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq-len", "64", "--nodes", "2",
                 "--gpus-per-node", "2", "--gpu-memory", "16GB", "--global-batch-size", "64", "--top", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("# "))
    names = lines[at].split()
    assert names.index("order") < names.index("acc")
    rows = [line.split() for line in lines[at + 2:] if line.strip()[:1].isdigit() or line.startswith(" -")]
    checked = 0
    for row in rows:
        # the cells up to `acc` are one word each, but for an HSDP layout's dp ("4 s2")
        if row[names.index("strategy")].startswith("lp_") and row[names.index("order")] in ("dp-pp-tp", "pp-dp-tp"):
            dp, pp = int(row[names.index("dp")]), int(row[names.index("pp")])
            assert row[names.index("acc")] == str(max(1, 64 // ((4 * pp if pp > 1 else 1) * dp))), (names, row)
            checked += 1
    assert checked >= 3, rows
    # the recipe it writes trains with the accumulation it was planned for
    written = tmp_path / "planned.yaml"
    assert main(["--recipe", fixed_recipe, "--hardware", "cpu-2proc", "--write-recipe", str(written)]) == 0
    assert yaml.safe_load(written.read_text())["parallel"]["global_batch_size"] == 64
    assert main(["--recipe", recipe("plain.yaml"), "--hardware", "cpu-2proc", "--write-recipe", str(written)]) == 0
    assert yaml.safe_load(written.read_text())["trainer"]["accumulate_grad_batches"] == 4
    # `parallel: auto` (lp_auto) reads as no layout, not a crash
    assert main(["--recipe", recipe("auto.yaml", parallel="auto"), "--hardware", "cpu-2proc", "--json"]) == 0
    capsys.readouterr()
    assert main(["--params", "1M", "--gpu-memory", "1GB", "--accumulate-grad-batches", "0"]) != 0
    assert "--accumulate-grad-batches=0 must be at least 1" in capsys.readouterr().err
