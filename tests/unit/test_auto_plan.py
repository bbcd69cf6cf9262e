"""lp_auto's decision, without a process group: every branch the budget drives, the refusal, the hardware read."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from lightning_parallel import LayoutError
from lightning_parallel.auto import NoLayoutFits, PlannerOptions, _runnable, plan_for_module
from lightning_parallel.cli import auto_parallel_args
from lightning_parallel.models import GPT
from lightning_parallel.planner.detect import detect_hardware, model_spec_from_module, nvlink_from_topology

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _quickstart_gpt() -> GPT:
    with torch.device("meta"):  # counted without allocating
        return GPT(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256)


def _decide(model: nn.Module, budget: str, *, devices: int = 2, **options: object) -> object:
    """The decision by the guide's order (``select="guide"``), what these tests pin; the fastest is tested apart."""
    return plan_for_module(model, accelerator="cpu", devices=devices, precision="32-true", micro_batch_size=16,
                           seq_len=128, options={"gpu_memory": budget, "select": "guide", **options})


def test_budgets_drive_every_branch_on_the_quickstart_model() -> None:
    """The quickstart GPT (0.87M parameters, fp32 AdamW, micro-batch 16 x 128 tokens given as the micro-batch) on 2
    CPU ranks: each budget takes another branch or family of the guide, and the chosen layout's estimate fits the
    budget."""
    model = _quickstart_gpt()
    expected = {
        "1GB": ("one-node/fits", "lp_ddp", "dp=2 pp=1 tp=1 zero=0"),
        "20MB": ("one-node/does-not-fit/nvlink", "lp_sharded", "dp=2 pp=1 tp=1 zero=2 recompute=full"),
        "16MB": ("one-node/does-not-fit/nvlink", "lp_pipeline", "dp=1 pp=2 tp=1 zero=0 recompute=full"),
        "14MB": ("one-node/does-not-fit/nvlink", "lp_tensor", "dp=1 pp=1 tp=2 zero=0 recompute=full"),
    }
    for budget, (branch, strategy, layout) in expected.items():
        decision = _decide(model, budget, micro_batch_size=16)
        assert (decision.plan.branch, decision.strategy_name, decision.layout.describe()) == (branch, strategy,
                                                                                               layout), budget
        assert decision.chosen.memory.total <= decision.plan.hardware.gpu_memory
        text = decision.text()
        assert f"lp_auto: chosen    {strategy} {layout}" in text and "lp_auto: runner-up" in text
        assert f"gpu_memory {budget[:-2]}.0 MB (given: --planner.gpu_memory)" in text or budget == "1GB"
    # 12MB: only offload fits; without DeepSpeed it is passed over with the reason and nothing else fits
    if HAS_DEEPSPEED:
        decision = _decide(model, "12MB", micro_batch_size=16)
        assert decision.strategy_name == "lp_zero_offload"
        assert decision.layout.describe() == "dp=2 pp=1 tp=1 zero=3 offload=cpu recompute=full"
        assert decision.predicted_states().host > 0 and decision.predicted_states().optimizer == 0
    else:
        with pytest.raises(NoLayoutFits, match="offload runs on DeepSpeed, which is not installed"):
            _decide(model, "12MB", micro_batch_size=16)


def test_a_pipeline_splits_the_data_modules_batch_as_the_run_does() -> None:
    """Without a given micro-batch, the data module's 16 sequences per dp rank are what a pipeline splits into m
    micro-batches (16 / 8 = 2 sequences each), as lp_pipeline runs them; so at 14 MB the pipeline fits where, with
    16 sequences per micro-batch, only tensor parallelism did, and its activations are those of 2 sequences."""
    model = _quickstart_gpt()
    decision = _decide(model, "14MB")
    assert (decision.strategy_name, decision.layout.describe()) == ("lp_pipeline",
                                                                    "dp=1 pp=2 tp=1 zero=0 recompute=full")
    assert decision.layout.num_micro_batches == 8
    assert "batch 16 per data-parallel rank (a pipeline splits it into micro-batches)" in decision.text()
    given = _decide(model, "14MB", micro_batch_size=16)  # a given micro-batch is one micro-batch
    assert given.strategy_name == "lp_tensor"
    pipeline = next(c for c in given.plan.candidates if c.layout.pipeline_parallel_size == 2
                    and c.layout.activation_checkpointing == "full" and c.layout.zero == 0)
    assert decision.chosen.memory.activations * 8 == pytest.approx(pipeline.memory.activations, rel=0.35)


