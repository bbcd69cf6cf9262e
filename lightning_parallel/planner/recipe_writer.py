"""Writing the planner's recommended layout as a recipe that ``lightning-parallel fit --config`` runs
(``lightning-parallel plan --write-recipe PATH``).

The ``parallel`` section holds the sizes, ``zero_stage`` and ``offload`` always, other keys when they differ from
their defaults, and ``mesh_order`` always on several nodes (the order the plan's cross-node bytes were counted in,
written even when it is the default ``dp-pp-tp`` so that the recipe says which axis crosses nodes); a header comment
gives the bytes each order moves between nodes per step.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import yaml

from lightning_parallel.config import SCHEDULES, ParallelConfig, check_model_compat
from lightning_parallel.parallel.dims import MESH_AXES
from lightning_parallel.parallel.pipeline.partition import bubble_fraction
from lightning_parallel.planner.plan import Plan
from lightning_parallel.planner.units import format_bytes

__all__ = ["recipe_dict", "recipe_text", "write_recipe"]

_PARALLEL_ALWAYS = ("data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size", "zero_stage", "offload")


def _parallel_section(layout: ParallelConfig, *, multi_node: bool = False) -> dict[str, Any]:
    """The layout's keys: :data:`_PARALLEL_ALWAYS`, ``mesh_order`` on several nodes, the rest when not default."""
    defaults = ParallelConfig().to_dict()
    values = layout.to_dict()
    always = (*_PARALLEL_ALWAYS, "mesh_order") if multi_node else _PARALLEL_ALWAYS
    return {k: v for k, v in values.items() if k in always or v != defaults[k]}


_PLANNED = frozenset({"data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size", "sequence_parallel",
                      "num_micro_batches", "context_parallel_size", "zero_stage", "offload", "nvme_path",
                      "activation_checkpointing", "data_parallel_shard_size", "mesh_order", "global_batch_size"})
"""The ``parallel`` keys the planner decides; a base recipe's other keys (timeouts, the schedule, checkpoint format,
...) are kept where the planned layout takes them."""


