"""``lightning-parallel plan``: estimate memory for every layout, recommend one, optionally write its recipe.

On several nodes the table has an ``order`` column (each layout's mesh order) and the recommendation is followed by
the bytes each axis moves between nodes per step in both orders (``dp-pp-tp``, ``pp-dp-tp``), the chosen one marked.

Examples::

    lightning-parallel plan --params 7.5e9 --nodes 8 --gpus-per-node 8 --gpu-memory 32GB
    lightning-parallel plan --model gpt3-13b --gpus-per-node 8 --gpu-memory 24GB --intra-node pcie
    lightning-parallel plan --model gpt3-175b --hardware dgx-a100-80gb --nodes 16 --inter-node slow --json
    lightning-parallel plan --calibrate                    # measure this machine (2 ranks), cache the rates
    lightning-parallel plan --layers 2 --hidden 64 --heads 4 --vocab 256 --seq-len 64 --gpus-per-node 2 \\
        --gpu-memory 4GB --hardware cpu-2proc --precision fp32 --write-recipe recipes/planned.yaml
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from typing import Any

from lightning_parallel.planner.hardware import Hardware, list_profiles, load_profile, make_hardware
from lightning_parallel.planner.model import MODEL_PRESETS, ModelShape, ModelSpec, load_recipe
from lightning_parallel.planner.plan import make_plan
from lightning_parallel.planner.rates import Rates
from lightning_parallel.planner.recipe_writer import write_recipe
from lightning_parallel.planner.report import format_plan, plan_json
from lightning_parallel.planner.settings import TrainingSettings
from lightning_parallel.planner.units import parse_count

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-parallel plan",
        description="Estimate per-device memory of every parallel layout and recommend one by the decision guide.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::", 1)[1] if __doc__ else None,
    )
    model = parser.add_argument_group("model (one of --params, --model, --layers/--hidden/--heads, --recipe)")
    model.add_argument("--params", help="total parameters, e.g. 7.5e9, 7.5B, 125M")
    model.add_argument("--largest-layer-params", help="parameters of the largest single layer, e.g. 6.4e8")
    model.add_argument("--model", choices=sorted(MODEL_PRESETS), help="a named GPT shape")
    model.add_argument("--layers", type=int, help="GPT n_layer")
    model.add_argument("--hidden", type=int, help="GPT n_embd")
    model.add_argument("--heads", type=int, help="GPT n_head")
    model.add_argument("--vocab", type=int, default=None, help="GPT vocab_size (default 50304)")
    model.add_argument("--block-size", type=int, default=None, help="GPT block_size (default: --seq-len or 2048)")
    model.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)
    model.add_argument("--recipe", help="read the model (and batch, precision) from a recipe YAML")
    hw = parser.add_argument_group("hardware (a --hardware profile, overridden by the flags)")
    hw.add_argument("--hardware", help=f"profile name or YAML path; profiles: {', '.join(list_profiles()) or 'none'}")
    hw.add_argument("--nodes", type=int)
    hw.add_argument("--gpus-per-node", type=int)
    hw.add_argument("--gpu-memory", help="memory per device, e.g. 32GB (1e9 bytes) or 80GiB (2^30 bytes)")
    hw.add_argument("--intra-node", choices=["nvlink", "pcie"])
    hw.add_argument("--inter-node", choices=["fast", "slow"])
    hw.add_argument("--cpu-memory", help="host memory per node, e.g. 512GB")
    hw.add_argument("--nvme", action=argparse.BooleanOptionalAction, default=None, help="a local NVMe disk")
    hw.add_argument("--reserved-memory", help="memory per device the runtime takes before training (CUDA context, "
                    "workspaces); default min(1GiB, 5%% of --gpu-memory), 0 on CPU")
    hw.add_argument("--accelerator", choices=["gpu", "cpu", "auto"], help="trainer.accelerator of the recipe")
    tr = parser.add_argument_group("training")
    tr.add_argument("--precision", default=None, help="bf16-mixed (default), fp16-mixed or fp32")
    tr.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd-momentum", "sgd"])
    tr.add_argument("--micro-batch-size", type=int, default=None, help="sequences per device per micro-batch")
    tr.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: block size)")
    tr.add_argument(
        "--activation-checkpointing",
        default="auto",
        choices=["auto", "none", "selective", "full"],
        help="auto (default) tries none, selective and full for every layout",
    )
    tr.add_argument("--micro-batches", type=int, default=None, help="pipeline micro-batches (default 4 x stages)")
    tr.add_argument("--accumulate-grad-batches", type=int, default=None,
                    help="batches accumulated per optimizer step (default: the recipe's trainer value, else 1); "
                         "ZeRO-2/3 then keep the whole gradient until the step's last batch")
    tr.add_argument("--global-batch-size", type=int, default=None,
                    help="samples per optimizer step whatever the layout (the recipe's parallel.global_batch_size): "
                         "each layout accumulates global / (batch x dp) batches")
    cal = parser.add_argument_group("calibration (the rates the step-time model runs on)")
    cal.add_argument("--calibrate", action="store_true", help="measure this machine (matmul by shape and dtype, "
                     "memory bandwidth, the four collectives over --calibrate-ranks processes, host overhead), cache "
                     "the result, and plan with it; alone: calibrate and print the rates")
    cal.add_argument("--calibrate-ranks", type=int, default=None,
                     help="processes the collectives are measured over (default: the GPUs here, 2 on CPU)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    out.add_argument("--top", type=int, default=12, help="candidates in the table (0 = all)")
    out.add_argument("--write-recipe", metavar="PATH", help="write a recipe YAML of the recommended layout")
    out.add_argument("--max-steps", type=int, default=None,
                     help="trainer.max_steps of the written recipe (default: the --recipe's, else 20)")
    return parser


def _model(args: argparse.Namespace) -> tuple[ModelSpec, dict[str, Any]]:
    largest = (
        parse_count(args.largest_layer_params, name="--largest-layer-params") if args.largest_layer_params else None
    )
    given = [
        name
        for name, on in (
            ("--params", args.params),
            ("--model", args.model),
            ("--recipe", args.recipe),
            ("--layers/--hidden/--heads", any(v is not None for v in (args.layers, args.hidden, args.heads))),
        )
        if on
    ]
    if len(given) != 1:
        raise ValueError(
            f"give exactly one model description, got {given or 'none'}: --params 7.5e9, --model NAME "
            f"({', '.join(sorted(MODEL_PRESETS))}), --layers L --hidden H --heads A, or --recipe PATH."
        )
    if args.params:
        return ModelSpec.from_params(parse_count(args.params, name="--params"), largest_layer_params=largest), {}
    if args.recipe:
        shape, hints = load_recipe(args.recipe)
        return ModelSpec.from_shape(shape, largest_layer_params=largest, name=f"recipe {args.recipe}"), hints
    if args.model:
        shape = MODEL_PRESETS[args.model]
        return ModelSpec.from_shape(_override_shape(shape, args), largest_layer_params=largest, name=args.model), {}
    if args.layers is None or args.hidden is None or args.heads is None:
        raise ValueError(
            "a GPT shape needs all of --layers, --hidden and --heads (e.g. --layers 12 --hidden 768 --heads 12)."
        )
    block = _first_given(args.block_size, args.seq_len, 2048)
    shape = ModelShape(
        n_layer=args.layers,
        n_embd=args.hidden,
        n_head=args.heads,
        vocab_size=_first_given(args.vocab, 50304),
        block_size=block,
        tie_embeddings=bool(args.tie_embeddings),
    )
    return ModelSpec.from_shape(shape, largest_layer_params=largest), {}


def _override_shape(shape: ModelShape, args: argparse.Namespace) -> ModelShape:
    changes: dict[str, Any] = {}
    if args.vocab is not None:
        changes["vocab_size"] = args.vocab
    if args.block_size is not None:
        changes["block_size"] = args.block_size
    if args.tie_embeddings is not None:
        changes["tie_embeddings"] = args.tie_embeddings
    return ModelShape(**{**vars(shape), **changes})


def _hardware(args: argparse.Namespace, hints: dict[str, Any] | None = None) -> tuple[Hardware, str | None]:
    """The hardware to plan for, and a note when it was not given but found on this machine for a recipe's trainer
    section (``--recipe`` without ``--hardware``/``--gpu-memory``)."""
    flags = {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "gpu_memory": args.gpu_memory,
        "intra_node": args.intra_node,
        "inter_node": args.inter_node,
        "cpu_memory_per_node": args.cpu_memory,
        "nvme": args.nvme,
        "reserved_memory": args.reserved_memory,
        "accelerator": args.accelerator,
    }
    if args.hardware:
        return load_profile(args.hardware, **flags), None
    trainer = (hints or {}).get("trainer")
    if args.gpu_memory is None and trainer is not None:
        from lightning_parallel.planner.detect import detect_hardware

        accelerator = trainer.get("accelerator", "auto")
        devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1)
        found, _ = detect_hardware(accelerator=accelerator if args.accelerator is None else args.accelerator,
                                   devices=devices, num_nodes=int(nodes or 1))
        values = {**{f: getattr(found, f) for f in ("gpus_per_node", "nodes", "gpu_memory", "intra_node",
                                                     "inter_node", "cpu_memory_per_node", "nvme",
                                                     "reserved_memory", "peak_tflops", "accelerator")},
                  **{k: v for k, v in flags.items() if v is not None}}
        note = (f"Hardware found on this machine for the recipe's trainer section (accelerator {accelerator}, "
                f"devices {devices} x num_nodes {nodes}); give --hardware or --gpu-memory to plan for another.")
        return make_hardware(**values), note
    if args.gpu_memory is None:
        raise ValueError(
            "give --gpu-memory (e.g. 32GB or 80GiB) or a --hardware profile "
            f"({', '.join(list_profiles()) or 'none found'}), or a --recipe whose trainer section says the devices."
        )
    return make_hardware(**flags), None


def _training(args: argparse.Namespace, hints: dict[str, Any]) -> TrainingSettings:
    training = _settings(args, hints)
    g, b = training.global_batch_size, training._replica_batch(1)
    if g is not None and g % b:
        source = "--micro-batch-size" if args.micro_batch_size is not None else (
            "the recipe's data batch" if hints.get("batch_per_replica") else "--micro-batch-size (default 1)")
        smaller = max(d for d in range(1, b + 1) if g % d == 0)
        raise ValueError(
            f"--global-batch-size {g} is not a multiple of the batch each replica reads ({b}, {source}): {g} % {b} = "
            f"{g % b}, so no layout can train it (every layout needs global = batch x dp x accumulation). Fix: "
            f"--global-batch-size {g + b - g % b} (a multiple of {b}), or --micro-batch-size {smaller}.")
    return training


def _settings(args: argparse.Namespace, hints: dict[str, Any]) -> TrainingSettings:
    return TrainingSettings(
        precision=args.precision or hints.get("precision", "bf16-mixed"),
        optimizer=args.optimizer,
        micro_batch_size=_first_given(args.micro_batch_size, hints.get("batch_per_replica"), 1),
        # a recipe's data batch is per dp rank and step, and a pipeline splits it (as lp_auto plans it); a given
        # --micro-batch-size is the micro-batch itself
        batch_per_replica=hints.get("batch_per_replica") if args.micro_batch_size is None else None,
        seq_len=_first_given(args.seq_len, hints.get("seq_len")),
        activation_checkpointing=args.activation_checkpointing,
        num_micro_batches=args.micro_batches,
        accumulate_grad_batches=_first_given(args.accumulate_grad_batches, hints.get("accumulate_grad_batches"), 1),
        global_batch_size=_first_given(args.global_batch_size, hints.get("global_batch_size")),
    )


def _first_given(*values: Any) -> Any:
    """The first value that is not None (``0`` counts as given: it is refused, not read as "the default")."""
    return next((v for v in values if v is not None), None)


_AT_LEAST = {"layers": 1, "hidden": 1, "heads": 1, "vocab": 1, "block_size": 1, "nodes": 1, "gpus_per_node": 1,
             "micro_batch_size": 1, "seq_len": 1, "micro_batches": 1, "max_steps": 1, "top": 0,
             "accumulate_grad_batches": 1, "global_batch_size": 1}
"""The integer options and their smallest value: a value below it is refused (``0`` never means "the default")."""


def _check_counts(args: argparse.Namespace) -> None:
    for key, least in _AT_LEAST.items():
        value = getattr(args, key)
        if value is not None and value < least:
            flag = "--" + key.replace("_", "-")
            what = "0 = all candidates" if key == "top" else "leave the option out for the default"
            raise ValueError(f"{flag}={value} must be at least {least} ({what}).")


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--params -7e9`` as ``--params=-7e9``: argparse would read the value as an option and say only "expected
    one argument"; joined, the value reaches its own check ("must be at least 1")."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if (arg.startswith("--") and "=" not in arg and i + 1 < len(argv) and argv[i + 1].startswith("-")
                and argv[i + 1][1:2].isdigit()):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def _calibrate(args: argparse.Namespace) -> Rates:
    """``--calibrate``: measure, cache, print the rates."""
    import torch

    from lightning_parallel.planner.calibrate import calibrate, format_rates

    ranks = args.calibrate_ranks or (max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 2)
    rates = calibrate(ranks=ranks, progress=lambda line: print(f"calibrate: {line}", flush=True))
    print(format_rates(rates), flush=True)
    return rates


def main(argv: list[str] | None = None) -> int:
    """Run ``lightning-parallel plan ARGS``; returns 0, or 2 after printing what to fix."""
    argv = _join_negative_values(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    rates = None
    if args.calibrate:
        rates = _calibrate(args)
        if not any((args.params, args.model, args.recipe, args.layers, args.hidden, args.heads)):
            return 0
    try:
        _check_counts(args)
        model, hints = _model(args)
        hardware, note = _hardware(args, hints)
        if rates is not None and hardware.rates is None:
            hardware = replace(hardware, rates=rates)
        training = _training(args, hints)
        block = model.shape.block_size if model.shape is not None else None
        if block is not None and training.seq_len is not None and training.seq_len > block:
            raise ValueError(
                f"--seq-len {training.seq_len} exceeds the model's block_size {block} (its positions): fit refuses "
                f"such sequences. Fix: --seq-len {block} or less, or --block-size {training.seq_len}.")
        plan = make_plan(model, training, hardware)
        if args.write_recipe:
            command = shlex.join(["lightning-parallel", "plan", *argv])
            write_recipe(plan, args.write_recipe, command=command, max_steps=args.max_steps,
                         accelerator=args.accelerator, base=hints.get("recipe"))
    except ValueError as err:
        print(f"lightning-parallel plan: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_json(plan), indent=2))
    else:
        if note:
            print(note)
        print(format_plan(plan, top=args.top))
        if args.write_recipe:
            print(
                f"\nRecipe written to {args.write_recipe}; run it with: lightning-parallel fit --config "
                f"{args.write_recipe}"
            )
    return 0 if plan.recommended is not None else 1  # no layout fits: the plan (nearest, fixes) printed, not a success
