"""Benchmark ZeRO stages 0-3 (``lp_ddp`` and ``lp_sharded``'s engine) against the ZeRO formulas.

For world sizes 1, 2, 4 (gloo ranks on this machine) and stages 0 (torch DDP, what ``lp_ddp`` runs), 1, 2 (flat
balanced shards, :class:`~lightning_parallel.parallel.zero.ZeroOptimizer`) and 3 (torch FSDP2): per-rank bytes of
parameters, gradients and optimizer state after a step, next to the ZeRO formula (``docs/formulas.md``, "ZeRO:
model-state memory per device") with fp32 AdamW's byte sizes (P = G = 4, K = 8; see
:mod:`lightning_parallel.parallel.zero.memory`); bytes sent per rank and step by the collectives, next to theory
(2 Psi for stages 0-2, 3 Psi for stage 3, x 4 bytes x (N-1)/N); step time relative to stage 0 (DDP) at the same
world size. Writes ``results.json``, ``table.md`` and ``memory.png`` under ``--out``.

    python scripts/bench_sharded.py --out benchmarks/sharded
"""

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.models import GPT
from lightning_parallel.parallel.zero import (
    CommCounter,
    ZeroOptimizer,
    apply_zero3,
    measure_model_state,
    zero_comm_theory,
    zero_memory_formula,
)
from lightning_parallel.testing.distributed import run_distributed

VOCAB, BLOCK = 256, 64
BATCH, WARMUP, TIMED = 4, 3, 11


def _build(stage: int, world: int, counter: CommCounter) -> tuple[nn.Module, Any, list[Any]]:
    torch.manual_seed(0)
    model: nn.Module = GPT(n_layer=4, n_head=4, n_embd=128, block_size=BLOCK, vocab_size=VOCAB)  # gpt_tiny
    extra: list[Any] = []
    if stage == 0:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)

        def counting_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buf = bucket.buffer()
            counter.record("all_reduce", full_bytes=buf.numel() * buf.element_size(), world_size=world)
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting_hook)
        return ddp, torch.optim.AdamW(model.parameters(), lr=1e-3), extra
    if stage == 3:
        from torch.distributed.device_mesh import init_device_mesh

        apply_zero3(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), extra
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage, counter=counter)
    extra = [s.shard_param.grad for s in zero.shards]
    return model, zero, extra


def _step(model: nn.Module, opt: Any, x: torch.Tensor) -> None:
    logits = model(x)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x.reshape(-1))
    loss.backward()
    opt.step()


def _bench_world(rank: int, world: int, stages: list[int]) -> dict[int, dict[str, Any]]:
    torch.manual_seed(rank)
    x = torch.randint(0, VOCAB, (BATCH, BLOCK))
    out: dict[int, dict[str, Any]] = {}
    for stage in stages:
        counter = CommCounter()
        model, opt, extra = _build(stage, world, counter)
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        for _ in range(WARMUP):
            opt.zero_grad()
            _step(model, opt, x)
        times = []
        for _ in range(TIMED):
            opt.zero_grad()
            counter.reset()
            dist.barrier()
            start = time.perf_counter()
            with counter.patch_torch() if stage == 3 else _null():
                _step(model, opt, x)
            dist.barrier()
            times.append(time.perf_counter() - start)
        mem = measure_model_state(module, opt, extra_grads=extra)
        numel = sum(p.numel() for p in module.parameters())
        out[stage] = {"mem": mem.as_dict(), "comm": counter.total_bytes, "time": sorted(times)[len(times) // 2],
                      "numel": numel}
        del model, opt
    return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def run(worlds: list[int], stages: list[int]) -> list[dict[str, Any]]:
    """Every (world size, stage) point: measured bytes and times (max over ranks) next to theory."""
    rows = []
    for world in worlds:
        by_rank = run_distributed(_bench_world, world, stages, timeout_s=600, collective_timeout_s=300)
        for stage in stages:
            per_rank = [r[stage] for r in by_rank]
            numel = per_rank[0]["numel"]
            total = max(r["mem"]["total"] for r in per_rank)
            formula = zero_memory_formula(stage, numel=numel, world_size=world)
            comm = max(r["comm"] for r in per_rank)
            theory = zero_comm_theory(stage, numel=numel, world_size=world)
            step = max(r["time"] for r in per_rank)
            ddp = max(r[0]["time"] for r in by_rank) if 0 in stages else float("nan")
            rows.append({"world": world, "stage": stage, "numel": numel, "bytes": total, "formula": formula,
                         "mem_ratio": total / formula, "comm": comm, "comm_theory": theory,
                         "comm_ratio": comm / theory if theory else None, "step_s": step, "vs_ddp": step / ddp,
                         "parts": per_rank[0]["mem"]})
            print(f"N={world} stage={stage}: {total} B (formula {formula:.0f}, ratio {total / formula:.4f}), "
                  f"comm {comm:.0f} B (theory {theory:.0f}), step {step * 1e3:.1f} ms", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the README."""
    lines = [
        "| N | stage | params / grads / optim (bytes per rank) | model states per rank | ZeRO formula | ratio "
        "| sent per step | theory | ratio | step time vs lp_ddp |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["parts"]
        comm_ratio = f"{r['comm_ratio']:.4f}" if r["comm_ratio"] is not None else "- (N=1)"
        lines.append(
            f"| {r['world']} | {r['stage']} | {p['params']:,} / {p['grads']:,} / {p['optim']:,} | {r['bytes']:,} "
            f"| {r['formula']:,.0f} | {r['mem_ratio']:.4f} | {r['comm']:,.0f} | {r['comm_theory']:,.0f} "
            f"| {comm_ratio} | {r['vs_ddp']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Per-rank model-state bytes vs world size: measured (markers) and formula (dashed), one colour per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for stage in sorted({r["stage"] for r in rows}):
        pts = [r for r in rows if r["stage"] == stage]
        worlds = [r["world"] for r in pts]
        line = ax.plot(worlds, [r["bytes"] / 2**20 for r in pts], "o-", label=f"stage {stage} measured")[0]
        ax.plot(worlds, [r["formula"] / 2**20 for r in pts], "--", color=line.get_color(), alpha=0.6,
                label=f"stage {stage} formula")
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel("model-state MiB per rank")
    ax.set_xticks(sorted({r["world"] for r in rows}))
    ax.set_title(f"ZeRO per-rank memory, GPT {rows[0]['numel'] / 1e6:.2f}M params, fp32 AdamW")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/sharded", help="folder for results.json, table.md, memory.png")
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes")
    parser.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages (0 = DDP)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run([int(w) for w in args.worlds.split(",")], [int(s) for s in args.stages.split(",")])
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "table.md").write_text(table(rows) + "\n")
    plot(rows, out / "memory.png")
    print(table(rows))


if __name__ == "__main__":
    main()
