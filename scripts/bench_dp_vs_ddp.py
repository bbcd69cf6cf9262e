"""DP versus DDP versus one device: the same GPT, the same global batch, the same steps.

    python scripts/bench_dp_vs_ddp.py                              # CPU (or GPUs when present), gpt_tiny
    python scripts/bench_dp_vs_ddp.py --model configs/model/gpt_small.yaml --block-size 256 --devices 4
    python scripts/bench_dp_vs_ddp.py --runs lp_dp,lp_ddp,lp_dp_graph       # + lp_dp with torch-style graph backward

Runs ``one`` (a single device), ``lp_dp`` (one process, N replicas in threads) and ``lp_ddp`` (N processes; forked
on CPU, re-launched on GPUs) each in a fresh Python process, and prints one table: samples/s, the ratio to one
device, the DDP/DP throughput ratio, exchanges, transfers and bytes per step (counted by the engine's
``ExchangeCounter`` for DP and by the exact counting comm hook ``comm_hook="count"`` for DDP), and peak memory (CUDA:
peak allocated on device 0; CPU: peak resident memory of the largest process, which includes ~0.4 GB of Python,
torch and Lightning). A PNG plot is written next to the JSON results.

On CPU a "device" is ``--threads-per-device`` intra-op threads (default 1, one core): the one-device run uses that
many, lp_dp that many per replica thread, lp_ddp that many per rank, so N devices get N times the threads of one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("one", "lp_dp", "lp_ddp", "lp_dp_graph")  # lp_dp_graph: lp_dp with backward="graph" (torch DP's design)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "configs/model/gpt_tiny.yaml"), help="a model config fragment")
    p.add_argument("--n-layer", type=int), p.add_argument("--n-embd", type=int), p.add_argument("--n-head", type=int)
    p.add_argument("--block-size", type=int, help="sequence length (default: the model's block_size)")
    p.add_argument("--batch", type=int, default=16, help="global batch (samples per optimizer step)")
    p.add_argument("--devices", type=int, default=2, help="devices for lp_dp and lp_ddp")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each configuration, interleaved; the fastest counts (less noise from other load)")
    p.add_argument("--accelerator", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--threads-per-device", type=int, default=1,
                   help="CPU: intra-op threads of one 'device' (one-device run, each DP replica, each DDP rank)")
    p.add_argument("--out", default=str(ROOT / "runs/bench_dp_vs_ddp"), help="folder for JSON results and the PNG")
    p.add_argument("--runs", default="one,lp_dp,lp_ddp",
                   help=f"comma-separated configurations out of {','.join(RUNS)}; 'one' is always run (the baseline)")
    p.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.runs = ["one", *[r for r in args.runs.split(",") if r and r != "one"]]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown or "lp_dp" not in args.runs or "lp_ddp" not in args.runs:
        p.error(f"--runs {','.join(args.runs)}: must include lp_dp and lp_ddp, out of {list(RUNS)}.")
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must be divisible by --devices {args.devices} (DDP's per-rank batch).")
    return args


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from omegaconf import OmegaConf

    config: Any = OmegaConf.to_container(OmegaConf.load(args.model))
    kwargs: dict[str, Any] = dict(config["init_args"])
    for key in ("n_layer", "n_embd", "n_head"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    kwargs["warmup_steps"] = 0
    return kwargs


# ---------------------------------------------------------------------------------------------- worker process
def _peak_memory_mb(device: Any) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _timer_callback(args: argparse.Namespace, out: Path) -> Any:
    import lightning.pytorch as pl
    import torch

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.start = 0.0

        def _sync(self, trainer: pl.Trainer) -> None:
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.synchronize(trainer.strategy.root_device)

        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == args.warmup:
                self._sync(trainer)
                self.start = time.perf_counter()
                counter = getattr(trainer.strategy, "exchange_counter", None)
                if counter is not None:
                    counter.reset()  # the strategy steps it after this hook: the timed steps are counted

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._sync(trainer)
            elapsed = time.perf_counter() - self.start
            counter = getattr(trainer.strategy, "exchange_counter", None)
            result = {"run": args.worker, "rank": trainer.global_rank, "elapsed_s": elapsed,
                      "samples_per_s": args.steps * args.batch / elapsed,
                      "peak_mb": _peak_memory_mb(trainer.strategy.root_device),
                      "exchanges": counter.as_dict() if counter is not None else None,
                      "params": sum(p.numel() for p in pl_module.parameters()),
                      "threads": torch.get_num_threads()}
            (out / f"{args.worker}_rank{trainer.global_rank}.json").write_text(json.dumps(result))

    return Timer()


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_parallel import LPDDPStrategy
    from lightning_parallel.models import GPT
    from lightning_parallel.strategies.dp import LPDPStrategy

    out = Path(args.out)
    cuda = args.accelerator == "cuda" or (args.accelerator == "auto" and torch.cuda.is_available())
    kwargs = model_kwargs(args)
    torch.set_num_threads(args.threads_per_device)
    pl.seed_everything(0, verbose=False)
    model = GPT(**kwargs)
    t, v = kwargs["block_size"], kwargs["vocab_size"]
    n_samples = args.batch * (args.steps + args.warmup)
    tokens = torch.randint(0, v, (n_samples, t + 1), generator=torch.Generator().manual_seed(0))
    per_loader = args.batch // args.devices if args.worker == "lp_ddp" else args.batch
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=per_loader, drop_last=True)
    strategy: Any = "auto"
    devices = 1
    if args.worker in ("lp_dp", "lp_dp_graph"):
        backward: Literal["graph", "auto"] = "graph" if args.worker == "lp_dp_graph" else "auto"
        strategy, devices = LPDPStrategy(cpu_threads=args.threads_per_device, backward=backward), args.devices
    elif args.worker == "lp_ddp":
        strategy = LPDDPStrategy(comm_hook="count", start_method="popen" if cuda else "fork")
        devices = args.devices
    trainer = pl.Trainer(accelerator="cuda" if cuda else "cpu", devices=devices, strategy=strategy,
                         max_steps=args.steps + args.warmup, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[_timer_callback(args, out)])
    trainer.fit(model, train_dataloaders=loader)


# ---------------------------------------------------------------------------------------------- parent process
def run_one(run: str, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """One configuration in a fresh Python process; rank 0's result with memory over all its processes."""
    out = Path(args.out)
    for stale in out.glob(f"{run}_rank*.json"):
        stale.unlink()
    load_before = os.getloadavg()[0]  # other work on the machine skews CPU figures: reported with them
    cmd = [sys.executable, __file__, *argv, "--worker", run]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(args.threads_per_device))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob(f"{run}_rank*.json"))]
    if proc.returncode or not ranks:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"the {run} run failed (exit code {proc.returncode})")
    rank0 = next(r for r in ranks if r["rank"] == 0)
    rank0["peak_mb"] = max(r["peak_mb"] for r in ranks)
    rank0["total_mb"] = sum(r["peak_mb"] for r in ranks)
    rank0["processes"] = len(ranks)
    rank0["load_before"] = load_before
    return rank0


