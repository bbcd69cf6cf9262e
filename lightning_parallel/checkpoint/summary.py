"""What a checkpoint was saved from -- model hyper-parameters, tensor shapes, optimizers, LR schedulers -- read cheaply
from any format, and whether it fits the module and the optimizers a run is configured with.

Every strategy refuses a checkpoint that does not fit when it loads it, in each rank; :func:`resume_refusal` says the
same before any rank starts (the checked launchers, ``lightning-parallel check``), for every format:

* one file (``lightning``): its ``state_dict`` shapes, ``optimizer_states`` param groups, ``lr_schedulers``;
* ``lp_sharded`` folder: ``meta.pt`` (hyper-parameters, schedulers; at stages 1-2 the weights, at stage 3 the
  recorded ``sharded_shapes``) and rank 0's file (each optimizer's param groups);
* DCP folder (``lp_tensor``, ``lp_pipeline``, ``lp_hybrid``): DCP's ``.metadata`` (every tensor's global shape, no
  tensor read) and ``meta.pt`` (hyper-parameters, schedulers, the optimizers' param groups by name);
* DeepSpeed folder: rank 0's model-states file (hyper-parameters, schedulers, ``param_shapes`` per param group,
  buffers).

Read with ``weights_only=True`` (DeepSpeed's model states where their content allows) and ``mmap`` where it helps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .formats import CheckpointInfo, detect_format
from .formats.common import load_torch_file, strip_wrapper_prefixes
from .names import DCP_MODEL_KEY, DEEPSPEED_OPTIM_STATES_GLOB, META_FILE, OPTIMIZER_GROUPS_KEY, SHARDED_KEY, rank_file

__all__ = ["OptimizerSummary", "SavedSummary", "configure_as_saved", "describe_optimizer", "hparam_differences",
           "live_optimizers", "resume_refusal", "scheduler_keys", "shown", "summarize"]

_VOLATILE_GROUP_KEYS = frozenset({
    "params", "param_names", "initial_lr", "lr", "weight_decay", "foreach", "fused", "capturable", "differentiable",
    "maximize", "decoupled_weight_decay", "step", "bias_correction", "amsgrad", "adamw_mode",
})
"""Param-group keys that do not tell optimizers apart (set by schedulers, added by newer torch versions, or options
within one kind: AdamW and DeepSpeed's CPU Adam are both ``betas, eps``; SGD is ``dampening, momentum, nesterov``)."""


@dataclass(frozen=True)
class OptimizerSummary:
    """One saved or configured optimizer: each param group's size and the hyper-parameter names that tell the kind
    of optimizer (``betas``/``eps`` for Adam, ``momentum``/``dampening`` for SGD); ``keys`` is None when unknown."""

    group_sizes: tuple[int, ...]
    keys: frozenset[str] | None = None
    name: str | None = None


@dataclass
class SavedSummary:
    """What :func:`summarize` read from a checkpoint."""

    info: CheckpointInfo
    hyper_parameters: dict[str, Any] | None = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Tensor name (the module's names) -> full shape."""
    whole: bool = False
    """``shapes`` lists every tensor of the saved module (so a missing or extra one can be named)."""
    optimizers: list[OptimizerSummary] | None = None
    schedulers: list[frozenset[str]] | None = None
    """Each saved LR scheduler's state keys (they tell the kind: ``lr_lambdas``, ``step_size``/``gamma``, ...)."""
    weights_only: bool = False
    """Saved without any training state (``ModelCheckpoint(save_weights_only=True)``: no optimizer, LR scheduler or
    loop state)."""


def _group_keys(group: Mapping[str, Any]) -> frozenset[str]:
    return frozenset(k for k in group if k not in _VOLATILE_GROUP_KEYS)


def _from_states(states: Any) -> list[OptimizerSummary] | None:
    """Per-index optimizer states (Lightning's ``optimizer_states``)."""
    if not isinstance(states, list):
        return None
    out = []
    for state in states:
        groups = state.get("param_groups") if isinstance(state, Mapping) else None
        if not isinstance(groups, list):
            return None
        out.append(OptimizerSummary(tuple(len(g.get("params", [])) for g in groups),
                                    frozenset().union(*(_group_keys(g) for g in groups)) if groups else frozenset()))
    return out


_COMMON_SCHEDULER_KEYS = frozenset({"base_lrs", "last_epoch", "verbose"})


def scheduler_keys(state: Any) -> frozenset[str]:
    """The state keys that tell an LR scheduler's kind (``lr_lambdas``; ``step_size``, ``gamma``; ...): its
    ``state_dict()`` keys without the private and the common ones."""
    if not isinstance(state, Mapping):
        return frozenset()
    return frozenset(k for k in state if isinstance(k, str) and not k.startswith("_")
                     and k not in _COMMON_SCHEDULER_KEYS)


def _schedulers(checkpoint: Mapping[str, Any]) -> list[frozenset[str]] | None:
    saved = checkpoint.get("lr_schedulers")
    if not isinstance(saved, list):
        return None
    return [scheduler_keys(s) for s in saved]


def _shapes(state: Mapping[str, Any], leading: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    named = strip_wrapper_prefixes({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, leading=leading)
    return {k: tuple(v.shape) for k, v in named.items()}


_CACHE: dict[tuple[Any, ...], SavedSummary] = {}


def summarize(path: str | Path, *, trusted: bool = False) -> SavedSummary:
    """The :class:`SavedSummary` of the checkpoint at ``path`` (any format); raises
    :class:`~lightning_parallel.checkpoint.errors.CheckpointFormatError` for what :func:`detect_format` refuses.
    Kept for the same unchanged path (the CLI and the launcher both ask), without the tensors."""
    import dataclasses

    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size, trusted)
    if key not in _CACHE:
        summary = _summarize(path, trusted=trusted)
        summary.info = dataclasses.replace(summary.info, checkpoint=None)
        _CACHE.clear()
        _CACHE[key] = summary
    return _CACHE[key]


def _summarize(path: str | Path, *, trusted: bool) -> SavedSummary:
    info = detect_format(path, trusted=trusted)
    content = info.checkpoint if isinstance(info.checkpoint, dict) else {}
    summary = SavedSummary(info=info, hyper_parameters=_dict_or_none(content.get("hyper_parameters")),
                           schedulers=_schedulers(content))
    if info.format == "lightning":
        summary.shapes = _shapes(content.get("state_dict") or {})
        summary.whole = True
        summary.optimizers = _from_states(content.get("optimizer_states"))
        # Lightning's weights-only save leaves out the optimizer and scheduler states (it keeps "loops"); so does
        # `lightning-parallel consolidate` without --resumable. (A module without an optimizer saves [{}].)
        summary.weights_only = "state_dict" in content and "optimizer_states" not in content
        if summary.weights_only:
            summary.optimizers, summary.schedulers = [], []
    elif info.format == "lp_sharded":
        _sharded(summary, content, trusted=trusted)
    elif info.format in ("lp_tensor", "lp_pipeline", "lp_hybrid"):
        _dcp(summary)
    else:
        _deepspeed(summary, content, trusted=trusted)
    return summary


def _dict_or_none(value: Any) -> dict[str, Any] | None:
    return dict(value) if isinstance(value, Mapping) else None


def _sharded(summary: SavedSummary, meta: Mapping[str, Any], *, trusted: bool) -> None:
    info = summary.info
    if info.zero_stage == 3 or ((meta.get(SHARDED_KEY) or {}).get("fsdp")):  # FSDP2 pieces (ZeRO-2 under HSDP too)
        summary.shapes = {k: tuple(v) for k, v in ((meta.get(SHARDED_KEY) or {}).get("sharded_shapes") or {}).items()}
    else:
        summary.shapes = _shapes(meta.get("state_dict") or {})
        summary.whole = True
    rank0 = load_torch_file(info.path / rank_file(0), trusted=trusted, what="a rank file of an lp_sharded checkpoint")
    states = rank0.get("optimizer_states") if isinstance(rank0, Mapping) else None
    if not isinstance(states, list):
        return
    out = []
    for state in states:
        if isinstance(state, Mapping) and "shapes" in state and isinstance(state.get("optim"), Mapping):
            groups = state["optim"].get("param_groups") or []  # ZeroOptimizer (stages 1-2): one flat shard per group
            out.append(OptimizerSummary(tuple(len(s) for s in state["shapes"]),
                                        frozenset().union(*(_group_keys(g) for g in groups)) if groups else None))
        else:
            found = _from_states([state])
            if found is None:
                return
            out.extend(found)
    summary.optimizers = out


def _dcp(summary: SavedSummary) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = summary.info.path
    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    prefix = DCP_MODEL_KEY + "."
    summary.shapes = {k[len(prefix):]: tuple(m.size) for k, m in metadata.items()
                      if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    summary.whole = True
    meta = load_torch_file(folder / META_FILE, what=f"the {META_FILE} of a DCP checkpoint folder")
    if not isinstance(meta, Mapping):
        return
    summary.hyper_parameters = _dict_or_none(meta.get("hyper_parameters"))
    summary.schedulers = _schedulers(meta)
    groups_by_opt = meta.get(OPTIMIZER_GROUPS_KEY)
    if isinstance(groups_by_opt, list):
        summary.optimizers = [OptimizerSummary(tuple(len(g.get("params", [])) for g in groups),
                                               frozenset().union(*(_group_keys(g) for g in groups)) if groups
                                               else frozenset())
                              for groups in groups_by_opt]


def _deepspeed(summary: SavedSummary, states: Mapping[str, Any], *, trusted: bool) -> None:
    leading = ("_forward_module.", "module.")
    shapes: dict[str, tuple[int, ...]] = {}
    groups = states.get("param_shapes") or []
    for group in groups:
        shapes.update({k: tuple(v) for k, v in group.items()})
    shapes.update({k: tuple(v) for k, v in (states.get("frozen_param_shapes") or {}).items()})
    for alias, source in (states.get("shared_params") or {}).items():  # tied weights: listed once in param_shapes
        if isinstance(source, str) and source in shapes:
            shapes.setdefault(alias, shapes[source])
    buffers = set(states.get("buffer_names") or ())
    module = states.get("module") or {}
    shapes.update({k: tuple(v.shape) for k, v in module.items() if k in buffers and isinstance(v, torch.Tensor)})
    summary.shapes = {k: shapes[k2] for k, k2 in zip(strip_wrapper_prefixes(dict.fromkeys(shapes), leading=leading),
                                                      shapes, strict=True)}
    summary.whole = bool(groups)
    if groups:
        summary.optimizers = [OptimizerSummary(tuple(len(g) for g in groups), _deepspeed_keys(summary.info, trusted))]


def _deepspeed_keys(info: CheckpointInfo, trusted: bool) -> frozenset[str] | None:
    """The hyper-parameter names of a DeepSpeed folder's optimizer (rank 0's optimizer-state file; it holds DeepSpeed
    objects, so only when ``trusted``, as resuming reads it), or None."""
    if not trusted or info.tag is None:
        return None
    files = sorted((info.path / info.tag).glob(DEEPSPEED_OPTIM_STATES_GLOB))
    if not files:
        return None
    try:
        state = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)["optimizer_state_dict"]
        base = state.get("base_optimizer_state") or state.get("optimizer_state_dict") or state
        groups = base["param_groups"]
    except Exception:
        return None
    return frozenset().union(*(_group_keys(g) for g in groups)) if groups else None


# ---------------------------------------------------------------------------------------------- the comparison
def describe_optimizer(keys: frozenset[str] | None, name: str | None = None) -> str:
    """``SGD (dampening, momentum, nesterov)`` / ``an optimizer with amsgrad, betas, eps``."""
    listed = ", ".join(sorted(keys)) if keys else "no distinguishing hyper-parameters"
    return f"{name} ({listed})" if name else f"an optimizer with {listed}"


def live_optimizers(optimizers: Sequence[Any]) -> list[OptimizerSummary]:
    """The :class:`OptimizerSummary` of configured torch optimizers (``configure_optimizers``' result)."""
    out = []
    for opt in optimizers:
        raw = getattr(opt, "_optimizer", opt)
        groups = getattr(raw, "original_params", None) or [g["params"] for g in raw.param_groups]
        keys = frozenset().union(*(_group_keys(g) for g in raw.param_groups)) if raw.param_groups else frozenset()
        out.append(OptimizerSummary(tuple(len(g) for g in groups), keys, type(raw).__name__))
    return out


def hparam_differences(saved: Mapping[str, Any] | None, configured: Mapping[str, Any] | None, *,
                       free: Sequence[str] = ()) -> list[tuple[str, Any, Any]]:
    """``(dotted key, configured, saved)`` for each configured hyperparameter (or init argument) that differs from
    the saved one, keys in ``free`` and keys absent on either side left out. Values compare equal with tuples and
    lists alike; a configured mapping matches when every key it sets has the saved value (a model that saves its
    whole config -- a Hugging Face model's, every default filled in -- against the few keys a recipe sets), its
    differences named by their own keys; a configured name or path against a saved mapping (a model id against the
    config it resolved to) cannot be compared and passes."""
    if not saved or configured is None:
        return []
    return [found for key in sorted(saved) if key in configured and key not in free
            for found in _differences(key, configured[key], saved[key])]


def _differences(key: str, configured: Any, saved: Any) -> list[tuple[str, Any, Any]]:
    if isinstance(configured, Mapping) and isinstance(saved, Mapping):
        return [found for sub, value in configured.items()
                for found in ([(f"{key}.{sub}", value, None)] if sub not in saved
                              else _differences(f"{key}.{sub}", value, saved[sub]))]
    if isinstance(configured, str) and isinstance(saved, Mapping):
        return []
    try:
        return [] if _plain(configured) == _plain(saved) else [(key, configured, saved)]
    except Exception:  # values that do not compare (tensors, objects): not ours to judge
        return []


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, list | tuple) else value


def configure_as_saved(key: str, value: Any) -> str:
    """The fix's example for a hyperparameter that differs: the command-line form for a top-level init argument and
    the recipe form (also the only one for a key inside a mapping, e.g. a Hugging Face config's)."""
    recipe = f"model.init_args.{key}: {shown(value)} in the recipe"
    return recipe if "." in key else f"--model.init_args.{key} '{shown(value)}', or {recipe}"


def shown(value: Any) -> str:
    """A value as a recipe or the command line takes it (JSON: ``null``, ``false``, ``{...}``)."""
    import json

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def resume_refusal(summary: SavedSummary, *, module: Any, optimizers: Sequence[Any] | None = None,
                   schedulers: Sequence[Any] | None = None, weights_only: bool = False,
                   groups_may_grow: bool = False, partial_module: bool = False) -> str | None:
    """Why the checkpoint summarized in ``summary`` cannot resume into ``module`` with the configured ``optimizers``
    and LR ``schedulers`` (None = unknown: not compared), or None. With ``weights_only`` (``--resume_weights_only``)
    only the weights are compared. ``groups_may_grow``: a callback adds param groups during the fit (Lightning's
    ``BaseFinetuning`` unfreezing layers) and adds them again when it restores, so a saved optimizer may hold more
    groups than configured, the configured ones first. The message names the format, what was saved and what is
    configured, and the fix. ``partial_module``: the module builds (some of) its layers in ``configure_model()``,
    which runs in the ranks: only the shapes of the tensors it already has are compared here (the ranks compare the
    rest when they load). A module with ``strict_loading = False`` loads what matches, as Lightning does: missing
    and unexpected tensors are not refused.
    """
    where = f"--ckpt_path {summary.info.path} ({summary.info.describe()})"
    hp = hparam_differences(summary.hyper_parameters, getattr(module, "hparams", None),
                            free=getattr(type(module), "resume_free_hparams", ()))
    listing = "; ".join(f"{k}: configured {shown(mine)}, saved {shown(theirs)}" for k, mine, theirs in hp[:6])
    live = {k: tuple(v.shape) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    mismatched = [(k, summary.shapes[k], shape) for k, shape in live.items()
                  if k in summary.shapes and tuple(summary.shapes[k]) != shape]
    shape_fix = (f" Fix: configure the model as it was saved (e.g. {configure_as_saved(hp[0][0], hp[0][2])}), "
                 "or start a new run without --ckpt_path." if hp else
                 " Fix: resume with the model it was saved with, or start a new run without --ckpt_path.")
    if mismatched:
        name, saved, mine = mismatched[0]
        head = f"{listing}. " if listing else ""
        return (f"{where} was saved by a model of another shape: {head}{name} has shape {list(saved)} in the "
                f"checkpoint but {list(mine)} in the configured model ({len(mismatched)} tensor(s) differ).{shape_fix}")
    if partial_module:
        optimizers = None  # configure_optimizers saw the module without the layers configure_model adds
    if summary.whole and getattr(module, "strict_loading", True) and not partial_module:
        missing = sorted(set(live) - set(summary.shapes))
        extra = sorted(set(summary.shapes) - set(live))
        if missing or extra:
            head = f" ({listing})" if listing else ""
            return (f"{where} does not hold the configured model's tensors{head}: missing {missing[:4]}"
                    f"{' ...' if len(missing) > 4 else ''}, unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}."
                    f"{shape_fix}")
    if weights_only:
        return None
    weights_fix = (" Fix: resume with the optimizer and LR schedulers it was saved with, or start from its weights "
                   "only with --resume_weights_only (a fresh optimizer, LR schedulers and step count).")
    if optimizers is not None and summary.optimizers == [] and live_optimizers(optimizers):
        return (f"{where} holds no optimizer or LR scheduler state (a weights-only checkpoint: "
                "ModelCheckpoint(save_weights_only=True), or lightning-parallel consolidate without --resumable), so "
                "it cannot resume a fit. Fix: start from its weights -- "
                f"{type(module).__name__}.load_from_checkpoint(path) (a consolidated file for a folder: "
                "lightning-parallel consolidate), then trainer.fit without ckpt_path; on the command line "
                "--resume_weights_only -- or resume from a checkpoint saved with its training state.")
    if optimizers is not None and summary.optimizers is not None:
        mine_opt = live_optimizers(optimizers)
        if len(mine_opt) != len(summary.optimizers):
            return (f"{where} holds {len(summary.optimizers)} optimizer state(s); this run's configure_optimizers "
                    f"returns {len(mine_opt)} optimizer(s).{weights_fix}")
        for i, (saved_opt, live_opt) in enumerate(zip(summary.optimizers, mine_opt, strict=True)):
            if saved_opt.keys is not None and live_opt.keys is not None and saved_opt.keys != live_opt.keys:
                return (f"{where}: optimizer {i} was saved as {describe_optimizer(saved_opt.keys)}; this run's "
                        f"configure_optimizers returns {describe_optimizer(live_opt.keys, live_opt.name)}: its state "
                        f"does not carry over.{weights_fix}")
            saved_sizes, live_sizes = list(saved_opt.group_sizes), list(live_opt.group_sizes)
            grown = groups_may_grow and saved_sizes[:len(live_sizes)] == live_sizes
            if saved_sizes != live_sizes and not grown:
                return (f"{where}: optimizer {i} was saved with param groups of {list(saved_opt.group_sizes)} "
                        f"parameters; this run's {live_opt.name} has {list(live_opt.group_sizes)} (another "
                        f"configure_optimizers or model).{weights_fix}")
    if schedulers is not None and summary.schedulers is not None:
        mine_sched = [scheduler_keys(s.state_dict()) for s in schedulers]
        if len(mine_sched) != len(summary.schedulers):
            names = ", ".join(type(s).__name__ for s in schedulers) or "none"
            return (f"{where} holds {len(summary.schedulers)} LR scheduler state(s); this run configures "
                    f"{len(mine_sched)} ({names}).{weights_fix}")
        for i, (saved_keys, mine_keys, sched) in enumerate(zip(summary.schedulers, mine_sched, schedulers,
                                                                strict=True)):
            differ = sorted(saved_keys ^ mine_keys)
            if differ:
                return (f"{where}: LR scheduler {i} was saved as a scheduler with {', '.join(sorted(saved_keys))}; "
                        f"this run configures {type(sched).__name__} ({', '.join(sorted(mine_keys))}): another kind "
                        f"of scheduler.{weights_fix}")
    return None
