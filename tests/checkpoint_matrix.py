"""The checkpoint matrix of ``lightning_parallel.checkpoint``: one tiny-GPT fit per strategy and checkpoint kind.

Used by ``tests/trainer/test_checkpoint_api.py`` (``-s`` prints a line per case). Each case trains the tests'
tiny GPT a few steps (fork-started ranks on CPU, 2 devices), validates once at the end, saves with
``trainer.save_checkpoint`` from ``on_train_end`` (every rank calls it, as Lightning requires), then:

* ``full_state_dict(path)`` against the live weights (the main process's module: the fork launchers hand rank 0's
  weights back, full ones under ZeRO-3);
* ``consolidate(path, out)`` + ``GPT.load_from_checkpoint(out)`` on one device against the live weights;
* the validation loss of the distributed run against a one-device ``Trainer.validate`` of the consolidated model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_parallel.checkpoint import consolidate, detect_format, full_state_dict
from lightning_parallel.models import GPT
from tests.helpers import TRAINER_QUIET, SequentialTokens, tiny_gpt

STEPS = 3
PER_RANK_BATCH = 4
VAL_BATCHES = 2


@dataclass(frozen=True)
class Case:
    """One strategy and checkpoint kind. ``make_strategy(workdir)`` builds a fresh strategy; ``needs``: an optional
    dependency (``fairscale``, ``deepspeed``, ``nvme``) without which the case is skipped."""

    name: str
    expected_format: str
    make_strategy: Callable[[Path], Any]
    devices: int = 2
    needs: str = ""


def _sharded(stage: int, checkpoint: str = "full", backend: str = "native") -> Callable[[Path], Any]:
    def make(_: Path) -> Any:
        from lightning_parallel.strategies import LPShardedStrategy

        return LPShardedStrategy({"zero_stage": stage}, backend=backend, checkpoint=checkpoint,  # type: ignore[arg-type]
                                 start_method="fork")
    return make


def _offload(stage: int, offload: str) -> Callable[[Path], Any]:
    def make(workdir: Path) -> Any:
        from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy

        parallel: dict[str, Any] = {"zero_stage": stage, "offload": offload}
        if offload == "nvme":
            parallel["nvme_path"] = str(workdir / "nvme_swap")
        return LPZeroOffloadStrategy(parallel=parallel, start_method="fork")
    return make


CASES: list[Case] = [
    Case("lp_ddp", "lightning", lambda _: "lp_ddp_fork"),
    Case("lp_dp", "lightning", lambda _: "lp_dp"),
    *[Case(f"lp_sharded z{s} native full", "lightning", _sharded(s)) for s in (1, 2, 3)],
    *[Case(f"lp_sharded z{s} native sharded", "lp_sharded", _sharded(s, "sharded")) for s in (1, 2, 3)],
    *[Case(f"lp_sharded z{s} fairscale full", "lightning", _sharded(s, backend="fairscale"), needs="fairscale")
      for s in (1, 2)],
    Case("lp_zero_offload z2 cpu", "deepspeed", _offload(2, "cpu"), needs="deepspeed"),
    Case("lp_zero_offload z3 cpu", "deepspeed", _offload(3, "cpu"), needs="deepspeed"),
    Case("lp_zero_offload z3 nvme", "deepspeed_nvme", _offload(3, "nvme"), needs="nvme"),
]


def skip_reason(case: Case) -> str | None:
    """Why this case cannot run here (a missing optional dependency), or None."""
    if case.needs == "fairscale":
        try:
            from lightning_parallel.parallel.zero import require_fairscale

            require_fairscale()
        except ImportError as err:
            return f"fairscale unavailable: {err}"
    if case.needs in ("deepspeed", "nvme"):
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return "lp_zero_offload needs DeepSpeed: pip install -e '.[deepspeed]'"
    if case.needs == "nvme":
        from lightning_parallel.parallel.offload import libaio_available

        if not libaio_available():
            return "NVMe offload needs libaio (apt-get install libaio-dev)"
    return None


def ensure_deepspeed_ops(nvme: bool) -> None:
    """Build DeepSpeed's C++ ops before the first offload fit (minutes when cold; cached afterwards)."""
    from lightning_parallel.parallel.offload import ensure_ops, required_ops

    ensure_ops(required_ops(accelerator="cpu", offload_optimizer="nvme" if nvme else "cpu", offload_param="none"))


class SaveAtEnd(pl.Callback):
    """``trainer.save_checkpoint(path)`` on every rank when training ends (after the last validation)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


@dataclass(frozen=True)
class CaseResult:
    """What one case measured (differences are max abs over all tensors)."""

    case: Case
    format: str
    tensors: int
    full_vs_live: float
    consolidated_vs_live: float
    live_vs_initial: float
    val_live: float
    val_consolidated: float
    keys_match: bool
    hparams_match: bool
    weights_only_loadable: bool
    summary: str
    seconds: float


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[k].detach().float() - b[k].detach().float()).abs().max()) if a[k].numel() else 0.0 for k in a)


def _batch_size(case: Case) -> int:
    # lp_dp reads the global batch in one process and splits it; the process-based strategies read per rank
    return PER_RANK_BATCH * case.devices if case.name == "lp_dp" else PER_RANK_BATCH


def run_case(case: Case, workdir: Path) -> CaseResult:
    """Fit, save, read back, consolidate, load on one device; see the module docstring."""
    start = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "model.ckpt"
    model = tiny_gpt()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = pl.Trainer(strategy=case.make_strategy(workdir), accelerator="cpu", devices=case.devices,
                         max_steps=STEPS, limit_val_batches=VAL_BATCHES, val_check_interval=STEPS,
                         callbacks=[SaveAtEnd(path)], **TRAINER_QUIET)
    data = SequentialTokens(batch_size=_batch_size(case))
    trainer.fit(model, data)
    val_live = float(trainer.callback_metrics["val_loss"])
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}

    info = detect_format(path)
    state = full_state_dict(path)
    out = workdir / "consolidated.ckpt"
    result = consolidate(path, out)
    weights_only_loadable = isinstance(torch.load(out, map_location="cpu", weights_only=True), dict)
    loaded = GPT.load_from_checkpoint(out, map_location="cpu")
    check = pl.Trainer(accelerator="cpu", devices=1, limit_val_batches=VAL_BATCHES, logger=False,
                       enable_progress_bar=False, enable_model_summary=False)
    val_consolidated = float(check.validate(loaded, datamodule=SequentialTokens(batch_size=_batch_size(case)),
                                            verbose=False)[0]["val_loss"])
    return CaseResult(
        case=case, format=info.format, tensors=len(state), full_vs_live=max_abs_diff(state, live),
        consolidated_vs_live=max_abs_diff(dict(loaded.state_dict()), live),
        live_vs_initial=max_abs_diff(live, initial), val_live=val_live, val_consolidated=val_consolidated,
        keys_match=set(state) == set(live), hparams_match=dict(loaded.hparams) == dict(model.hparams),
        weights_only_loadable=weights_only_loadable, summary=result.summary(),
        seconds=time.perf_counter() - start,
    )
