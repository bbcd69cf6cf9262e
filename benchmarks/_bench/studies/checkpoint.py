"""``--study checkpoint``: step time with a checkpoint every 10 steps written in the background (``async``), written in
the step (``sync``), and without checkpoints (``none``), measured in one run. Writes ``checkpoint.md`` and
``checkpoint.json``.

    python benchmarks/bench.py --study checkpoint            # 2 CPU ranks, three formats, 3 interleaved repetitions
    python benchmarks/bench.py --study checkpoint --quick    # a smaller GPT, one format (one file)
    python benchmarks/bench.py --study checkpoint --layers 8 --hidden 512   # a larger checkpoint
    python benchmarks/bench.py --study checkpoint --device cuda              # on the GPUs (NCCL + a gloo group)

Each run is a Lightning fit (ranks forked from this process) of the GPT with AdamW on fixed tokens: ``--warmup``
steps, then the timed window of ``--steps`` steps (a multiple of 10, at least 20), then ``--steps-after`` 5 more so
that the last background save overlaps training as the others do; a
:class:`~lightning_parallel.callbacks.PeriodicCheckpoint` saves every 10 steps (``async_save`` True or False; none
for ``none``) into a temporary folder (``keep=1``). Step time: rank 0's time from one step's start to the next,
averaged over the window -- the mean, not the median, because the saves are 1 step in 10. Repetitions are
interleaved (rep 1: none, async, sync; rep 2: async, sync, none; ...); each ratio is the median over repetitions of
the ratio of the same repetition. On a machine whose load changes from one run to the next (other jobs on the cores)
the runs' own speeds differ more than the saves' cost, so the table also gives each run's mean step over its own
median step (what the saves and the background writer add to that run's typical step, insensitive to how fast the
machine was during it), compared across variants the same way. Columns: mean step, the ratios ``async / none``,
``sync / none`` and ``async / sync`` of the means and of the mean-over-median, the time a save held the step
(``async``: the collectives and the copy to host memory; ``sync``: all of it), the background part's own duration,
and the checkpoint's size.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

EVERY = 10
PRESETS: dict[str, dict[str, Any]] = {
    "default": dict(layers=4, hidden=512, seq=32, batch=8, warmup=5, steps=40, reps=3),
    "quick": dict(layers=2, hidden=128, seq=64, batch=8, warmup=3, steps=20, reps=3),
    "large": dict(layers=24, hidden=2048, seq=512, batch=8, warmup=3, steps=40, reps=3),
}
VARIANTS = ("none", "async", "sync")
AFTER = 5


def _formats(device: str) -> dict[str, Any]:
    from lightning_parallel.strategies import LPDDPStrategy, LPPipelineStrategy, LPShardedStrategy

    method = "fork"  # this process never initializes CUDA
    return {
        "one file (lp_ddp)": lambda: LPDDPStrategy(start_method=method),
        "lp_sharded folder (ZeRO-1)": lambda: LPShardedStrategy({"zero_stage": 1}, checkpoint="sharded",
                                                                start_method=method),
        "DCP folder (lp_pipeline pp2)": lambda: LPPipelineStrategy(
            {"pipeline_parallel_size": 2, "num_micro_batches": 2}, start_method=method),
    }


def _run(a: argparse.Namespace, make: Any, variant: str, out: Path, ckpt: Path) -> dict[str, Any]:
    """One fit; rank 0 writes its step starts and the saver's timings to ``out``."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_parallel.callbacks import PeriodicCheckpoint
    from lightning_parallel.models import GPT

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            if trainer.global_rank != 0:
                return
            saver = next((c for c in trainer.callbacks if isinstance(c, PeriodicCheckpoint)), None)
            size = 0
            if saver is not None:
                saver.writer.wait()  # the last save complete: measure the newest checkpoint alone
                newest = saver.complete_checkpoints(trainer)[-1]
                size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file()) if newest.is_dir() \
                    else newest.stat().st_size
            out.write_text(json.dumps({
                "starts": self.starts, "bytes": size,
                "waits": saver.step_waits if saver else [],
                "background": saver.writer.durations if saver else []}))

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(1234)
            total = a.batch * (a.warmup + a.steps + AFTER + 1)
            tokens = torch.randint(0, 256, (total, a.seq + 1), generator=g)
            data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
            kwargs = self.trainer.strategy.distributed_sampler_kwargs or {}
            dp = int(kwargs.get("num_replicas", 1))
            sampler = DistributedSampler(data, shuffle=False, **kwargs) if dp > 1 else None
            return DataLoader(data, batch_size=a.batch // dp, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = GPT(n_layer=a.layers, n_head=4, n_embd=a.hidden, block_size=a.seq, vocab_size=256, warmup_steps=0,
                min_lr_ratio=1.0)
    callbacks: list[Any] = [Clock()]
    if variant != "none":
        callbacks.append(PeriodicCheckpoint(ckpt, every_n_steps=EVERY, keep=1, async_save=variant == "async",
                                            save_on_train_end=False))
    trainer = pl.Trainer(accelerator=a.device, devices=2, strategy=make(), max_steps=a.warmup + a.steps + AFTER,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=callbacks)
    trainer.fit(model, datamodule=Data())
    result: dict[str, Any] = json.loads(out.read_text())
    starts = result["starts"][a.warmup:a.warmup + a.steps + 1]
    result["mean_step_s"] = (starts[-1] - starts[0]) / a.steps
    result["median_step_s"] = statistics.median(b - a_ for a_, b in itertools.pairwise(starts))
    result["over_median"] = result["mean_step_s"] / result["median_step_s"]
    return result