def test_simulated_nodes_with_slow_links_take_the_hybrid() -> None:
    decision = _decide(_quickstart_gpt(), "12MB", devices=8, nodes=2, inter_node="slow")
    assert decision.plan.branch == "several-nodes/does-not-fit/slow"
    assert decision.strategy_name == "lp_hybrid"
    assert decision.layout.describe().startswith("dp=2 pp=2 tp=2 zero=1")
    assert decision.plan.hardware.nodes == 2 and decision.plan.hardware.gpus_per_node == 4
    assert "nodes 2 x 4 devices (given: --planner.nodes; the run keeps its 8 processes)" in decision.text()
    assert "Mesh order" in decision.text()


def test_largest_layer_above_the_budget_goes_to_tensor_parallelism() -> None:
    """A vocabulary-heavy model whose embedding alone (8192 x 64 weights + gradients, 4.2 MB) exceeds a 4 MB device:
    ZeRO-3 and offload would need it tiled (a model change lp_auto does not make), so TP splits it."""
    with torch.device("meta"):
        model = GPT(n_layer=2, n_head=8, n_embd=64, block_size=32, vocab_size=8192)
    decision = plan_for_module(model, accelerator="cpu", devices=8, precision="32-true", micro_batch_size=1,
                               seq_len=32, options={"gpu_memory": "4MB", "select": "guide"})
    assert decision.plan.branch == "one-node/largest-layer-does-not-fit"
    assert not decision.plan.situation.largest_layer_fits
    assert decision.strategy_name == "lp_tensor" and decision.layout.tensor_parallel_size == 8
    assert any("largest layer tiled" in line for line in decision.passed_over)


def test_nothing_fits_is_refused_with_the_numbers_and_the_smallest_hardware() -> None:
    with pytest.raises(NoLayoutFits) as err:
        _decide(_quickstart_gpt(), "5MB")
    text = str(err.value)
    assert "no layout fits GPT L=4 h=128 a=4 V=256 (874,752 parameters)" in text
    assert "does not fit in 5.0 MB" in text
    assert "Nearest:" in text and "needs" in text
    assert "Smallest hardware that fits:" in text
    assert "--planner.gpu_memory (now 5MB)" in text
    assert "activation_checkpointing" not in text.split("Fix:")[1]  # already auto: not offered as a fix


def test_a_model_of_any_class_is_counted_and_the_hooks_it_lacks_pass_layouts_over() -> None:
    class Plain(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))

    with torch.device("meta"):
        module = Plain()
    spec, how = model_spec_from_module(module)
    assert spec.n_params == 256 * 1024 + 1024 + 1024 * 256 + 256
    assert spec.largest_layer_params == 256 * 1024 + 1024 and spec.shape is None
    assert "counted; no GPT shape" in how
    decision = plan_for_module(module, accelerator="cpu", devices=2, options={"gpu_memory": "100MB",
                                                                              "select": "guide"})
    assert decision.strategy_name == "lp_ddp"
    assert "Activations are not counted: the module has no GPT shape" in decision.text()
    for size, hook in (("tensor_parallel_size", "tensor_parallel_plan"), ("pipeline_parallel_size", "pipeline_layers")):
        candidate = next(c for c in decision.plan.candidates if getattr(c.layout, size) > 1)
        why = _runnable(replace(candidate, fits=True, why_not=""), module, PlannerOptions())
        assert why == f"Plain does not implement {hook}()"