def run_all(args: argparse.Namespace, argv: list[str]) -> list[dict[str, Any]]:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    best: dict[str, dict[str, Any]] = {}
    for attempt in range(args.repeats):
        for run in args.runs:
            result = run_one(run, args, argv)
            print(f"  {run} (run {attempt + 1}): {result['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)
            if run not in best or result["samples_per_s"] > best[run]["samples_per_s"]:
                best[run] = result
    results = [best[run] for run in args.runs]
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))
    return results


def parallel_capacity(devices: int) -> float:
    """How much faster ``devices`` threads of 1-thread matmuls run than one: ``devices`` on an idle machine with that
    many free cores; less when other work holds them (then no run below can reach its ideal speed-up either)."""
    import threading

    import torch

    a = torch.randn(512, 512)
    saved = torch.get_num_threads()

    def work() -> None:
        torch.set_num_threads(1)
        for _ in range(40):
            a @ a

    try:
        start = time.perf_counter()
        for _ in range(devices):
            work()
        serial = time.perf_counter() - start
        threads = [threading.Thread(target=work) for _ in range(devices)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return serial / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    base = next(r for r in results if r["run"] == "one")["samples_per_s"]
    rows = ["| run | processes | samples/s | vs one device | exchanges/step | transfers/step | MiB/step | "
            "peak memory (MiB): largest process / all | load avg before |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ex = r["exchanges"] or {"exchanges_per_step": 0, "calls_per_step": 0, "bytes_per_step": 0}
        rows.append(f"| {r['run']} | {r['processes']} | {r['samples_per_s']:.1f} | {r['samples_per_s'] / base:.2f}x | "
                     f"{ex['exchanges_per_step']} | {ex['calls_per_step']:.0f} | {ex['bytes_per_step'] / 2**20:.2f} | "
                     f"{r['peak_mb']:.0f} / {r['total_mb']:.0f} | {r['load_before']:.1f} |")
    dp, ddp = (next(r for r in results if r["run"] == k) for k in ("lp_dp", "lp_ddp"))
    rows.append("")
    rows.append(f"DDP/DP throughput ratio: {ddp['samples_per_s'] / dp['samples_per_s']:.2f}")
    for r in (dp, ddp):
        kinds = r["exchanges"]["kinds"] if r["exchanges"] else {}
        detail = ", ".join(f"{k} {v['bytes_per_step'] / 2**20:.3f} MiB" for k, v in kinds.items())
        rows.append(f"{r['run']} per step: {detail}")
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    from lightning_parallel.parallel.data_parallel import ALLREDUCE_GRADS, DP_KINDS

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["run"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    colors = {"one": "grey", "lp_dp": "tab:orange", "lp_ddp": "tab:blue", "lp_dp_graph": "tab:olive"}
    ax1.bar(names, [r["samples_per_s"] for r in results], color=[colors[n] for n in names])
    ax1.set_ylabel("samples / s")
    ax1.set_title("throughput")
    seen = {k for r in results if r["exchanges"] for k in r["exchanges"]["kinds"]}
    kinds = [k for k in (*DP_KINDS, ALLREDUCE_GRADS) if k in seen]
    bottom = [0.0] * len(results)
    for kind in kinds:
        vals = [(r["exchanges"] or {"kinds": {}})["kinds"].get(kind, {}).get("bytes_per_step", 0) / 2**20
                for r in results]
        ax2.bar(names, vals, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for x, r in enumerate(results):
        count = (r["exchanges"] or {}).get("exchanges_per_step", 0)
        ax2.annotate(f"{count} exchange{'s' * (count != 1)}", (x, bottom[x]), ha="center", va="bottom", fontsize=9)
    ax2.set_ylim(0, max(bottom) * 1.15 or 1.0)
    ax2.set_ylabel("MiB per step")
    ax2.set_title("exchanged bytes per step, by kind")
    ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    import torch

    cuda = args.accelerator == "cuda" or (args.accelerator == "auto" and torch.cuda.is_available())
    kw = model_kwargs(args)
    where = (f"{args.devices} GPUs" if cuda else f"{args.devices} CPU devices of {args.threads_per_device} thread(s), "
             f"{os.cpu_count()} cores")
    title = (f"GPT {kw['n_layer']}x{kw['n_embd']}, seq {kw['block_size']}, global batch {args.batch}, "
             f"{args.steps} steps (best of {args.repeats}), {where}")
    print(f"benchmark: {title}", file=sys.stderr)
    capacity = parallel_capacity(args.devices) if not cuda else float(args.devices)
    results = run_all(args, list(sys.argv[1:] if argv is None else argv))
    capacity = min(capacity, parallel_capacity(args.devices)) if not cuda else capacity
    text = (f"{title} ({results[0]['params'] / 1e6:.2f}M parameters)\n"
            f"machine check: {args.devices} threads of matmuls ran {capacity:.2f}x as fast as one "
            f"(ideal {args.devices}x; lower = other load held the cores)\n\n{table(results, args)}")
    print(text)
    (Path(args.out) / "table.md").write_text(text + "\n")
    png = Path(args.out) / "bench_dp_vs_ddp.png"
    plot(results, png, title)
    print(f"\nplot: {png}")


if __name__ == "__main__":
    main()