def run(a: argparse.Namespace, folder: Path, header: str) -> int:
    from lightning_parallel.testing import resume_matrix

    resume_matrix.quiet()
    if a.steps < 2 * EVERY or a.steps % EVERY:
        print(f"--study checkpoint: --steps {a.steps} must be a multiple of {EVERY}, at least {2 * EVERY}.")
        return 2
    formats = _formats(a.device)
    names = list(formats)[:1] if a.quick else list(formats)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {n: {v: [] for v in VARIANTS} for n in names}
    with tempfile.TemporaryDirectory(prefix="lp_ckpt_study_") as tmp:
        for rep in range(a.reps):
            for name in names:
                order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
                for variant in order:
                    run_dir = Path(tmp) / f"{rep}_{len(results[name][variant])}_{variant}_{names.index(name)}"
                    run_dir.mkdir()
                    r = _run(a, formats[name], variant, run_dir / "rank0.json", run_dir / "ckpt")
                    results[name][variant].append(r)
                    print(f"[bench] checkpoint: rep {rep + 1}/{a.reps} {name} {variant}: mean step "
                          f"{r['mean_step_s'] * 1e3:.1f} ms", flush=True)
    lines = [
        f"GPT {a.layers} x {a.hidden}, sequence {a.seq}, global batch {a.batch}, AdamW, 2 ranks ({a.device}); a "
        f"checkpoint every {EVERY} steps; mean step over {a.steps} steps after {a.warmup} of warm-up; "
        f"{a.reps} interleaved repetitions (ratios: median of the per-repetition ratios, range in brackets).",
        "",
        "| format | mean step ms: none / async / sync | async / none | sync / none | async / sync | each run's mean "
        "over its median step: none / async / sync | the same: async / none, sync / none, async / sync | save held "
        "the step, async / sync (ms) | background part (ms) | checkpoint MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    records = []
    for name in names:
        by = results[name]
        step = {v: statistics.median(r["mean_step_s"] for r in by[v]) for v in VARIANTS}

        def ratio(x: str, y: str, key: str = "mean_step_s",
                  by: dict[str, list[dict[str, Any]]] = by) -> tuple[float, float, float]:
            values = [rx[key] / ry[key] for rx, ry in zip(by[x], by[y], strict=True)]
            return statistics.median(values), min(values), max(values)

        waits = {v: statistics.median(w for r in by[v] for w in r["waits"]) for v in ("async", "sync")}
        background = [d for r in by["async"] for d in r["background"]]
        size = max(r["bytes"] for r in by["sync"])  # the newest checkpoint of a run
        rs = {key: ratio(*key.split("/")) for key in ("async/none", "sync/none", "async/sync")}
        own = {key: ratio(*key.split("/"), key="over_median") for key in ("async/none", "sync/none", "async/sync")}
        over = {v: statistics.median(r["over_median"] for r in by[v]) for v in VARIANTS}

        def fmt(r: tuple[float, float, float]) -> str:
            return f"{r[0]:.3f} [{r[1]:.3f}-{r[2]:.3f}]"

        lines.append(
            f"| {name} | {step['none'] * 1e3:.1f} / {step['async'] * 1e3:.1f} / {step['sync'] * 1e3:.1f} | "
            f"{fmt(rs['async/none'])} | {fmt(rs['sync/none'])} | {fmt(rs['async/sync'])} | "
            f"{over['none']:.3f} / {over['async']:.3f} / {over['sync']:.3f} | "
            f"{own['async/none'][0]:.3f}, {own['sync/none'][0]:.3f}, {own['async/sync'][0]:.3f} | "
            f"{waits['async'] * 1e3:.0f} / {waits['sync'] * 1e3:.0f} | "
            f"{statistics.median(background) * 1e3 if background else 0:.0f} | {size / 2**20:.1f} |")
        records.append({"format": name, "step_s": step, "ratios": rs, "over_median": over, "own_ratios": own,
                        "held_step_s": waits,
                        "background_s": background, "checkpoint_bytes": size,
                        "runs": {v: [{k: r[k] for k in ("mean_step_s", "median_step_s", "waits", "background", "bytes")}
                                     for r in by[v]] for v in VARIANTS}})
    text = f"{header}\n\n" + "\n".join(lines) + "\n"
    print(text)
    (folder / "checkpoint.md").write_text(text)
    (folder / "checkpoint.json").write_text(json.dumps({"header": header, "rows": records}, indent=1))
    print(f"[bench] wrote {folder / 'checkpoint.md'}, {folder / 'checkpoint.json'}")
    return 0
