"""``--study offload``: per-rank bytes of parameters, gradients and optimizer state on the device vs the host, next to
the formulas, and step time relative to no offload, for the reference GPT at a few sizes (2 gloo ranks on CPU).
Writes ``offload.md`` and ``offload.json``.

    python benchmarks/bench.py --study offload                   # the table on 2 CPU ranks, three GPT sizes
    python benchmarks/bench.py --study offload --quick           # the smallest size only
    python benchmarks/bench.py --study offload --layers 4 --hidden 256   # one size
    python benchmarks/bench.py --study offload --device cuda     # one CUDA GPU: the largest GPT that trains,
                                                                 # with and without offload

Measured from the engine's structures (``lightning_parallel.parallel.offload.accounting``), after 3 optimizer steps,
fp32 training (DeepSpeed keeps an fp32 master partition even then: 4 + 4 + (4 + 8) bytes per parameter of weight,
gradient and master + Adam moments). Formula columns: the project's ZeRO / ZeRO-Offload model
(``planner.memory.model_states`` with those byte counts: device = params + grads + optimizer left on the device,
host = (K + 4) Psi / N_d, + p Psi / N_d at stage 3) and DeepSpeed's estimator (``estimate_zero{2,3}_model_states_
mem_needs``: mixed precision, 2-byte weights, host figure with its 1.5 buffer factor) for reference. On CPU, "device"
and "host" are the same memory: tensors are classified by the role DeepSpeed gives them, and the step-time ratio
measures CPU Adam + the partition copies against torch AdamW on the same cores, not a PCIe transfer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.models import GPT
from lightning_parallel.parallel.offload import OffloadEngineConfig, build_engine, ensure_ops, required_ops
from lightning_parallel.parallel.offload.accounting import engine_state_bytes
from lightning_parallel.planner.memory import model_states
from lightning_parallel.planner.settings import StateBytes
from lightning_parallel.testing.distributed import run_distributed

SIZES = [(2, 64), (4, 128), (4, 256)]  # (n_layer, n_embd); --layers or --hidden: that one size
PRESETS: dict[str, dict[str, Any]] = {}
LAYOUTS = [(2, "none"), (2, "cpu"), (3, "none"), (3, "cpu")]
FP32_DEEPSPEED = StateBytes(param=4, grad=4, optimizer=12)
STEPS, BATCH, BLOCK = 3, 4, 64


def _config(stage: int, offload: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": offload}}
    if stage == 3:
        zero["offload_param"] = {"device": offload}
        zero["stage3_param_persistence_threshold"] = 0  # partition everything: the formulas assume it
    cfg = OffloadEngineConfig.from_dict({"zero_optimization": zero}).to_deepspeed()
    for key in ("offload_optimizer", "offload_param"):
        if cfg["zero_optimization"].get(key, {}).get("device") == "none":
            cfg["zero_optimization"].pop(key)
    cfg.update(train_micro_batch_size_per_gpu=BATCH, gradient_accumulation_steps=1)
    return cfg


def _worker(rank: int, world: int, n_layer: int, n_embd: int) -> list[dict[str, Any]]:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rows = []
    for stage, offload in LAYOUTS:
        torch.manual_seed(0)
        model = GPT(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=BLOCK, vocab_size=256)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, _, _ = build_engine(model, config=_config(stage, offload), optimizer=optimizer)
        data = torch.randint(0, 256, (BATCH, BLOCK + 1), generator=torch.Generator().manual_seed(rank))
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            loss = model.pipeline_loss(engine(data[:, :-1]), data[:, 1:])
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
        rows.append({"stage": stage, "offload": offload, "bytes": engine_state_bytes(engine),
                     "step_s": min(times[1:])})
        del engine
    return rows


def _formula(n_params: int, stage: int, offload: str, world: int) -> tuple[int, int]:
    states = model_states(n_params, FP32_DEEPSPEED, dp=world, zero_stage=stage, offload=offload)
    return states.device, states.host


def _deepspeed_estimate(n_params: int, largest: int, stage: int, offload: str, world: int) -> tuple[int, int]:
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(n_params, world, 1, cpu_offload=offload != "none")
    else:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu = estimate_zero3_model_states_mem_needs(n_params, largest, world, 1, cpu_offload=offload != "none",
                                                         cpu_offload_params=offload != "none")[:2]
    return int(gpu), int(cpu)


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table(sizes: list[tuple[int, int]], world: int = 2) -> tuple[str, list[dict[str, Any]]]:
    """The markdown table and its records, one per size and layout."""
    ensure_ops(required_ops(accelerator="cpu", offload_optimizer="cpu", offload_param="none"))
    records: list[dict[str, Any]] = []
    lines = [
        "| GPT (layers x width) | params | ZeRO | offload | device MB: P / G / O = total | host MB: P / G / O = total "
        "| formula device / host MB | DeepSpeed estimator device / host MB (mixed prec.) | step time vs no offload |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n_layer, n_embd in sizes:
        model = GPT(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=BLOCK, vocab_size=256)
        n_params = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() for p in model.parameters())
        rows = run_distributed(_worker, world, n_layer, n_embd, timeout_s=900)[0]
        base = {r["stage"]: r["step_s"] for r in rows if r["offload"] == "none"}
        for r in rows:
            dev, host = r["bytes"]["device"], r["bytes"]["host"]
            f_dev, f_host = _formula(n_params, r["stage"], r["offload"], world)
            e_dev, e_host = _deepspeed_estimate(n_params, largest, r["stage"], r["offload"], world)
            lines.append(
                f"| {n_layer} x {n_embd} | {n_params / 1e6:.2f}M | {r['stage']} | {r['offload']} | "
                f"{_mb(dev['params'])} / {_mb(dev['grads'])} / {_mb(dev['optimizer'])} = {_mb(sum(dev.values()))} | "
                f"{_mb(host['params'])} / {_mb(host['grads'])} / {_mb(host['optimizer'])} = {_mb(sum(host.values()))}"
                f" | {_mb(f_dev)} / {_mb(f_host)} | {_mb(e_dev)} / {_mb(e_host)} | "
                f"{r['step_s'] / base[r['stage']]:.2f}x ({r['step_s'] * 1e3:.0f} ms) |"
            )
            records.append({"layers": n_layer, "hidden": n_embd, "params": n_params, **r, "formula_device": f_dev,
                            "formula_host": f_host, "deepspeed_device": e_dev, "deepspeed_host": e_host,
                            "vs_no_offload": r["step_s"] / base[r["stage"]]})
    return "\n".join(lines), records


def largest_on_gpu() -> str:
    """Grow the GPT's width until a training step runs out of memory on one CUDA GPU, with and without offload."""
    if not torch.cuda.is_available():
        return "no CUDA device: --largest needs one GPU."
    import os

    import deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29512", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed()
    out = []
    for stage, offload in ((2, "none"), (2, "cpu"), (3, "cpu")):
        best = None
        for n_embd in (1024, 2048, 3072, 4096, 6144, 8192, 12288):
            model = GPT(n_layer=24, n_head=16, n_embd=n_embd, block_size=512, vocab_size=50304).cuda()
            try:
                cfg = _config(stage, offload)
                engine, _, _ = build_engine(model, config=cfg, optimizer=torch.optim.AdamW(model.parameters()))
                data = torch.randint(0, 50304, (1, 513), device="cuda")
                engine.backward(model.pipeline_loss(engine(data[:, :-1]), data[:, 1:]))
                engine.step()
                best = (n_embd, sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()))
            except torch.cuda.OutOfMemoryError:
                break
            finally:
                del model
                torch.cuda.empty_cache()
        out.append(f"ZeRO-{stage} offload={offload}: largest 24-layer GPT that trains: "
                   f"{'none' if best is None else f'n_embd={best[0]}, {best[1] / 1e9:.2f}B params'}")
    return "\n".join(out)


def run(a: argparse.Namespace, folder: Path, header: str) -> int:
    """CPU: the table (``offload.md``, ``offload.json``); ``--device cuda``: the largest GPT on one GPU."""
    torch.set_num_threads(a.threads)
    if a.device == "cuda":
        text, records = largest_on_gpu(), []
    else:
        given = set(a.given) & {"layers", "hidden"}
        sizes = [(a.layers, a.hidden)] if given else SIZES[:1] if a.quick else SIZES
        text, records = table(sizes)
    text = f"{header}\n\n{text}\n"
    print(text)
    (folder / "offload.md").write_text(text)
    (folder / "offload.json").write_text(json.dumps({"header": header, "device": a.device, "rows": records},
                                                    indent=1))
    print(f"[bench] wrote {folder / 'offload.md'}, {folder / 'offload.json'}")
    return 0
