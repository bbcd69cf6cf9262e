"""The precision matrix: ``32-true``, ``bf16-mixed`` and ``bf16-true`` under every strategy, against one device at
the same precision (``16-mixed`` needs CUDA: ``tests/gpu``).

Each cell trains the small GPT :data:`~tests.trainer.token_data.STEPS` AdamW steps (clipping 0.5 by norm,
accumulation over 2 batches) and reports the largest weight difference from the one-device run of that precision,
and the dtype the parameters trained in (rank 0, at the end of the fit): fp32 under ``32-true`` and ``bf16-mixed``
(fp32 weights, bf16 autocast; FSDP2 keeps fp32 shards and all-gathers bf16), bf16 under ``bf16-true``. A combination
a backend cannot honour is refused before any process starts: ``bf16-true`` under ``lp_zero_offload`` (DeepSpeed keeps
fp32 master weights: that is ``bf16-mixed``). Under FSDP2 (``lp_sharded`` ZeRO-3, ``lp_tensor`` zero_stage 3),
``bf16-mixed`` runs FSDP2's ``MixedPrecisionPolicy``: the counted all-gather bytes over ``dp`` are half those of
``32-true``, the reduce-scatter bytes the same (fp32); a pipeline stage sends fp32 under ``bf16-mixed`` (the residual
stream of fp32 weights; bf16 at ZeRO-3, whose FSDP2 policy casts each unit's input), bf16 under ``bf16-true``; tensor
parallelism's all-reduces move 0.75-0.85 of fp32's bytes under ``bf16-mixed`` (16-bit forward, fp32 backward); the
dp-only layouts hold the planner's model-state bytes per rank.
``-s`` prints the table and the bytes.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_parallel.callbacks.model_states import measure_rank_states
from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.planner.memory import layout_state_bytes, model_states
from lightning_parallel.planner.settings import TrainingSettings
from lightning_parallel.strategies import (
    LPDDPStrategy,
    LPDPStrategy,
    LPHybridStrategy,
    LPPipelineStrategy,
    LPShardedStrategy,
    LPTensorStrategy,
)
from lightning_parallel.testing.resume_matrix import _deepspeed_ready
from tests.helpers import max_rel_diff

from .token_data import GLOBAL_BATCH, fit

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
TOL = {"32-true": 1e-5, "bf16-mixed": 1e-2, "bf16-true": 1e-2}
"""Largest weight difference from one device at the same precision. fp32: reduction order only. bf16 (measured
6e-4 to 1e-3): a layout splits and orders its bf16 matmuls and reductions differently; DeepSpeed's module holds a
bf16 copy of its fp32 masters (3.9e-3: one bf16 ulp of a LayerNorm weight near 1)."""
TOL_REL = {"32-true": 1e-5, "bf16-mixed": 5e-2, "bf16-true": 5e-2}
"""Largest per-tensor relative difference ``||w - w_ref|| / ||w_ref||`` (the contract's fp32 tolerance)."""
DTYPE = {"32-true": torch.float32, "bf16-mixed": torch.float32, "bf16-true": torch.bfloat16}
FORK: dict[str, Any] = {"start_method": "fork"}
PP = {"pipeline_parallel_size": 2, "num_micro_batches": 2, "pipeline_schedule": "1f1b"}

STRATEGIES: dict[str, tuple[Callable[[], Any], int, int]] = {  # name: (strategy, devices, dp)
    "lp_dp x2": (lambda: LPDPStrategy(), 2, 1),
    "lp_ddp x2": (lambda: LPDDPStrategy(**FORK), 2, 2),
    "lp_sharded z1 x2": (lambda: LPShardedStrategy({"zero_stage": 1}, **FORK), 2, 2),
    "lp_sharded z2 x2": (lambda: LPShardedStrategy({"zero_stage": 2}, **FORK), 2, 2),
    "lp_sharded z3 x2": (lambda: LPShardedStrategy({"zero_stage": 3}, **FORK), 2, 2),
    "lp_tensor tp2": (lambda: LPTensorStrategy({"tensor_parallel_size": 2}, **FORK), 2, 1),
    "lp_tensor dp2 x tp2 z3": (lambda: LPTensorStrategy({"tensor_parallel_size": 2, "data_parallel_size": 2,
                                                          "zero_stage": 3}, **FORK), 4, 2),
    "lp_pipeline pp2": (lambda: LPPipelineStrategy(PP, **FORK), 2, 1),
    "lp_pipeline pp2 z3": (lambda: LPPipelineStrategy({**PP, "zero_stage": 3}, **FORK), 2, 1),
    "lp_hybrid pp2 x tp2": (lambda: LPHybridStrategy({**PP, "tensor_parallel_size": 2}, **FORK), 4, 1),
}
if _deepspeed_ready():
    from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy

    # offload none: DeepSpeed's ZeRO-2 engine with the module's torch AdamW, so one device's AdamW is the reference
    # (with CPU offload the optimizer is DeepSpeed's CPU Adam, held against its one-device twin in test_zero_offload)
    STRATEGIES["lp_zero_offload x2"] = (lambda: LPZeroOffloadStrategy({"zero_stage": 2, "offload": "none"}, **FORK),
                                        2, 2)
FSDP2 = ("lp_sharded z3 x2", "lp_tensor dp2 x tp2 z3")
PLANNED = {"lp_ddp x2": 0, "lp_sharded z1 x2": 1, "lp_sharded z2 x2": 2, "lp_sharded z3 x2": 3}
"""The dp-only layouts whose model-state bytes per rank are held against the planner's (``planner.memory``) under
``32-true`` and ``bf16-mixed``: fp32 weights and gradients under autocast, so ZeRO-1 keeps ``8 P + 8 P / N`` and ZeRO-2
``4 P + 12 P / N``, not the ZeRO paper's 16-bit weights with an fp32 master."""
TABLE: dict[tuple[str, str], str] = {}


class Report(Callback):
    """Rank 0 writes the parameters' dtypes, (when counted) the bytes per mesh axis and collective, and its model-state
    bytes after the last batch (parameters, gradients, optimizer state, as the planner counts them) with the number
    of parameters."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.states: dict[str, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == 0 and trainer.world_size > 1:
            self.states = measure_rank_states(trainer, pl_module)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        count = getattr(trainer.strategy, "count_communication", None)
        if callable(count) and type(trainer.strategy).__name__ != "LPDPStrategy":
            count()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        counter = getattr(trainer.strategy, "comm_counter", None)
        report = {"dtypes": sorted({str(p.dtype) for p in pl_module.parameters() if p.is_floating_point()}),
                  "bytes": {k: b for k, (_, b) in counter.by_axis_and_kind().items()} if counter is not None else {},
                  "states": self.states, "psi": sum(p.numel() for p in pl_module.parameters())}
        self.path.write_text(json.dumps(report))


def _gpt() -> pl.LightningModule:
    from tests.helpers import tiny_gpt

    return tiny_gpt(bias=False)


def _run(name: str, precision: str, folder: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    make, devices, dp = ("auto", 1, 1) if name == "1 device" else STRATEGIES[name]
    path = folder / f"{''.join(c if c.isalnum() else '_' for c in name)}_{precision}.json"
    kw: dict[str, Any] = {}
    if name == "lp_zero_offload x2":
        # the same global batch per step in one batch per rank: with accumulate_grad_batches=2 the DeepSpeed engine's
        # run differs from one device by 3e-3 (relative) at any precision, a gap of its accumulation, not of precision
        kw = {"batch": GLOBAL_BATCH // dp, "accumulate_grad_batches": 1}
    model, _ = fit(make() if callable(make) else make, devices, dp, model=_gpt(), precision=precision,
                   callbacks=[Report(path)], **kw)
    return model, json.loads(path.read_text())


def _diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sb = b.state_dict()
    return max(float((v.float() - sb[k].float()).abs().max()) for k, v in a.state_dict().items())


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("precision")
    out = {}
    for precision in PRECISIONS:
        model, report = _run("1 device", precision, folder)
        assert report["dtypes"] == [str(DTYPE[precision])], report
        out[precision] = model
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_precision_under_the_strategy_matches_one_device(name: str, references: dict[str, Any],
                                                               tmp_path: Path) -> None:
    counted: dict[str, dict[str, float]] = {}
    for precision in PRECISIONS:
        if name == "lp_zero_offload x2" and precision == "bf16-true":
            make, devices, _ = STRATEGIES[name]
            with pytest.raises(LayoutError, match="cannot run under lp_zero_offload") as err:
                pl.Trainer(accelerator="cpu", devices=devices, strategy=make(), precision=precision)
            TABLE[(name, precision)] = f"refused before spawn: {err.value}"
            assert "Fix: precision='bf16-mixed'" in str(err.value)
            continue
        model, report = _run(name, precision, tmp_path)
        diff, rel = _diff(model, references[precision]), max_rel_diff(model, references[precision])
        dtypes = report["dtypes"]
        TABLE[(name, precision)] = f"{diff:.1e} (rel {rel:.0e}, {'/'.join(d.replace('torch.', '') for d in dtypes)})"
        counted[precision] = report["bytes"]
        expected = [str(DTYPE[precision])]
        if name == "lp_zero_offload x2" and precision == "bf16-mixed":
            expected = ["torch.bfloat16"]  # DeepSpeed's bf16 working copy; its fp32 masters live in the optimizer
        assert dtypes == expected, (name, precision, dtypes)
        assert rel < TOL_REL[precision], (name, precision, rel)
        assert diff < TOL[precision], (name, precision, diff)
        if name in PLANNED and precision != "bf16-true":  # the planner's bytes per rank, as the engine holds them
            psi, measured = report["psi"], report["states"]
            layout = ParallelConfig(data_parallel_size=2, zero_stage=PLANNED[name])
            predicted = model_states(psi, layout_state_bytes(TrainingSettings(precision=precision), layout), dp=2,
                                     zero_stage=PLANNED[name])
            print(f"{name} {precision}: model states on rank 0 measured {measured} against the planner's "
                  f"{predicted}")
            assert measured["params"] == predicted.params and measured["grads"] == predicted.grads
            assert predicted.optimizer <= measured["optimizer"] <= predicted.optimizer + 8 * 64  # + AdamW's steps
    print(f"\n{name}: " + "; ".join(f"{p}: {TABLE[(name, p)]}" for p in PRECISIONS))
    if name.startswith("lp_pipeline pp2"):  # a stage sends the residual stream, as the planner counts it
        # (TrainingSettings.residual_bytes): fp32 under autocast (fp32 weights), bf16 when the weights are 16-bit or
        # FSDP2's bf16 policy casts each unit's input
        sent = {p: counted[p]["pp:send"] for p in PRECISIONS}
        print(f"{name} pp bytes sent per rank, whole fit: {sent}")
        assert sent["bf16-mixed"] == (sent["bf16-true"] if name.endswith("z3") else sent["32-true"])
        assert sent["bf16-true"] == pytest.approx(sent["32-true"] / 2, rel=0.01)
    if name == "lp_tensor tp2":  # forward all-reduces of 16-bit outputs, backward ones of the fp32 residual stream's
        # gradient under autocast: the planner's (2 x 2 + 2 x 4) / (4 x 4) = 0.75 of fp32's bytes (planner/cost.py)
        tp = {p: counted[p]["tp:all_reduce"] for p in PRECISIONS}
        print(f"{name} tp all-reduce bytes per rank, whole fit: {tp}")
        assert 0.75 <= tp["bf16-mixed"] / tp["32-true"] < 0.85
        assert tp["bf16-true"] / tp["32-true"] == pytest.approx(0.5, rel=0.02)
    if name in FSDP2:
        full, mixed = counted["32-true"], counted["bf16-mixed"]
        print(f"{name} bytes per rank, whole fit, 32-true -> bf16-mixed: "
              + ", ".join(f"{k} {full.get(k, 0):.0f} -> {mixed.get(k, 0):.0f}" for k in sorted(full)))
        assert mixed["dp:all_gather"] == pytest.approx(full["dp:all_gather"] / 2, rel=0.01)  # bf16 all-gather
        assert mixed["dp:reduce_scatter"] == pytest.approx(full["dp:reduce_scatter"], rel=0.01)  # fp32 reduce


def test_precisions_deepspeed_cannot_honour_are_refused_before_any_process_starts() -> None:
    if "lp_zero_offload x2" not in STRATEGIES:
        pytest.skip("DeepSpeed or its CPU ops are missing")
    from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy

    with pytest.raises(LayoutError, match=r"precision='bf16-true' cannot run under lp_zero_offload.*"
                                          r"Fix: precision='bf16-mixed' \(what DeepSpeed runs: bf16 forward"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=LPZeroOffloadStrategy(**FORK), precision="bf16-true",
                   logger=False)
    # fp16 on CPUs: DeepSpeed has none (16-mixed failed in every rank's deepspeed.initialize)
    for precision in ("16-true", "16-mixed"):
        with pytest.raises(LayoutError, match=rf"precision='{precision}' on CPUs under lp_zero_offload.*"
                                              r"Fix: precision='bf16-mixed'"):
            pl.Trainer(accelerator="cpu", devices=2, strategy=LPZeroOffloadStrategy(**FORK), precision=precision,
                       logger=False)
    pl.Trainer(accelerator="cpu", devices=2, strategy=LPZeroOffloadStrategy(**FORK), precision="bf16-mixed",
               logger=False)  # what DeepSpeed runs: accepted


def test_zz_the_table() -> None:
    """The matrix as a Markdown table (after the cells above; ``-s`` shows it)."""
    if not TABLE:
        pytest.skip("no cell ran (run the whole file)")
    rows = ["| strategy | " + " | ".join(PRECISIONS) + " |", "|---|" + "---|" * len(PRECISIONS)]
    for name in STRATEGIES:
        rows.append(f"| {name} | " + " | ".join(TABLE.get((name, p), "not run") for p in PRECISIONS) + " |")
    print("\nmax |w - w_one_device| at the same precision (largest per-tensor relative difference, parameter dtype):\n"
          + "\n".join(rows))


def test_64_true_trains_and_returns_float64_weights() -> None:
    """Under ``64-true`` the GPT's loss stayed fp32 (its logits cast down by ``.float()``), and a fork-started fit
    handed the float64 weights back into the calling process's fp32 module, rounding them (Lightning's ``ddp_fork``
    does the same)."""
    from lightning_parallel.models import GPT

    def gpt() -> GPT:
        torch.manual_seed(0)
        return GPT(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, warmup_steps=2, bias=False)

    logits = torch.randn(2, 16, 64, dtype=torch.float64)
    assert gpt().pipeline_loss(logits, torch.zeros(2, 16, dtype=torch.long)).dtype == torch.float64
    reference, _ = fit("auto", 1, 1, model=gpt(), steps=3, precision="64-true")
    model, _ = fit(LPDDPStrategy(start_method="fork"), 2, 2, model=gpt(), steps=3, precision="64-true")
    dtypes = {p.dtype for p in model.parameters()}
    diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    print(f"64-true under lp_ddp x2: the calling process's module {dtypes}, max |w - w_1dev| = {diff:.1e}")
    assert dtypes == {torch.float64} and diff < 1e-12


@pytest.mark.gpu
def test_16_mixed_under_lp_ddp_matches_one_device_on_cuda() -> None:
    """``16-mixed`` (fp16 autocast, gradient scaler) needs CUDA: two GPUs under ``lp_ddp`` against one GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    reference, _ = fit("auto", 1, 1, model=_gpt(), precision="16-mixed", accelerator="gpu")
    model, _ = fit(LPDDPStrategy(start_method="spawn"), 2, 2, model=_gpt(), precision="16-mixed", accelerator="gpu")
    assert max_rel_diff(model.cpu(), reference.cpu()) < TOL_REL["bf16-mixed"]