def _merged_parallel(base: Any, planned: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The planned ``parallel`` section with the base recipe's keys the planner does not decide, each kept where the
    layout's rules accept it with the planned ones; returns the section and the keys left out."""
    from lightning_parallel.config import LayoutError

    kept = {k: v for k, v in (base if isinstance(base, dict) else {}).items() if k not in _PLANNED}
    out, dropped = dict(planned), []
    for key, value in kept.items():
        try:
            ParallelConfig.from_dict({**out, key: value})
        except (LayoutError, TypeError, ValueError):
            dropped.append(key)
            continue
        out[key] = value
    return {**{k: v for k, v in out.items() if k in kept}, **planned}, dropped


def recipe_dict(plan: Plan, *, max_steps: int | None = None, accelerator: str | None = None,
                base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The recipe of the recommended layout: trainer, parallel, model (GPT) and data sections. With ``base`` (the
    recipe the plan was made from, as fit reads it), the written recipe is that recipe with what the plan decides
    replaced -- the trainer's strategy, devices, nodes, precision and accumulation, the ``parallel`` layout keys,
    the data's batch size and sequence length, and ``tie_embeddings`` under a pipeline -- and everything else (the
    optimizer's settings, the data path, loggers, callbacks, validation, ``max_steps``) kept."""
    return _recipe_and_dropped(plan, max_steps=max_steps, accelerator=accelerator, base=base)[0]


def _recipe_and_dropped(plan: Plan, *, max_steps: int | None, accelerator: str | None,
                        base: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """:func:`recipe_dict`, and the base recipe's ``parallel`` keys the planned layout does not take."""
    recipe = _planned_recipe(plan, max_steps=20 if max_steps is None and base is None else max_steps,
                             accelerator=accelerator)
    if base is None:
        return recipe, []
    import copy

    out = copy.deepcopy({k: v for k, v in base.items() if k != "defaults"})  # its fragments are merged in already
    trainer = dict(out.get("trainer") or {})
    if "accumulate_grad_batches" not in recipe["trainer"]:
        trainer.pop("accumulate_grad_batches", None)
    if not any(trainer.get(k) not in (None, -1) for k in ("max_steps", "max_epochs", "max_time")):
        trainer["max_steps"] = 20  # the source does not say when to stop (Lightning's default: 1000 epochs)
    out["trainer"] = {**trainer, **recipe["trainer"]}
    parallel, dropped = _merged_parallel(out.get("parallel"), recipe.get("parallel", {}))
    if parallel:
        out["parallel"] = parallel
    else:
        out.pop("parallel", None)
    for section in ("model", "data"):
        current = out.get(section)
        if not (isinstance(current, dict) and isinstance(current.get("init_args"), dict)):
            out[section] = recipe[section]
    tie = recipe["model"]["init_args"]["tie_embeddings"]
    model, data = out["model"], out["data"]
    if model is not recipe["model"] and ("tie_embeddings" in model["init_args"]
                                         or (not tie and _is_default(model, recipe["model"]))):
        model["init_args"]["tie_embeddings"] = tie
    if data is not recipe["data"]:  # a data module of the user's: only the keys it has
        planned = recipe["data"]["init_args"]
        data["init_args"].update({k: v for k, v in planned.items()
                                  if k in data["init_args"] or _is_default(data, recipe["data"])})
    return out, dropped


def _is_default(section: dict[str, Any], planned: dict[str, Any]) -> bool:
    """Whether a base recipe's model or data section is the class the writer plans for (the library's GPT, its
    TextDataModule): then keys it leaves to their defaults are written too."""
    return section.get("class_path", planned["class_path"]) == planned["class_path"]


def _planned_recipe(plan: Plan, *, max_steps: int | None, accelerator: str | None) -> dict[str, Any]:
    """The recipe of the recommended layout alone (no base recipe): trainer, parallel, model (GPT), data."""
    shape, chosen = plan.model.shape, plan.recommended
    if shape is None:
        raise ValueError(
            "--write-recipe needs the model's shape to write its model section; give --model NAME, "
            "--layers/--hidden/--heads, or --recipe PATH instead of --params."
        )
    if chosen is None:
        raise ValueError("--write-recipe: no layout fits this model on this hardware, so there is no recipe to write.")
    layout, hw, training = chosen.layout, plan.hardware, plan.training
    check_model_compat(layout, n_layer=shape.n_layer, n_head=shape.n_head, vocab_size=shape.vocab_size)
    seq_len = training.sequence_length(shape.block_size)
    run = training.for_pipeline(layout.pipeline_parallel_size)  # a batch per replica split as the run splits it
    batch = run.micro_batch_size * run.micro_batches(layout.pipeline_parallel_size)
    single = chosen.strategy == "single_device"
    # One device: Lightning's own strategy, no parallel section -- unless activations are recomputed, which takes a
    # layout: lp_ddp on one process does that (no collective moves anything with one rank).
    recompute = layout.activation_checkpointing != "none"
    strategy = ("lp_ddp" if recompute else "auto") if single else chosen.strategy
    parallel: dict[str, Any] = _parallel_section(layout, multi_node=hw.nodes > 1) if not single else (
        {"activation_checkpointing": layout.activation_checkpointing} if recompute else {})
    if training.global_batch_size is not None:  # the plan's fixed global batch: the run derives its accumulation
        parallel["global_batch_size"] = training.global_batch_size
        strategy = "lp_ddp" if strategy == "auto" else strategy  # a layout key: Lightning's own strategy takes none
    recipe: dict[str, Any] = {
        "seed_everything": 1234,
        "trainer": {
            "strategy": strategy,
            "accelerator": accelerator or hw.accelerator,
            "devices": 1 if single else hw.gpus_per_node,
            "num_nodes": hw.nodes,
            "precision": training.trainer_precision,
            **({"max_steps": max_steps} if max_steps is not None else {}),
            # the accumulation the plan was made for (its memory and step time count it)
            **({"accumulate_grad_batches": training.accumulate_grad_batches}
               if training.accumulate_grad_batches > 1 and training.global_batch_size is None else {}),
        },
        "parallel": parallel,
        "model": {
            "class_path": "lightning_parallel.models.GPT",
            "init_args": {
                "n_layer": shape.n_layer,
                "n_head": shape.n_head,
                "n_embd": shape.n_embd,
                "block_size": shape.block_size,
                "vocab_size": shape.vocab_size,
                "dropout": shape.dropout,
                "bias": shape.bias,
                # a pipeline puts the embedding and the head on different stages: they cannot share one weight
                "tie_embeddings": shape.tie_embeddings and layout.pipeline_parallel_size == 1,
            },
        },
        "data": {
            "class_path": "lightning_parallel.data.TextDataModule",
            "init_args": {"block_size": seq_len, "batch_size": batch},
        },
    }
    if not parallel:
        del recipe["parallel"]
    return recipe


def recipe_text(plan: Plan, *, command: str, max_steps: int | None = None, accelerator: str | None = None,
                path: str | None = None, base: dict[str, Any] | None = None) -> str:
    """The recipe as YAML (:func:`recipe_dict`), headed by comments that say where it came from and why (memory per
    device, the pipeline's bubble, bytes between nodes per mesh order, and -- on several nodes -- the launch
    commands for ``path``)."""
    body, dropped = _recipe_and_dropped(plan, max_steps=max_steps, accelerator=accelerator, base=base)
    chosen = plan.recommended
    assert chosen is not None  # recipe_dict raised otherwise
    mem = chosen.memory
    pipelined = chosen.layout.pipeline_parallel_size > 1
    notes = [
        f"written by: {command}",
        *(textwrap.wrap("kept from the source recipe: everything but the planned layout, devices, precision and "
                        "batch" + (f"; left out (the planned layout refuses them): {', '.join(dropped)}"
                                   if dropped else ""), width=116) if base is not None else []),
        f"branch: {plan.branch}",
        f"predicted per device: {format_bytes(mem.total)} (model states {format_bytes(mem.model_states)})",
        *textwrap.wrap(f"why: {plan.reason}", width=116),
        f"optimizer: {plan.training.optimizer} (GPT.configure_optimizers uses AdamW); data.batch_size is per "
        "data-parallel rank" + (", split into num_micro_batches micro-batches" if pipelined else ""),
    ]
    if pipelined and plan.model.shape is not None and plan.model.shape.tie_embeddings:
        notes.append("tie_embeddings: false -- the first and last pipeline stages cannot share the embedding; the head "
                     "gets its own weight (counted in the estimate)")
    if chosen.cross_node_bytes:
        notes.append(f"mesh_order: {chosen.layout.mesh_order}; bytes between nodes per step (all ranks):")
        for order, axes in chosen.cross_node_bytes.items():
            per_axis = ", ".join(f"{a} {format_bytes(axes[a])}" for a in MESH_AXES)
            mark = " <- chosen" if order == chosen.layout.mesh_order else ""
            notes.append(f"  {order}: {per_axis}; total {format_bytes(axes['total'])}{mark}")
    if pipelined:
        layout = chosen.layout
        p, v = layout.pipeline_parallel_size, layout.virtual_pipeline_stages
        m = plan.training.micro_batches(p)
        chunked = SCHEDULES[layout.pipeline_schedule].multi_stage and v > 1
        bubble = bubble_fraction(layout.pipeline_schedule, p=p, m=m, v=v)
        notes.append(f"bubble: {layout.pipeline_schedule} over p={p} stages, m={m} micro-batches: "
                     f"(p-1)/({'v m' if chunked else 'm'}+p-1) = {bubble:.1%} of each step idle per stage")
    nodes, per_node = plan.hardware.nodes, plan.hardware.gpus_per_node
    if nodes > 1:
        recipe_path = path or "<this recipe>"
        notes.append(f"launch on {nodes} nodes x {per_node} GPUs, either on every node (NODE_RANK 0..{nodes - 1}):")
        notes.append(f"  NNODES={nodes} NODE_RANK=<n> MASTER_ADDR=<node 0> GPUS_PER_NODE={per_node} "
                     f"scripts/launch/torchrun.sh {recipe_path}")
        notes.append(f"or under SLURM: sbatch --nodes {nodes} --gpus-per-node {per_node} --ntasks-per-node {per_node} "
                     f"scripts/launch/slurm.sbatch {recipe_path}")
    if chosen.tiled_layers:
        notes.append("tiled_layers: the largest layer must run tiled (Memory Centric Tiling, e.g. a tiled nn.Linear);")
        notes.append("the parallel section has no key for it: tile the model's largest layer yourself.")
    header = "\n".join(f"# {line}" for line in notes)
    return f"{header}\n{yaml.safe_dump(body, sort_keys=False)}"


def write_recipe(plan: Plan, path: str | Path, *, command: str, max_steps: int | None = None,
                 accelerator: str | None = None, base: dict[str, Any] | None = None) -> Path:
    """Write the recipe (:func:`recipe_text`; ``base``: the recipe the plan was made from) to ``path`` (folders
    created) and return the path."""
    text = recipe_text(plan, command=command, max_steps=max_steps, accelerator=accelerator, path=str(path),
                       base=base)
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as err:
        raise ValueError(f"--write-recipe {str(path)!r}: cannot write there ({err.strerror or err}). Fix: a path in a "
                         "writable folder.") from None
    return out
