"""Every branch of the decision guide: the planner's recommended recipe is one ``fit`` accepts.

For each branch the planner writes its recipe, and ``lightning-parallel check`` -- the dry run of ``fit`` -- parses it
like ``fit`` does, builds the model (on the meta device: 175B parameters cost nothing), the data module and the
Trainer, which resolves the layout against ``devices x num_nodes``, and checks the module against the layout. GPU
recipes are checked with ``--trainer.accelerator cpu`` (same devices and nodes). The recommended strategy must be a
registered one of this version (the layout table's available names), never a planned one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.strategies import StrategyRegistry

import lightning_parallel  # noqa: F401  (registers the strategies)
from lightning_parallel.cli import check_recipe, main
from lightning_parallel.layouts import available_strategies
from lightning_parallel.planner import ModelSpec, TrainingSettings, make_plan
from lightning_parallel.planner.hardware import load_profile, make_hardware
from lightning_parallel.planner.model import MODEL_PRESETS, ModelShape
from lightning_parallel.planner.recipe_writer import write_recipe

BF16 = TrainingSettings()

# A model whose largest layer (the 262144 x 1024 embedding: 1.07 GB of bf16 weights + gradients) does not fit a
# 2 GB device with 1 GiB reserved for the runtime, while the rest would: the guide's "largest layer does not fit"
# branches.
WIDE_VOCAB = ModelShape(n_layer=2, n_embd=1024, n_head=8, vocab_size=262144, block_size=256)
_LARGEST = {"gpu_memory": "2GB", "cpu_memory_per_node": "64GB", "reserved_memory": "1GiB"}
# A 131072-token sequence: the model states fit one 40 GB device, the activations of one sequence do not (SDPA keeps no
# s^2 tensor, so 32768 tokens would fit), and splitting
# the sequence over cp = 2 ranks does -- the guide's "sequence does not fit" branches (context parallelism).
LONG_SEQUENCE = ModelShape(n_layer=8, n_embd=1024, n_head=8, vocab_size=32000, block_size=131072, dropout=0.0)

# branch -> (model preset, hardware)
BRANCHES: dict[str, tuple[str | ModelShape, dict[str, Any]]] = {
    "one-gpu/fits": ("gpt3-125m", {"gpu_memory": "24GB"}),
    "one-gpu/does-not-fit": ("gpt3-6.7b", {"gpu_memory": "24GB", "cpu_memory_per_node": "512GB"}),
    "one-gpu/largest-layer-does-not-fit": (WIDE_VOCAB, _LARGEST),
    "one-node/fits": ("gpt3-125m", {"gpus_per_node": 8, "gpu_memory": "24GB"}),
    "one-node/does-not-fit/nvlink": ("gpt3-6.7b", {"profile": "dgx-a100-80gb"}),
    "one-node/does-not-fit/pcie": ("gpt3-6.7b", {"profile": "dgx-a100-80gb", "intra_node": "pcie"}),
    "one-node/largest-layer-does-not-fit": (WIDE_VOCAB, {"gpus_per_node": 8, **_LARGEST}),
    "one-node/sequence-does-not-fit": (LONG_SEQUENCE, {"gpus_per_node": 8, "gpu_memory": "40GB"}),
    "several-nodes/sequence-does-not-fit": (LONG_SEQUENCE, {"nodes": 2, "gpus_per_node": 8, "gpu_memory": "40GB"}),
    "several-nodes/fits": ("gpt3-125m", {"nodes": 2, "gpus_per_node": 8, "gpu_memory": "24GB"}),
    "several-nodes/does-not-fit/fast": ("gpt3-13b", {"nodes": 8, "gpus_per_node": 8, "gpu_memory": "32GB"}),
    "several-nodes/does-not-fit/slow": ("gpt3-175b", {"profile": "dgx-a100-80gb", "nodes": 16,
                                                      "inter_node": "slow"}),
    "several-nodes/largest-layer-does-not-fit/fast": (WIDE_VOCAB, {"nodes": 2, "gpus_per_node": 8, **_LARGEST}),
    "several-nodes/largest-layer-does-not-fit/slow": (WIDE_VOCAB, {"nodes": 2, "gpus_per_node": 8,
                                                                   "inter_node": "slow", **_LARGEST}),
}


def _hardware(spec: dict[str, Any]) -> Any:
    spec = dict(spec)
    profile = spec.pop("profile", None)
    return load_profile(profile, **spec) if profile else make_hardware(**spec)


def test_every_branch_of_the_guide_is_covered() -> None:
    from lightning_parallel.planner.guide import BRANCH_FAMILIES

    assert set(BRANCHES) == set(BRANCH_FAMILIES)


def test_the_layout_table_names_registered_strategies() -> None:
    for name in available_strategies():
        assert name in StrategyRegistry, name
    for name in ("lp_tensor", "lp_pipeline", "lp_hybrid"):
        assert name in available_strategies() and name in StrategyRegistry


@pytest.mark.parametrize("branch", sorted(BRANCHES))
def test_recommended_recipe_passes_the_dry_run_of_fit(branch: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    model, spec = BRANCHES[branch]
    if isinstance(model, str):
        shape, name = MODEL_PRESETS[model], model
    else:
        shape, name = model, ("wide-vocab" if model is WIDE_VOCAB else "long-sequence")
    plan = make_plan(ModelSpec.from_shape(shape, name=name), BF16, _hardware(spec))
    assert plan.branch == branch, plan.reason
    chosen = plan.recommended
    assert chosen is not None, plan.reason
    assert chosen.strategy == "single_device" or chosen.strategy in available_strategies(), chosen.strategy
    path = write_recipe(plan, tmp_path / "planned.yaml", command=f"test {branch}")
    overrides = ["--trainer.accelerator", "cpu", "--trainer.logger", "false"]
    if chosen.layout.offload_device == "nvme":  # the planner writes a placeholder folder
        overrides += ["--parallel.nvme_path", str(tmp_path / "nvme")]
    line = check_recipe(["--config", str(path), *overrides])
    print(f"\n{branch}: {line}")
    expected = "lp_ddp" if chosen.strategy == "single_device" else chosen.strategy  # 1 device: plain Trainer
    if chosen.strategy != "single_device":
        assert f"strategy {expected} (" in line, line
    assert "recipe OK" in line and "nothing was started" in line
    # the mesh order: written on several nodes (and read back by the dry run), pp-dp-tp where pp and dp > 1
    section = yaml.safe_load(path.read_text()).get("parallel", {})
    lay = chosen.layout
    assert ("mesh_order" in section) == (plan.hardware.nodes > 1), section
    if plan.hardware.nodes > 1:
        assert section["mesh_order"] == lay.mesh_order and chosen.cross_node_bytes
        pp_and_dp = lay.pipeline_parallel_size > 1 and int(lay.data_parallel_size) > 1
        assert lay.mesh_order == ("pp-dp-tp" if pp_and_dp else "dp-pp-tp"), (lay.describe(), chosen.cross_node_bytes)
        assert ("mesh_order pp-dp-tp" in line) == (lay.mesh_order == "pp-dp-tp"), line
    if branch.endswith("sequence-does-not-fit"):  # the sequence is split, and the recipe says so
        assert lay.context_parallel_size > 1 and section["context_parallel_size"] == lay.context_parallel_size
    if branch == "several-nodes/does-not-fit/slow":  # gpt3-175b on 16 nodes: only activations cross nodes
        assert lay.mesh_order == "pp-dp-tp" and chosen.cross_node_bytes["pp-dp-tp"]["dp"] == 0


def test_check_refuses_a_bad_layout_with_the_arithmetic(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[2]
    assert main(["check", "--config", str(root / "recipes" / "quickstart.yaml"),
                 "--parallel.data_parallel_size", "3"]) == 2
    err = capsys.readouterr().err
    assert "data_parallel_size (3)" in err and "world size is 2" in err and "Fix:" in err