def test_hardware_is_read_then_overridden() -> None:
    hw, notes = detect_hardware(accelerator="cpu", devices=2, num_nodes=1)
    assert hw.gpus_per_node == 2 and hw.reserved_memory == 0 and hw.intra_node == "nvlink"
    assert hw.gpu_memory == hw.cpu_memory_per_node // 2
    assert any("found" in n for n in notes)
    hw, notes = detect_hardware(accelerator="cpu", devices=8, options=PlannerOptions(
        nodes=2, gpu_memory="8MB", intra_node="pcie", inter_node="slow", reserved_memory="1MB", cpu_memory="1GB"))
    assert (hw.nodes, hw.gpus_per_node, hw.gpu_memory, hw.intra_node, hw.inter_node) == (2, 4, 8_000_000, "pcie",
                                                                                         "slow")
    assert hw.reserved_memory == 1_000_000 and hw.cpu_memory_per_node == 10**9
    hw, _ = detect_hardware(accelerator="cpu", devices=2, options=PlannerOptions(hardware="dgx-a100-80gb"))
    assert hw.gpu_memory == 80 * 2**30 and hw.gpus_per_node == 2  # the profile's memory, the run's devices


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nodes": 3}, "do not split into 3 equal nodes"),
        ({"gpu_memory": "8 parsecs"}, "unknown unit"),
        ({"nvme_path": "/no/such/folder"}, "is not a folder"),
        ({"gpu_mem": "8MB"}, "planner keys ['gpu_mem'] are not known"),
        ({"intra_node": "infiniband"}, "use nvlink (NVLink/NVSwitch) or pcie"),
        ({"optimizer": "lion"}, "optimizer='lion' is not known"),
    ],
)
def test_bad_planner_values_are_refused(options: dict[str, str], message: str) -> None:
    with pytest.raises(LayoutError, match="lp_auto") as err:
        plan_for_module(_quickstart_gpt(), accelerator="cpu", devices=2, options=options)
    assert message in str(err.value)


def test_nvme_folder_must_be_writable(tmp_path: Path) -> None:
    folder = tmp_path / "nvme"
    folder.mkdir()
    hw, notes = detect_hardware(accelerator="cpu", devices=2, options=PlannerOptions(nvme_path=str(folder)))
    assert hw.nvme and any(str(folder) in n for n in notes)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(ValueError, match="is not a folder"):
        detect_hardware(accelerator="cpu", devices=2, options=PlannerOptions(nvme_path=str(not_a_folder)))
    if os.geteuid() != 0:  # root may write anywhere
        folder.chmod(0o500)
        try:
            with pytest.raises(ValueError, match="not writable"):
                detect_hardware(accelerator="cpu", devices=2, options=PlannerOptions(nvme_path=str(folder)))
        finally:
            folder.chmod(0o700)


def test_nvlink_is_read_from_the_topology_matrix() -> None:
    nvlink = """\tGPU0\tGPU1\tCPU Affinity
GPU0\t X \tNV12\t0-63
GPU1\tNV12\t X \t0-63
"""
    pcie = """\tGPU0\tGPU1\tCPU Affinity
GPU0\t X \tPHB\t0-63
GPU1\tPHB\t X \t0-63
"""
    assert nvlink_from_topology(nvlink) is True
    assert nvlink_from_topology(pcie) is False
    assert nvlink_from_topology("No devices were found") is None


