"""``--study recompute``: the bytes one training step keeps for backward, measured, under ``activation_checkpointing``
none / selective / full, next to the planner's prediction, for the reference GPT at a few sizes (CPU, fp32, one
process).

    python benchmarks/bench.py --study recompute            # the tables (recompute.md)
    python benchmarks/bench.py --study recompute --quick    # the smallest size only
    python benchmarks/bench.py --study recompute --time     # + step time vs none (on a quiet machine)
    python benchmarks/bench.py --study recompute --layers 4 --hidden 256 --heads 8 --seq 256 --batch 4   # one size

Measured: :func:`lightning_parallel.parallel.activation_checkpointing.saved_activation_bytes` -- the distinct
storages autograd saves for backward during one forward (``torch.autograd.graph.saved_tensors_hooks``), parameters
excluded, plus the inputs checkpointed submodules hold for their recompute; per block (a middle one) and for the
whole step (embedding, blocks, head, loss). As an independent check, the process's resident memory grows by the
"RSS" column during that forward (glibc's mmap threshold pinned at 64 KiB, so large tensors are returned to the OS
when freed); it agrees with the saved-tensor count to a fraction of a percent. With ``--time``, "step" is the forward
+ backward time (best of 5, the three modes interleaved, 1 thread) relative to ``none``, the price of the recompute;
it means something only on an otherwise idle machine.

Predicted: ``planner.activations.layer_activation_bytes`` (per block) and ``activation_bytes`` (whole step),
``element_bytes=4`` and ``dropout`` as the model has it. The formula is Korthikanti et al.'s, for CUDA kernels that
keep attention probabilities; three CPU facts move the measurement away from it, and the "CPU formula" column puts
them in (it matches the measurement exactly):

* A dropout mask is kept as an fp32 scaling tensor on CPU (``at::dropout`` has no fused kernel there:
  ``input * bernoulli_noise``), 4 bytes per element instead of the 1-byte mask of CUDA's ``native_dropout``: each of
  the two masks of a block costs ``e`` instead of 1 (``16 e + 2 e`` per ``s b h`` rather than ``16 e + 2``), and the
  attention-core term is ``(2 e + e) a s^2 b`` rather than ``(2 e + 1) a s^2 b``.
* Without dropout, CPU ``scaled_dot_product_attention`` runs a fused (flash) kernel that keeps no ``s^2`` tensor,
  only a log-sum-exp per query and head (``4 a s b``): the ``5 a s / h`` term of ``none`` is absent, ``none`` measures
  the same as ``selective``, and the ratio to the planner's ``none`` is below 1. With dropout it falls back to the
  math kernel, which keeps the softmax output, the mask and the dropped-out probabilities (the ``s^2`` term above).
  On CUDA the flash / memory-efficient kernels keep no ``s^2`` tensor with dropout either (not measured here: no
  GPU), so there ``selective`` saves little over ``none`` for this GPT.
* Each LayerNorm keeps its mean and reciprocal std in fp32 (``2 x 4 s b`` per norm, ``16 s b`` per block), which the
  paper neglects; under ``full`` a block keeps exactly its input, ``e s b h``, as predicted.

The whole-step figures add the embedding (token ids and positions as int64 on top of the dropout mask; under
``full`` the embedding and the head are not recomputed, as the planner assumes), the head (final LayerNorm input and
``lm_head`` input, ``2 e s b h``) and the loss (the fp32 log-softmax of the logits, ``4 s b V``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.config import ParallelConfig
from lightning_parallel.models import GPT
from lightning_parallel.parallel.activation_checkpointing import apply_activation_checkpointing, saved_activation_bytes
from lightning_parallel.planner.activations import activation_bytes, layer_activation_bytes
from lightning_parallel.planner.model import ModelShape, ModelSpec
from lightning_parallel.planner.settings import TrainingSettings

# (n_layer, n_embd, n_head, seq_len, micro_batch); any of --layers, --hidden, --heads, --seq, --batch: that one size
SIZES = [(4, 128, 4, 128, 4), (4, 256, 8, 256, 4), (2, 512, 8, 512, 2)]
VOCAB = 256
PRESETS: dict[str, dict[str, Any]] = {}
MODES = ("none", "selective", "full")
E = 4  # fp32


NOTES = """
Where measured/planner is not 1 (see the module docstring): on CPU a dropout mask is an fp32 tensor (4 bytes per
element, the planner's CUDA figure is 1); without dropout CPU SDPA is a fused kernel that keeps no s^2 tensor, so
`none` keeps what `selective` keeps (ratio < 1); LayerNorm statistics add 16 s b per block. The "CPU formula" puts
exactly these in and equals the measurement. Under `full` a block keeps exactly its input (e s b h) as predicted;
the whole-step excess under `full` is the embedding's fp32 mask (4 s b h vs 1) and int64 token ids. The planner is
left as is: it predicts CUDA training, whose dropout masks are 1 byte (not measured here: no GPU).
"""


def _pin_mmap_threshold() -> bool:
    """Large allocations straight from mmap (and back on free), so that RSS follows the live tensors."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fused_attention(n_head: int, s: int, b: int, h: int, dropout: float) -> bool:
    """Whether CPU SDPA picks a fused kernel (no s^2 tensors kept) for these shapes."""
    q = torch.empty(b, n_head, s, h // n_head)
    try:
        return int(torch._fused_sdp_choice(q, q, q, dropout_p=dropout, is_causal=True)) != 0
    except (AttributeError, RuntimeError):
        return dropout == 0.0


def cpu_formula(mode: str, *, s: int, b: int, h: int, a: int, dropout: bool, fused: bool) -> int:
    """Korthikanti's per-layer count with the CPU facts of the docstring put in (fp32 masks, fused attention without
    dropout, LayerNorm statistics)."""
    if mode == "full":
        return E * s * b * h
    mask = E if dropout else 0
    total = (16 * E + 2 * mask) * s * b * h + 2 * 2 * 4 * s * b
    if mode == "none":
        total += 4 * a * s * b if fused else (2 * E + mask) * a * s * s * b
    return total


def _step(model: GPT, x: torch.Tensor, y: torch.Tensor) -> float:
    start = time.perf_counter()
    model.pipeline_loss(model(x), y).backward()
    return time.perf_counter() - start


def measure(n_layer: int, h: int, a: int, s: int, b: int, dropout: float, *, rss: bool,
            timing: bool, vocab: int = VOCAB) -> dict[str, dict[str, Any]]:
    """For each mode: the saved-tensor count (whole step and per layer), the RSS growth and the best step time
    (the three modes' steps interleaved, so that load from other processes hits them alike)."""
    models = {}
    for mode in MODES:
        torch.manual_seed(0)
        models[mode] = GPT(n_layer=n_layer, n_head=a, n_embd=h, block_size=s, vocab_size=vocab, dropout=dropout)
        apply_activation_checkpointing(models[mode], mode)
        models[mode].train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(6 if timing else 0):
        for mode in MODES:
            times[mode].append(_step(models[mode], x, y))
    results = {}
    kept: dict[str, torch.Tensor] = {}
    for mode, model in models.items():
        layers = dict(zip(["embed", *(f"blocks.{k}" for k in model.blocks), "head"], model.pipeline_layers(),
                          strict=True))

        def forward(model: GPT = model) -> torch.Tensor:
            return kept.setdefault("loss", model.pipeline_loss(model(x), y))

        saved = saved_activation_bytes(model, forward, layers=layers)
        kept["loss"].backward()
        kept.clear()
        grown = None
        if rss:
            gc.collect()
            before = _rss()
            loss = model.pipeline_loss(model(x), y)
            grown = _rss() - before
            del loss
        results[mode] = {"saved": saved, "block": saved[f"blocks.{n_layer // 2}"], "rss": grown,
                         "time": min(times[mode][1:], default=0.0)}
    return results


def _sizes(args: argparse.Namespace) -> list[tuple[int, int, int, int, int]]:
    if set(args.given) & {"layers", "hidden", "heads", "seq", "batch"}:
        return [(args.layers, args.hidden, args.heads, args.seq, args.batch)]
    return SIZES[:1] if args.quick else SIZES


def run(args: argparse.Namespace, folder: Path, header: str) -> int:
    """The two tables (per block, whole step) into ``recompute.md``, every figure into ``recompute.json``."""
    torch.set_num_threads(args.threads)
    rss = _pin_mmap_threshold() and Path("/proc/self/statm").exists()
    per_block, whole = [], []
    records: list[dict[str, Any]] = []
    vocab = args.vocab
    for n_layer, h, a, s, b in _sizes(args):
        for dropout in (0.0, 0.1):
            fused = _fused_attention(a, s, b, h, dropout)
            label = f"L={n_layer} h={h} a={a} s={s} b={b}"
            measured = measure(n_layer, h, a, s, b, dropout, rss=rss, timing=args.time, vocab=vocab)
            base_time = measured["none"]["time"]
            for mode in MODES:
                m = measured[mode]
                planner = layer_activation_bytes(seq_len=s, micro_batch_size=b, hidden=h, heads=a, recompute=mode,
                                                 element_bytes=E, dropout=dropout > 0, flash_attention=fused)
                cpu = cpu_formula(mode, s=s, b=b, h=h, a=a, dropout=dropout > 0, fused=fused)
                per_block.append(
                    f"| {label} | {dropout} | {'fused' if fused else 'math'} | {mode} | {m['block']:,} | {planner:,} "
                    f"| {m['block'] / planner:.3f} | {cpu:,} | {m['block'] / cpu:.4f} |"
                )
                shape = ModelShape(n_layer=n_layer, n_embd=h, n_head=a, vocab_size=vocab, block_size=s,
                                   dropout=dropout)
                training = TrainingSettings(precision="fp32", micro_batch_size=b, seq_len=s,
                                            activation_checkpointing=mode)  # type: ignore[arg-type]
                layout = ParallelConfig(data_parallel_size=1, activation_checkpointing=mode)  # type: ignore[arg-type]
                total = activation_bytes(ModelSpec.from_shape(shape), training, layout)
                saved = m["saved"]
                grown = f"{m['rss']:,}" if m["rss"] is not None else "n/a"
                whole.append(
                    f"| {label} | {dropout} | {mode} | {saved['total']:,} | {total:,} | {saved['total'] / total:.3f} "
                    f"| {grown} | {saved['embed']:,} / {saved['head']:,} / {saved['other']:,} |"
                    + (f" {m['time'] / base_time:.2f}x |" if args.time else "")
                )
                records.append({"layers": n_layer, "hidden": h, "heads": a, "seq": s, "batch": b, "vocab": vocab,
                                "dropout": dropout, "sdpa": "fused" if fused else "math", "mode": mode,
                                "block": m["block"], "block_planner": planner, "block_cpu_formula": cpu,
                                "step": saved, "step_planner": total, "rss_growth": m["rss"],
                                "time_vs_none": m["time"] / base_time if args.time else None})
    text = "\n".join([
        header, "", "Per block (a middle one), bytes kept for backward, fp32:", "",
        "| model | dropout | SDPA kernel | recompute | measured | planner | measured/planner | CPU formula "
        "| measured/CPU formula |",
        "|---|---|---|---|---:|---:|---:|---:|---:|", *per_block, "",
        "Whole step (embedding, blocks, head, loss), bytes kept for backward:", "",
        "| model | dropout | recompute | measured | planner activation_bytes | measured/planner | RSS growth "
        "| embed / head / loss |" + (" step time vs none |" if args.time else ""),
        "|---|---|---|---:|---:|---:|---:|---|" + ("---:|" if args.time else ""), *whole, NOTES,
        f"torch {torch.__version__}, {args.threads} thread(s), RSS check "
        f"{'on' if rss else 'off (not glibc / no /proc)'}.", ""])
    print(text)
    (folder / "recompute.md").write_text(text)
    (folder / "recompute.json").write_text(json.dumps({"header": header, "rows": records}, indent=1))
    print(f"[bench] wrote {folder / 'recompute.md'}, {folder / 'recompute.json'}")
    return 0
