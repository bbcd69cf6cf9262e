"""``parallel.compile`` under every strategy against one device (the Hugging Face tiny Llama: its decoder layers are
the blocks compiled), and modules the user compiled themselves (no ``_orig_mod.`` in checkpoints or plan keys).

Compiling is slow on CPU (a C++ compiler per graph). The per-strategy checks use the ``aot_eager`` backend: the
same graph capture (dynamo) and the same compiled autograd (AOTAutograd) as inductor, without generating kernels,
so what the composition does to a compiled block is tested in seconds; inductor itself (the default,
``compile: true``) runs in the ``slow`` test on the data-parallel, pipeline and hybrid paths. Ranks compile in
process (``TORCHINDUCTOR_COMPILE_THREADS=1``): no compile workers on 2 cores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

pytest.importorskip("transformers", reason="the compile tests train the Hugging Face tiny Llama")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from lightning_parallel.hf import HFCausalLM
from lightning_parallel.strategies import (
    LPDDPStrategy,
    LPHybridStrategy,
    LPPipelineStrategy,
    LPShardedStrategy,
    LPTensorStrategy,
)
from tests.trainer.test_hf import TOL, llama
from tests.trainer.token_data import fit, weight_diff


class CompiledProbe(pl.Callback):
    """Each rank writes, at the end of fit, which submodules it compiled and how many graphs dynamo made."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch._dynamo.utils import counters

        from lightning_parallel.parallel.compile import compiled_modules

        probe = {"compiled": compiled_modules(pl_module), "graphs": int(counters["stats"]["unique_graphs"])}
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(probe))