def test_parallel_auto_in_a_recipe_means_lp_auto(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  devices: 2\nparallel: auto\n")
    args = auto_parallel_args(["fit", "--config", str(recipe)])
    assert args[-2:] == ["--trainer.strategy", "lp_auto"] and args[2] != str(recipe)
    assert "parallel" not in Path(args[2]).read_text().split("\n", 1)[1]
    assert auto_parallel_args(["fit", "--parallel", "auto"]) == ["fit", "--trainer.strategy", "lp_auto"]
    recipe.write_text("trainer:\n  strategy: lp_ddp\nparallel: auto\n")
    with pytest.raises(LayoutError, match=r"trainer\.strategy is 'lp_ddp'"):
        auto_parallel_args(["fit", "--config", str(recipe)])
    with pytest.raises(LayoutError, match=r"--trainer\.strategy lp_tensor names one"):
        auto_parallel_args(["fit", "--parallel=auto", "--trainer.strategy", "lp_tensor"])


def test_bare_lp_auto_in_a_trainer_says_how_to_plan() -> None:
    with pytest.raises(LayoutError, match="plan_for_module"):
        Trainer(strategy="lp_auto", accelerator="cpu", devices=2, logger=False)


def test_lp_auto_picks_the_fastest_layout_that_fits() -> None:
    """By default lp_auto takes the highest predicted throughput among the runnable layouts that fit (ties within 5 %:
    the guide's order), prints the three fastest with step time and MFU, and names the guide's choice when it differs:
    at 16 MB the guide's order gives a pipeline, the step-time model a faster layout."""
    model = _quickstart_gpt()
    for budget in ("1GB", "16MB"):
        decision = plan_for_module(model, accelerator="cpu", devices=2, precision="32-true", micro_batch_size=16,
                                   seq_len=128, options={"gpu_memory": budget})
        best = max(c.cost.tokens_per_s for c in decision.fastest)
        assert decision.chosen.cost.tokens_per_s >= 0.95 * best
        assert decision.chosen.fits and decision.select == "fastest"
        text = decision.text()
        assert text.count("lp_auto: fastest that fit") == 1
        assert "step" in text and "MFU" in text and "lp_auto:   3. " in text
        guide = decision.guide_choice
        assert guide is not None
        if guide.layout != decision.layout:
            assert "the guide's order for this branch" in text and guide.strategy in text
        else:
            assert "it is also the guide's first choice" in text
    assert decision.guide_choice.strategy == "lp_pipeline"  # type: ignore[union-attr]
    assert decision.chosen.cost.tokens_per_s > decision.guide_choice.cost.tokens_per_s  # type: ignore[union-attr]
    with pytest.raises(LayoutError, match="use fastest or guide"):
        plan_for_module(model, accelerator="cpu", devices=2, options={"gpu_memory": "1GB", "select": "quickest"})


def test_lp_auto_counts_the_whole_gradient_that_accumulation_keeps() -> None:
    """With the Trainer's accumulation (or a fixed global batch), lp_auto plans ZeRO-2/3 with the whole local
    gradient they keep until a step's last batch, and says the global batch it trains on."""
    model = _quickstart_gpt()

    def zero2(decision: Any) -> Any:
        return next(c for c in decision.plan.candidates if c.layout.zero == 2 and c.layout.offload_device == "none"
                    and c.layout.data_parallel_size == 2 and c.layout.activation_checkpointing == "full")

    plain = _decide(model, "1GB")
    twice = plan_for_module(model, accelerator="cpu", devices=2, precision="32-true", micro_batch_size=16,
                            seq_len=128, options={"gpu_memory": "1GB", "select": "guide"}, accumulate_grad_batches=2)
    fixed = plan_for_module(model, accelerator="cpu", devices=2, precision="32-true", micro_batch_size=16,
                            seq_len=128, options={"gpu_memory": "1GB", "select": "guide"}, global_batch_size=128)
    assert 2 * zero2(plain).memory.grads == zero2(twice).memory.grads == zero2(fixed).memory.grads
    assert "global batch = batch x dp x accumulation = 16 x 2 x 2" in twice.text()
    assert "global batch 128 = batch x dp x accumulation = 16 x 2 x 4" in fixed.text()
    assert "global batch = batch x dp = 16 x 2 (" in plain.text()
    # a global batch that dp replicas cannot split into whole batches: those layouts are passed over, as the run
    # would refuse them (48 = 16 x 3: one replica accumulating 3 batches trains it, two cannot)
    odd = plan_for_module(model, accelerator="cpu", devices=2, precision="32-true", micro_batch_size=16,
                          seq_len=128, options={"gpu_memory": "1GB", "select": "guide"}, global_batch_size=48)
    assert odd.layout.data_parallel_size == 1
    refused = next(c for c in odd.plan.candidates if c.layout.data_parallel_size == 2)
    assert not refused.fits and "48 is not a multiple of batch x dp = 16 x 2 = 32 (48 % 32 = 16)" in refused.why_not
