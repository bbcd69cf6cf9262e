"""Tensor parallelism, counted and timed: per-rank parameter bytes, the bytes each step moves over tp (counted at
every collective) next to Megatron's formula, and the step time of tp=2 vs dp=2 vs one process on one global batch.

    python scripts/bench_tensor.py [--layers 4 --hidden 128 --heads 4 --seq 128 --batch 16 --steps 20]

Accounting runs on 2 gloo ranks without Lightning (one forward + backward of one micro-batch, then the step
boundary's settling of the sequence-parallel norm gradients); timing runs the Lightning Trainer (fork-started
ranks, one thread per process: a "device" is one core) and reports the mean step time after warm-up, one run each.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_parallel  # noqa: F401  (registers the strategies)
from lightning_parallel.models import GPT
from lightning_parallel.testing import run_distributed


def _model(a: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=a.layers, n_head=a.heads, n_embd=a.hidden, block_size=a.seq, vocab_size=a.vocab,
               bias=True, warmup_steps=2)


def _param_formula(model: GPT, t: int) -> tuple[int, int]:
    """(bytes per rank the plan predicts, bytes on one device): split weights (and column/vocab biases) / t."""
    plan = model.tensor_parallel_plan()
    split, whole = 0, 0
    for name, p in model.named_parameters():
        owner, leaf = name.rsplit(".", 1)
        style = plan.get(owner)
        nbytes = p.numel() * p.element_size()
        whole += nbytes
        if style in ("column", "vocab") or (style == "row" and leaf == "weight"):
            split += nbytes // t
        else:
            split += nbytes
    return split, whole


def _accounting(rank: int, world: int, a: argparse.Namespace) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_parallel.parallel.tensor import apply_tensor_parallel
    from lightning_parallel.parallel.tensor.comm import TPCommCounter, megatron_tp_bytes
    from lightning_parallel.parallel.tensor.sync import settle_gradients

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    y = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    out: dict[str, Any] = {}
    for sp in (False, True):
        model = _model(a)
        formula_params, one_device = _param_formula(model, world)
        apply_tensor_parallel(model, model.tensor_parallel_plan(), mesh=mesh, sequence_parallel=sp)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                    for p in model.parameters())
        counter = TPCommCounter()
        with loss_parallel(), counter:
            loss = model.pipeline_loss(model(x), y).to_local()
            counter.phase = "backward"
            loss.backward()
            counter.phase = "step"
            settle_gradients(model.parameters())
        loss_stats = 3 * 2 * (world - 1) / world * a.batch * a.seq * 4  # 3 all-reduces of b x s fp32
        counted_fwd = counter.total("forward") - loss_stats
        out[f"sp={sp}"] = {
            "params_local": local, "params_formula": formula_params, "params_one_device": one_device,
            "forward": counted_fwd, "backward": counter.total("backward"), "loss": loss_stats,
            "step": counter.total("step"),
            "calls": {f"{p}/{k}": n for (p, k), n in counter.calls.items()},
            "formula": megatron_tp_bytes(n_layer=a.layers, batch=a.batch, seq=a.seq, hidden=a.hidden, tp=world,
                                         sequence_parallel=sp),
        }
    return out


class _Timer(pl.Callback):
    def __init__(self, warmup: int, path: Path) -> None:
        self.warmup, self.path, self.times = warmup, path, []  # type: ignore[var-annotated]
        self._t = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._t)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps({"step_s": sum(self.times) / len(self.times), "n": len(self.times)}))


class _Data(pl.LightningDataModule):
    def __init__(self, a: argparse.Namespace, per_rank: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        data = torch.randint(0, a.vocab, ((a.steps + a.warmup + 2) * a.batch, a.seq + 1), generator=g)
        self.dataset, self.per_rank = TensorDataset(data[:, :-1], data[:, 1:]), per_rank

    def train_dataloader(self) -> DataLoader:
        trainer: Any = self.trainer
        kwargs = trainer.strategy.distributed_sampler_kwargs if trainer.world_size > 1 else None
        sampler = DistributedSampler(self.dataset, shuffle=False, **kwargs) if kwargs else None
        return DataLoader(self.dataset, batch_size=self.per_rank, sampler=sampler)


def _time(a: argparse.Namespace, name: str, strategy: Any, devices: int, dp: int) -> float:
    path = Path(tempfile.mkdtemp()) / f"{name}.json"
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=a.steps + a.warmup,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[_Timer(a.warmup, path)])
    trainer.fit(_model(a), datamodule=_Data(a, a.batch // dp))
    return float(json.loads(path.read_text())["step_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/tensor")
    a = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    acc = run_distributed(_accounting, 2, a, timeout_s=600)[0]
    psi = sum(p.numel() for p in _model(a).parameters())
    print(f"GPT {a.layers} x {a.hidden} ({psi:,} parameters), vocab {a.vocab}, b={a.batch}, s={a.seq}, fp32, tp=2\n")
    print("| sequence parallel | parameter bytes per rank (measured / formula / one device) | tp bytes sent per "
          "micro-batch, forward: counted / formula | backward: counted / formula | loss statistics | step boundary "
          "(SP norm grads) | collectives counted |")
    print("|---|---|---|---|---|---|---|")
    for sp in (False, True):
        r = acc[f"sp={sp}"]
        f = r["formula"]
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["calls"].items()))
        print(f"| {sp} | {r['params_local']:,} / {r['params_formula']:,} / {r['params_one_device']:,} | "
              f"{r['forward']:,.0f} / {f['forward']:,.0f} | {r['backward']:,.0f} / {f['backward']:,.0f} | "
              f"{r['loss']:,.0f} | {r['step']:,.0f} | {calls} |")
    from lightning_parallel.strategies import LPDDPStrategy, LPTensorStrategy

    runs = [("one process", "auto", 1, 1), ("lp_ddp dp=2", LPDDPStrategy(start_method="fork"), 2, 2),
            ("lp_tensor tp=2", LPTensorStrategy({"tensor_parallel_size": 2}, start_method="fork"), 2, 1),
            ("lp_tensor tp=2 + SP", LPTensorStrategy({"tensor_parallel_size": 2, "sequence_parallel": True},
                                                     start_method="fork"), 2, 1)]
    times = {name: _time(a, name.replace(" ", "_"), strategy, devices, dp) for name, strategy, devices, dp in runs}
    base = times["one process"]
    print(f"\nstep time, global batch {a.batch}, mean of {a.steps} steps after {a.warmup} warm-up, one run each\n")
    print("| run | processes | step time (ms) | vs one process |")
    print("|---|---|---|---|")
    for name, _, devices, _ in runs:
        print(f"| {name} | {devices} | {1000 * times[name]:.1f} | {base / times[name]:.2f}x |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(a), "accounting": acc, "step_s": times}, indent=1))


if __name__ == "__main__":
    main()