def _probes(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


@pytest.fixture(scope="module")
def reference() -> HFCausalLM:
    return fit("auto", 1, 1, model=llama())[0]


def _strategy(name: str, compile: Any) -> tuple[Any, int, int]:
    """``(strategy, devices, dp)`` of each strategy's case."""
    on = {"compile": compile}
    if name == "lp_ddp":
        return LPDDPStrategy(on, start_method="fork"), 2, 2
    if name.startswith("lp_sharded"):
        return LPShardedStrategy({**on, "zero_stage": int(name[-1])}, start_method="fork"), 2, 2
    if name == "lp_tensor":
        return LPTensorStrategy({**on, "tensor_parallel_size": 2}, start_method="fork"), 2, 1
    if name == "lp_pipeline":
        layout = {**on, "pipeline_parallel_size": 2, "num_micro_batches": 2}
        return LPPipelineStrategy(layout, start_method="fork"), 2, 1
    if name == "lp_hybrid":
        return LPHybridStrategy({**on, "pipeline_parallel_size": 2, "tensor_parallel_size": 2, "num_micro_batches": 2,
                                 "activation_checkpointing": "full"}, start_method="fork"), 4, 1
    raise ValueError(name)


@pytest.mark.parametrize("name", ["lp_ddp", "lp_sharded1", "lp_sharded3", "lp_tensor", "lp_pipeline", "lp_hybrid"])
def test_compiled_blocks_equal_one_device(reference: HFCausalLM, name: str, tmp_path: Path) -> None:
    strategy, devices, dp = _strategy(name, "aot_eager")
    model, _ = fit(strategy, devices, dp, model=llama(), callbacks=[CompiledProbe(tmp_path)])
    diff = weight_diff(model, reference)
    probes = _probes(tmp_path)
    print(f"HFCausalLM {name} compile=aot_eager: max |w - w_1dev (eager)| = {diff:.2e}; compiled per rank: "
          f"{[p['compiled'] for p in probes]}, dynamo graphs {[p['graphs'] for p in probes]}")
    assert len(probes) == devices and all(p["compiled"] and p["graphs"] >= 1 for p in probes)
    assert sorted({c for p in probes for c in p["compiled"]}) == ["model.model.layers.0", "model.model.layers.1"]
    assert diff < TOL


def test_gpt_plan_with_sequence_norms_compiled_equals_one_device() -> None:
    """The library's GPT under lp_tensor tp2: its plan's ``sequence`` norms hand their output to the column linears
    through a custom autograd function (one all-reduce of the gradient in backward, or a reduce-scatter under
    sequence parallelism); compiled blocks keep it exact (it runs eagerly between the compiled pieces)."""
    from tests.trainer.test_hybrid import _gpt

    ref, _ = fit("auto", 1, 1, model=_gpt())
    diffs = {}
    for sp in (False, True):
        layout = {"tensor_parallel_size": 2, "sequence_parallel": sp, "compile": "aot_eager"}
        model, _ = fit(LPTensorStrategy(layout, start_method="fork"), 2, 1, model=_gpt())
        diffs[sp] = weight_diff(model, ref)
        print(f"GPT lp_tensor tp2 sequence_parallel={sp} compile=aot_eager: max |w - w_1dev| = {diffs[sp]:.2e}")
    assert max(diffs.values()) < TOL, diffs


def test_zero_offload_compiled_equals_one_device() -> None:
    pytest.importorskip("deepspeed")
    from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy

    ref, _ = fit("auto", 1, 1, model=llama(), batch=8, accumulate_grad_batches=1)
    model, _ = fit(LPZeroOffloadStrategy({"compile": "aot_eager"}, start_method="fork"), 2, 2, model=llama(),
                   batch=4, accumulate_grad_batches=1)
    diff = weight_diff(model, ref)
    print(f"HFCausalLM lp_zero_offload compile=aot_eager: max |w - w_1dev (eager)| = {diff:.2e}")
    assert diff < TOL


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a cold inductor cache compiles every graph on 2 cores: minutes
def test_inductor_equals_one_device(reference: HFCausalLM) -> None:
    """compile: true (inductor, C++ kernels): its fused kernels round differently from eager, a few 1e-6."""
    diffs = {}
    for name in ("lp_ddp", "lp_pipeline", "lp_hybrid"):
        strategy, devices, dp = _strategy(name, True)
        model, _ = fit(strategy, devices, dp, model=llama())
        diffs[name] = weight_diff(model, reference)
        print(f"HFCausalLM {name} compile=true (inductor): max |w - w_1dev (eager)| = {diffs[name]:.2e}")
    assert max(diffs.values()) < TOL, diffs


def _user_compiled() -> HFCausalLM:
    model = llama()
    model.model = torch.compile(model.model, backend="aot_eager")  # type: ignore[assignment]
    return model


def test_user_compiled_model_under_zero3_saves_plain_names(reference: HFCausalLM, tmp_path: Path) -> None:
    """The user's torch.compile(self.model) under ZeRO-3: trains, saves (before: KeyError 'model.model.embed_tokens.
    weight' in zero3_full_optimizer_state) and the checkpoint's names are the plain model's; equals one device."""
    callback = ModelCheckpoint(dirpath=tmp_path, filename="z3", every_n_train_steps=10)
    strategy, devices, dp = _strategy("lp_sharded3", False)
    model, _ = fit(strategy, devices, dp, model=_user_compiled(), enable_checkpointing=True, callbacks=[callback])
    diff = weight_diff(model, reference)
    print(f"HFCausalLM(torch.compile(model)) lp_sharded3: max |w - w_1dev| = {diff:.2e}")
    plain_names = sorted(llama().state_dict())
    assert sorted(model.state_dict()) == plain_names and diff < TOL
    saved = torch.load(tmp_path / "z3.ckpt", map_location="cpu", weights_only=False)
    assert sorted(saved["state_dict"]) == plain_names
    loaded = HFCausalLM.load_from_checkpoint(tmp_path / "z3.ckpt", map_location="cpu")
    assert weight_diff(loaded, model) == 0.0


@pytest.mark.slow
def test_user_compiled_model_finds_its_plan_keys_under_tensor_and_hybrid(reference: HFCausalLM) -> None:
    """lp_tensor and lp_hybrid with the user's torch.compile(self.model): the plan's keys match (before: refused,
    'model._orig_mod.model.embed_tokens'), and each equals one device."""
    diffs = {}
    for name, (strategy, devices, dp) in (
        ("lp_tensor", _strategy("lp_tensor", False)),
        ("lp_hybrid", (LPHybridStrategy({"pipeline_parallel_size": 2, "tensor_parallel_size": 2,
                                         "num_micro_batches": 2}, start_method="fork"), 4, 1)),
    ):
        model, _ = fit(strategy, devices, dp, model=_user_compiled())
        diffs[name] = weight_diff(model, reference)
        assert sorted(model.state_dict()) == sorted(llama().state_dict()), name
        print(f"HFCausalLM(torch.compile(model)) {name}: max |w - w_1dev| = {diffs[name]:.2e}")
    assert max(diffs.values()) < TOL, diffs
