"""The typed, closed configuration of the ZeRO-offload engine, in DeepSpeed's own names.

``OffloadEngineConfig`` mirrors the parts of a DeepSpeed config JSON this library sets (``zero_optimization`` with
``stage``, ``offload_optimizer``, ``offload_param``, buckets and ``overlap_comm``; ``aio`` for NVMe; batch sizes;
``gradient_clipping``). It is built from a mapping whose unknown keys are refused with the nearest valid name and
the dotted path (``zero_optimization.offload_optimizer.pin_memory``), and it remembers which keys the user set.

A whole DeepSpeed config (a JSON path or a dict) can be given as the ``base``: the effective config is the typed
defaults, then the base, then the keys the user set explicitly (:meth:`OffloadEngineConfig.to_deepspeed`).
Batch-size keys that disagree with each other or with the run (micro batch x accumulation x world) are reported as
an :class:`OffloadConfigError`, never silently rewritten (:func:`check_batch_sizes`).

Where the state lives (per data-parallel rank, N_d ranks, Psi parameters):

* ``stage`` 2: 1/N_d of the gradients and of the optimizer state per rank; ``offload_optimizer.device=cpu`` keeps
  that optimizer partition (fp32 master weights, Adam moments) and an fp32 gradient partition in host memory and
  runs the optimizer step there (DeepSpeed's CPU Adam); gradients are reduce-scattered in backward (buckets of
  ``reduce_bucket_size``, overlapped with backward when ``overlap_comm``), updated weights all-gathered after the
  step (``allgather_bucket_size``).
* ``stage`` 3: the parameters are partitioned too and all-gathered just in time for each layer in forward and in
  backward (prefetch ``stage3_prefetch_bucket_size``); ``offload_param.device=cpu|nvme`` keeps the partition on
  the host or on disk between uses. ``nvme`` (ZeRO-Infinity) swaps through ``aio`` (libaio) into ``nvme_path``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

__all__ = [
    "AioConfig",
    "OffloadConfigError",
    "OffloadDevice",
    "OffloadEngineConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroOptimizationConfig",
    "check_batch_sizes",
    "check_nvme_folder",
    "deep_merge",
    "load_deepspeed_config",
]

OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadConfigError(ValueError):
    """A ZeRO-offload configuration that cannot run; raised before any process starts."""


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where the optimizer state partition and its step live."""

    device: OffloadDevice = "none"
    """none (on the accelerator), cpu (host memory, CPU Adam) or nvme (disk under nvme_path; stage 3 only)."""
    nvme_path: str | None = None
    """Folder the NVMe swapper writes into (a fast local disk)."""
    buffer_count: int = 4
    """Host buffers for NVMe swapping; at least the states per parameter (Adam: param, grad, two moments)."""
    pin_memory: bool = False
    """Page-locked host memory (faster host<->GPU copies, costs locked RAM; no effect on CPU-only runs)."""
    pipeline_read: bool = False
    """Overlap reading the next sub-group from NVMe with the optimizer step."""
    pipeline_write: bool = False
    """Overlap writing the previous sub-group to NVMe with the optimizer step."""
    fast_init: bool = False
    """Skip writing the initial optimizer state to NVMe at start-up."""
    ratio: float = 1.0
    """Fraction of the optimizer step run on the host (1.0 = all; 'partial offload' below 1)."""


