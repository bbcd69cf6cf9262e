"""``--study context``: context parallelism's memory, measured: the activation bytes each rank keeps for backward at
cp = 1, 2 and 4 for one fixed sequence, next to their formula, and the longest sequence that trains within a fixed
per-rank activation budget at cp = 1 and cp = 4.

    python benchmarks/bench.py --study context                   # 4 gloo ranks; writes context.md / context.json
    python benchmarks/bench.py --study context --quick           # a shorter fixed sequence, a smaller budget
    python benchmarks/bench.py --study context --seq 2048 --hidden 128 --heads 4 --layers 2 --budget-mib 16

No Lightning: the reference GPT's attention cores are routed to ring attention over a cp group of the 4 forked gloo
ranks (:func:`lightning_parallel.parallel.context_parallel.apply_context_parallel`, what the composition's
``context parallel`` step does), the batch is cut to each rank's head and tail chunks (``split_batch``), and one
training step (forward, backward, AdamW) runs; at cp = 1 each rank runs the one-device model on the whole sequence.

Measured: :func:`lightning_parallel.parallel.activation_checkpointing.saved_activation_bytes` -- the distinct storages
autograd saves during the forward (parameters excluded), per block and for the whole step, on every rank (the
busiest rank is reported; head-tail chunks make them equal). Formula, per block: the "CPU formula" of
``--study recompute`` (fp32, no dropout: CPU SDPA's fused kernel keeps no ``s^2`` tensor, only a log-sum-exp) at
``s / cp`` tokens -- ``16 e (s/cp) b h + 16 (s/cp) b + 4 a (s/cp) b`` -- since ring attention keeps exactly what
that kernel keeps, for this rank's tokens (q, k, v, the output and a log-sum-exp); the planner's
``layer_activation_bytes(..., cp=cp)`` (Korthikanti's count, whose ``cp = 1`` column includes the ``5 a s^2 b``
of kernels that keep the attention probabilities) is shown next to it.

Budget: a step is admitted only if every rank's saved activation bytes (the same count, taken during the forward)
stay within ``--budget-mib`` MiB; the ranks agree by an all-reduce of their maxima after the forward and skip the
backward and the optimizer step when the budget is exceeded, so "trains" means the whole step ran under the budget.
The longest admitted sequence is searched over multiples of 64 tokens (doubling, then bisection) at cp = 1 and
cp = 4; the model states (replicated, the same at every cp) are not part of the budget.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.config import ParallelConfig
from lightning_parallel.models import GPT
from lightning_parallel.parallel.activation_checkpointing import saved_activation_bytes
from lightning_parallel.parallel.context_parallel import (
    SequenceShard,
    apply_context_parallel,
    deactivate,
    split_batch,
)
from lightning_parallel.planner.activations import activation_bytes, layer_activation_bytes
from lightning_parallel.planner.model import ModelShape, ModelSpec
from lightning_parallel.planner.settings import TrainingSettings
from lightning_parallel.testing import run_distributed

from .recompute import cpu_formula

PRESETS: dict[str, dict[str, Any]] = {
    "default": dict(layers=2, hidden=128, heads=4, seq=2048, vocab=256, batch=1),
    "quick": dict(layers=2, hidden=64, heads=4, seq=1024, vocab=256, batch=1),
}
WORLD = 4
CPS = (1, 2, 4)
GRID = 64  # the search's step in tokens: divisible by 2 x cp for cp <= 32
E = 4  # fp32


def _model(a: argparse.Namespace, seq: int) -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=a.layers, n_head=a.heads, n_embd=a.hidden, block_size=seq, vocab_size=a.vocab, dropout=0.0)


def _step(a: argparse.Namespace, seq: int, cp: int, groups: dict[int, Any], budget: int | None) -> dict[str, Any]:
    """One training step of a fresh GPT on ``seq`` tokens over ``cp`` ranks (this rank's share): saved bytes (whole
    step and per layer), and, with ``budget``, whether every rank stayed within it (the step is not finished if
    not)."""
    rank = dist.get_rank()
    model = _model(a, seq)
    g = torch.Generator().manual_seed(seq)
    x = torch.randint(0, a.vocab, (a.batch, seq), generator=g)
    y = torch.randint(0, a.vocab, (a.batch, seq), generator=g)
    if cp > 1:
        group = groups[cp]
        shard = SequenceShard(cp, dist.get_rank(group))
        plan = apply_context_parallel(model, group=group, shard=shard)
        x, y = split_batch((x, y), plan, shard)
    kept: dict[str, torch.Tensor] = {}
    layers = dict(zip(["embed", *(f"blocks.{k}" for k in model.blocks), "head"], model.pipeline_layers(), strict=True))

    def forward() -> torch.Tensor:
        return kept.setdefault("loss", model.pipeline_loss(model(x), y))

    try:
        saved = saved_activation_bytes(model, forward, layers=layers)
        worst = torch.tensor([float(saved["total"])])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank decides alike: no rank waits in a ring alone
        admitted = budget is None or worst.item() <= budget
        if admitted:
            kept["loss"].backward()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            opt.step()
        return {"rank": rank, "saved": saved, "block": saved["blocks.0"], "admitted": admitted,
                "worst": int(worst.item()), "tokens": int(x.shape[1])}
    finally:
        kept.clear()
        deactivate()


def _world(rank: int, world: int, a: argparse.Namespace, budget: int) -> dict[str, Any]:
    torch.set_num_threads(a.threads)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank creates both
    groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    out: dict[str, Any] = {"fixed": {}, "search": {}}
    for cp in CPS:
        out["fixed"][cp] = _step(a, a.seq, cp, groups, None)
    for cp in (1, 4):
        trials: list[tuple[int, bool, int]] = []

        def fits(seq: int, cp: int = cp, trials: list[tuple[int, bool, int]] = trials) -> bool:
            r = _step(a, seq, cp, groups, budget)
            trials.append((seq, bool(r["admitted"]), int(r["worst"])))
            return bool(r["admitted"])

        low, high = 0, GRID
        while fits(high):  # doubling: the first sequence over the budget
            low, high = high, 2 * high
        while high - low > GRID:  # bisection on multiples of GRID
            mid = (low + high) // 2 // GRID * GRID
            if fits(mid):
                low = mid
            else:
                high = mid
        out["search"][cp] = {"longest": low, "first_over": high, "trials": trials}
    return out


def run(args: argparse.Namespace, folder: Path, header: str) -> int:
    budget = int(args.budget_mib * 2**20)
    a = args
    if a.seq % (2 * max(CPS)):
        raise SystemExit(f"--seq {a.seq}: must be a multiple of 2 x cp = {2 * max(CPS)}.")
    results = run_distributed(_world, WORLD, a, budget, timeout_s=a.timeout)
    s, b, h, heads = a.seq, a.batch, a.hidden, a.heads
    shape = ModelShape(n_layer=a.layers, n_embd=h, n_head=heads, vocab_size=a.vocab, block_size=s, dropout=0.0)
    rows, records = [], []
    base = max(results[r]["fixed"][1]["saved"]["total"] for r in range(WORLD))
    for cp in CPS:
        ranks = [results[r]["fixed"][cp] for r in range(WORLD)]
        block = max(r["block"] for r in ranks)
        total = max(r["saved"]["total"] for r in ranks)
        spread = max(r["saved"]["total"] for r in ranks) - min(r["saved"]["total"] for r in ranks)
        formula = cpu_formula("none", s=s // cp, b=b, h=h, a=heads, dropout=False, fused=True)
        planner_block = layer_activation_bytes(seq_len=s, micro_batch_size=b, hidden=h, heads=heads, element_bytes=E,
                                               dropout=False, cp=cp)
        layout = ParallelConfig(data_parallel_size=1, context_parallel_size=cp)
        training = TrainingSettings(precision="fp32", micro_batch_size=b, seq_len=s)
        planner_total = activation_bytes(ModelSpec.from_shape(shape), training, layout)
        rows.append(f"| {cp} | {ranks[0]['tokens']} | {block:,} | {formula:,} | {block / formula:.4f} | "
                    f"{planner_block:,} | {total:,} | {total / base:.4f} | {1 / cp:.4f} | {planner_total:,} | "
                    f"{spread:,} |")
        records.append({"cp": cp, "tokens_per_rank": ranks[0]["tokens"], "block": block, "block_cpu_formula": formula,
                        "block_planner": planner_block, "step": total, "step_vs_cp1": total / base,
                        "step_planner": planner_total, "rank_spread": spread,
                        "per_rank": [r["saved"] for r in ranks]})
    search = results[0]["search"]
    search_rows = []
    for cp in (1, 4):
        info = search[cp]
        search_rows.append(f"| {cp} | {info['longest']:,} | {info['first_over']:,} | "
                           + ", ".join(f"{t[0]}{'' if t[1] else ' (over)'}" for t in info["trials"]) + " |")
    gain = search[4]["longest"] / max(1, search[1]["longest"])
    text = "\n".join([
        header, "",
        f"GPT L={a.layers} h={h} a={heads} V={a.vocab}, micro-batch {b}, fp32, no dropout; ring attention; 4 gloo "
        "ranks (cp = 1: each rank runs the one-device model; cp = 2: ranks {0,1} and {2,3}; cp = 4: all).", "",
        f"Activation bytes one rank keeps for backward, one sequence of {s} tokens:", "",
        "| cp | tokens per rank | per block, measured | CPU formula at s/cp | measured/formula | planner per block "
        "| whole step, measured | step vs cp=1 | 1/cp | planner whole step | spread over ranks |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        f"Longest sequence whose training step stays within {a.budget_mib:g} MiB of saved activations per rank "
        f"(searched in steps of {GRID} tokens):", "",
        "| cp | longest that trains | first over the budget | trials (tokens) |", "|---:|---:|---:|---|",
        *search_rows, "",
        f"cp = 4 trains a {gain:.2f}x longer sequence than cp = 1 within the same per-rank budget.", "",
        f"torch {torch.__version__}, {a.threads} thread(s) per rank.", ""])
    print(text)
    (folder / "context.md").write_text(text)
    (folder / "context.json").write_text(json.dumps({"header": header, "budget_bytes": budget, "rows": records,
                                                     "search": {str(k): v for k, v in search.items()}}, indent=1))
    print(f"[bench] wrote {folder / 'context.md'}, {folder / 'context.json'}")
    return 0