@dataclass(frozen=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (stage 3): where the parameter partition lives between uses."""

    device: OffloadDevice = "none"
    """none, cpu or nvme."""
    nvme_path: str | None = None
    """Folder for swapped parameters."""
    buffer_count: int = 5
    """Host buffers the NVMe parameter swapper cycles through."""
    buffer_size: int = 100_000_000
    """Elements per buffer; must hold the largest parameter (or DeepSpeed refuses)."""
    max_in_cpu: int = 1_000_000_000
    """Parameter elements kept in host memory when swapping to NVMe."""
    pin_memory: bool = False
    """Page-locked host buffers."""


@dataclass(frozen=True)
class ZeroOptimizationConfig:
    """``zero_optimization``: the ZeRO stage, its buckets and the two offload targets."""

    stage: Literal[0, 1, 2, 3] = 2
    """0 off, 1 optimizer state, 2 + gradients, 3 + parameters partitioned over the data-parallel ranks."""
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    """Optimizer-state offload (stage 2 or 3)."""
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    """Parameter offload (stage 3 only)."""
    overlap_comm: bool = False
    """Overlap the gradient reduce-scatter with backward (more bucket memory, less exposed communication)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_scatter: bool = True
    """Average gradients by reduce-scatter (each rank receives its partition) instead of all-reduce."""
    reduce_bucket_size: int = 200_000_000
    """Elements reduced at once: bigger = fewer collectives, more memory."""
    allgather_partitions: bool = True
    """All-gather updated partitions after the step (stage 1-2) instead of a broadcast per partition."""
    allgather_bucket_size: int = 200_000_000
    """Elements all-gathered at once after the step (stage 1-2)."""
    round_robin_gradients: bool = False
    """Stage 1-2 with offload: parallelize gradient copies to the host across ranks."""
    sub_group_size: int = 1_000_000_000
    """Stage 3: parameter elements per optimizer sub-group (the unit swapped to NVMe and stepped at once)."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """Stage 3: parameter elements prefetched (all-gathered) ahead of use."""
    stage3_param_persistence_threshold: int = 100_000
    """Stage 3: parameters smaller than this stay whole on every rank (not partitioned)."""
    stage3_max_live_parameters: int = 1_000_000_000
    """Stage 3: most gathered parameter elements alive at once."""
    stage3_max_reuse_distance: int = 1_000_000_000
    """Stage 3: keep a gathered parameter if it is reused within this many elements."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: gather a full 16-bit state dict on rank 0 when the engine saves the model."""


@dataclass(frozen=True)
class AioConfig:
    """``aio``: DeepSpeed's asynchronous I/O (libaio) for NVMe offload."""

    block_size: int = 1_048_576
    """Bytes per I/O request."""
    queue_depth: int = 8
    """Outstanding I/O requests."""
    intra_op_parallelism: int = 1
    """Threads per read/write request."""
    single_submit: bool = False
    """Submit requests one by one instead of as a batch."""
    overlap_events: bool = True
    """Submit new requests without waiting for earlier ones to complete."""


_POSITIVE = {
    "buffer_count", "buffer_size", "max_in_cpu", "reduce_bucket_size", "allgather_bucket_size", "sub_group_size",
    "stage3_prefetch_bucket_size", "block_size", "queue_depth", "intra_op_parallelism",
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "steps_per_print",
}


@dataclass(frozen=True)
class OffloadEngineConfig:
    """The DeepSpeed config this library builds: typed defaults, a base config, then the user's explicit keys."""

    zero_optimization: ZeroOptimizationConfig = field(default_factory=ZeroOptimizationConfig)
    """ZeRO stage, offload targets, buckets."""
    aio: AioConfig = field(default_factory=AioConfig)
    """Asynchronous I/O for NVMe offload."""
    train_micro_batch_size_per_gpu: int | None = None
    """Samples per rank per forward/backward; None = the DataLoader's batch size."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches per optimizer step; None = the Trainer's accumulate_grad_batches."""
    train_batch_size: int | None = None
    """Global batch = micro batch x accumulation x world size; only checked, never used to change the others."""
    gradient_clipping: float | None = None
    """Clip the global gradient norm to this (0 = off); None = the Trainer's gradient_clip_val."""
    zero_allow_untested_optimizer: bool = True
    """Allow client optimizers DeepSpeed has not tested with ZeRO (any torch optimizer without offload)."""
    steps_per_print: int = 1_000_000_000
    """DeepSpeed's own progress print interval (kept quiet: Lightning logs)."""
    explicit: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    """Dotted keys the user set (they override a base DeepSpeed config); filled by :meth:`from_dict`."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | OffloadEngineConfig | None) -> OffloadEngineConfig:
        """Build from a (nested) mapping in DeepSpeed's names; unknown keys are refused with the nearest name."""
        if data is None:
            return cls()
        if isinstance(data, OffloadEngineConfig):
            return data
        values, explicit = _parse(cls, data, prefix="")
        return cls(**values, explicit=frozenset(explicit))

    def replace(self, updates: Mapping[str, Any]) -> OffloadEngineConfig:
        """A copy with ``updates`` (a nested mapping) applied on top of the keys set so far; they become explicit."""
        merged = deep_merge(self.explicit_dict(), dict(updates))
        return OffloadEngineConfig.from_dict(merged)

    def explicit_dict(self) -> dict[str, Any]:
        """Only the keys the user set, nested as DeepSpeed nests them."""
        full = self.full_dict()
        out: dict[str, Any] = {}
        for dotted in sorted(self.explicit):
            node, src = out, full
            *parents, leaf = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
                src = src[part]
            node[leaf] = copy.deepcopy(src[leaf])
        return out

    def full_dict(self) -> dict[str, Any]:
        """Every typed key with its value (defaults included), nested; ``None`` values are left out."""
        return _to_dict(self)

    def to_deepspeed(self, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The effective DeepSpeed config: typed defaults < ``base`` (a whole DeepSpeed config) < explicit keys."""
        return deep_merge(deep_merge(self.full_dict(), dict(base or {})), self.explicit_dict())


def _parse(cls: type, data: Mapping[str, Any], *, prefix: str) -> tuple[dict[str, Any], list[str]]:
    if not isinstance(data, Mapping):
        where = prefix.rstrip(".") or "the DeepSpeed section"
        raise OffloadConfigError(f"{where} must be a mapping of keys to values, got {type(data).__name__}.")
    hints = get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls) if f.name != "explicit"]
    values: dict[str, Any] = {}
    explicit: list[str] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in valid:
            match = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            hint = f" Did you mean '{prefix}{match[0]}'?" if match else ""
            raise OffloadConfigError(
                f"unknown DeepSpeed key {path!r}.{hint} Valid keys here: {', '.join(valid)}. (A whole DeepSpeed "
                "config with keys this library does not type can be passed as `config=` instead.)"
            )
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            sub, sub_explicit = _parse(kind, value, prefix=f"{path}.")  # type: ignore[arg-type]
            values[key] = kind(**sub)  # type: ignore[operator]
            explicit += sub_explicit
            continue
        _check_value(path, key, value, kind)
        values[key] = value
        explicit.append(path)
    return values, explicit


def _check_value(path: str, key: str, value: Any, kind: Any) -> None:
    args = get_args(kind)
    if get_origin(kind) is Literal:
        if value not in args or isinstance(value, bool):
            raise OffloadConfigError(f"{path}={value!r} is not one of {list(args)}.")
        return
    allowed = tuple(a for a in args if a is not type(None)) if args else (kind,)
    if value is None:
        if type(None) not in args:
            raise OffloadConfigError(f"{path}=None is not allowed; expected {_names(allowed)}.")
        return
    ok = any(
        (isinstance(value, t) and (t is bool or not isinstance(value, bool))) or (t is float and _is_number(value))
        for t in allowed
    )
    if not ok:
        raise OffloadConfigError(f"{path}={value!r} must be {_names(allowed)}, got {type(value).__name__}.")
    if key in _POSITIVE and value < 1:
        raise OffloadConfigError(f"{path}={value!r} must be >= 1.")
    if key in ("ratio",) and not 0.0 < float(value) <= 1.0:
        raise OffloadConfigError(f"{path}={value!r} must be in (0, 1].")
    if key == "gradient_clipping" and value < 0:
        raise OffloadConfigError(f"{path}={value!r} must be >= 0 (0 = no clipping).")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _names(types: tuple[Any, ...]) -> str:
    return " or ".join(getattr(t, "__name__", str(t)) for t in types)


def _to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.name == "explicit":
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = _to_dict(value)
        elif value is not None:
            out[f.name] = value
    return out


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` merged in, mappings recursively (neither input is modified)."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_deepspeed_config(config: str | Path | Mapping[str, Any] | None) -> dict[str, Any]:
    """A whole DeepSpeed config from a JSON file path or a mapping (copied); ``{}`` for None."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    path = Path(config).expanduser()
    if not path.is_file():
        raise OffloadConfigError(f"DeepSpeed config {str(path)!r} does not exist. Fix: pass a JSON file or a dict.")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise OffloadConfigError(f"DeepSpeed config {str(path)!r} is not valid JSON: {err}.") from err
    if not isinstance(loaded, dict):
        raise OffloadConfigError(f"DeepSpeed config {str(path)!r} must hold a JSON object at the top level.")
    return loaded


def check_batch_sizes(config: Mapping[str, Any], *, micro_batch: int | None, accumulation: int,
                      world_size: int) -> None:
    """Refuse batch-size keys that disagree with the run or with each other (reported, never rewritten).

    DeepSpeed requires ``train_batch_size == train_micro_batch_size_per_gpu x gradient_accumulation_steps x world``;
    the run fixes the micro batch (the DataLoader, when known), the accumulation (the Trainer) and the world size.
    """
    given_micro = config.get("train_micro_batch_size_per_gpu")
    given_accum = config.get("gradient_accumulation_steps")
    given_total = config.get("train_batch_size")
    if given_accum is not None and given_accum != accumulation:
        raise OffloadConfigError(
            f"the DeepSpeed config sets gradient_accumulation_steps={given_accum}, but the Trainer accumulates "
            f"accumulate_grad_batches={accumulation}. Fix: set Trainer(accumulate_grad_batches={given_accum}) and "
            "remove the key from the DeepSpeed config (the Trainer's value is passed to the engine)."
        )
    if given_micro is not None and micro_batch is not None and given_micro != micro_batch:
        raise OffloadConfigError(
            f"the DeepSpeed config sets train_micro_batch_size_per_gpu={given_micro}, but the DataLoader yields "
            f"batches of {micro_batch} per rank. Fix: make the two equal, or remove the key (it is then taken from "
            "the DataLoader)."
        )
    micro = given_micro if given_micro is not None else micro_batch
    if given_total is not None and micro is not None and given_total != micro * accumulation * world_size:
        raise OffloadConfigError(
            f"the DeepSpeed config sets train_batch_size={given_total}, but micro batch {micro} x accumulation "
            f"{accumulation} x world size {world_size} = {micro * accumulation * world_size}. Fix: set "
            f"train_batch_size={micro * accumulation * world_size}, or remove it (it is derived)."
        )


def check_nvme_folder(path: str, *, key: str = "parallel.nvme_path", create: bool = True) -> None:
    """An NVMe offload folder must be a writable folder; ``create`` makes a missing one (when its parent allows).
    Raises :class:`~lightning_parallel.config.LayoutError` naming ``key``, the value, what is wrong and the fix --
    checked when the Trainer is built (``lp_zero_offload``) or a plan is made (``lp_auto``), before any op build or
    rank starts."""
    import os

    from lightning_parallel.config import LayoutError

    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise LayoutError(f"{key}={path!r} is not a folder (it is a file). Fix: a folder on a fast local disk, e.g. "
                          "/local_nvme/lightning_parallel.")
    if not folder.exists():
        if not create:
            raise LayoutError(f"{key}={path!r} is not a folder (it does not exist). Fix: create it on a fast local "
                              "disk, or drop the key.")
        try:
            folder.mkdir(parents=True)
        except OSError as err:
            reason = err.strerror or str(err)
            raise LayoutError(f"{key}={path!r} does not exist and cannot be created ({reason}). Fix: create it on a "
                              "fast local disk, or give a folder that exists.") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LayoutError(f"{key}={path!r} is not writable by this user. Fix: a folder you can write.")
