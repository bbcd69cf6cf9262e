"""The DeepSpeed formats (``deepspeed``, ``deepspeed_nvme``): DeepSpeed's ZeRO folder from ``lp_zero_offload``
(ZeRO-1/2/3, CPU offload or none) or Lightning's ``deepspeed`` strategy, and the same folder written with NVMe offload.

* ``latest`` (the tag, ``checkpoint``), ``<tag>/*_model_states.pt`` (Lightning's client state -- ``hyper_parameters``,
  ``loops``, ... -- DeepSpeed's ``module``, ``param_shapes``, ``buffer_names``, ``ds_config``) and
  ``<tag>/*_optim_states.pt``, one per rank, holding that rank's partition of the fp32 master weights and of the
  optimizer state. DeepSpeed's engine writes and reads them.
* ``checksums.json`` (rank 0, last; format version 1): the CRC-32 and size of every file.
* With NVMe offload, ``lp_offload_state/lp_offload_rankNNNNN.pt``: each rank's offloaded partition (fp32 masters,
  optimizer moments, step counts), which DeepSpeed 0.19.8 neither saves nor restores itself; taken from and put back
  into the engine by :mod:`lightning_parallel.parallel.offload.state` (restored values verified).

Here: the collective write (:func:`save`: the engine's folder and the NVMe state into ``<name>.partial``, renamed once
every rank is done), the read on the layout that wrote it (:func:`load`), and the offline reading in one CPU process
(:func:`detect`, :func:`read_full` -- DeepSpeed's ``zero_to_fp32`` reconstruction of the fp32 masters, or the NVMe
state files -- :func:`read_optimizer_state` -- Adam's moments in the one-device per-index form -- and
:func:`convert_to_fp32_state_dict`). The model-states file is read with ``weights_only=True`` where its content allows;
the optimizer-state files hold DeepSpeed objects and are read by ``zero_to_fp32`` with ``weights_only=False``.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import rng
from ..atomic import disk_errors, fresh_partial, partial_path, replace_with
from ..errors import CheckpointFormatError, ResumeError
from ..names import (
    DEEPSPEED_DEFAULT_TAG,
    DEEPSPEED_LATEST_FILE,
    DEEPSPEED_MODEL_STATES_GLOB,
    DEEPSPEED_OPTIM_STATES_GLOB,
    DEEPSPEED_RANK0_MODEL_STATES,
    NVME_STATE_DIR,
    NVME_STATE_GLOB,
    nvme_state_file,
)
from ..verify import write_manifest
from .common import (
    CheckpointFormat,
    CheckpointInfo,
    CheckpointStrategy,
    agree_on_failure,
    check_format_version,
    load_torch_file,
    refused_save,
    stamp_format_version,
    strip_wrapper_prefixes,
)

__all__ = [
    "FORMATS",
    "assemble_nvme_states",
    "convert_to_fp32_state_dict",
    "deepspeed_quietly",
    "detect",
    "is_deepspeed_folder",
    "layout_mismatch",
    "load",
    "load_nvme_state",
    "read_full",
    "read_optimizer_state",
    "save",
    "save_nvme_state",
]

FORMATS = ("deepspeed", "deepspeed_nvme")

# Leading prefixes of the module a DeepSpeed engine wraps (Lightning's forward wrapper, a DDP-style wrapper).
_DEEPSPEED_LEADING = ("_forward_module.", "module.")
# Keys DeepSpeed adds to its model-states file next to Lightning's client state.
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "csr_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "ds_config", "ds_version", "mp_rank", "checkpoint_parallel_dimensions", "autoep_layers", "ds_autoep_layers",
})


def is_deepspeed_folder(path: str | Path) -> bool:
    """A folder with DeepSpeed's ``latest`` file (what the engine's own load reads)."""
    folder = Path(path)
    return folder.is_dir() and (folder / DEEPSPEED_LATEST_FILE).is_file()


# ---------------------------------------------------------------------------------------------- write
def save(strategy: CheckpointStrategy, checkpoint: dict[str, Any], filepath: Any, *,
         write_engine_folder: Callable[[dict[str, Any], str], None], nvme_engine: Any | None = None) -> None:
    """Write the folder (collective): every rank's RNG states go into the client state, ``write_engine_folder``
    (Lightning's ``DeepSpeedStrategy.save_checkpoint``) writes DeepSpeed's files, and with ``nvme_engine`` each rank
    also writes its NVMe-offloaded state (:func:`save_nvme_state`). All of it into ``<path>.partial``, renamed into
    place once every rank is done: a crash mid-save leaves the previous checkpoint of that name whole."""
    if refused_save(strategy, filepath):
        return
    rng.attach_rng_states(checkpoint)  # every rank's, in the client state (a collective)
    stamp_format_version(checkpoint)
    target = Path(strategy.broadcast(str(filepath)))
    partial = partial_path(target)
    error: BaseException | None = None
    if strategy.is_global_zero:
        try:
            fresh_partial(target)  # DeepSpeed copies the NVMe swap folder with copytree: the target must be new
            partial.rmdir()
        except OSError as err:
            error = err
    agree_on_failure(strategy, error)
    module = strategy.lightning_module
    # the whole folder, roughly: the weights, and the fp32 masters and two Adam moments of every parameter
    needed = sum(int(getattr(p, "ds_numel", p.numel())) * 16 for p in module.parameters()) if module else None
    try:
        with disk_errors(target, needed=needed):
            write_engine_folder(checkpoint, str(partial))
            if nvme_engine is not None:
                save_nvme_state(nvme_engine, partial, rank=strategy.global_rank)
    except Exception as err:
        error = err
    agree_on_failure(strategy, error, cleanup=partial)
    if strategy.is_global_zero:
        try:
            with disk_errors(target, needed=0):
                write_manifest(partial)  # CRC-32 per file, checked before a load
                replace_with(partial, target)
        except Exception as err:
            error = err
    agree_on_failure(strategy, error, cleanup=partial)


def save_nvme_state(engine: Any, folder: str | Path, *, rank: int) -> Path:
    """Write this rank's ZeRO-3 NVMe-offloaded partition into ``<folder>/lp_offload_state/``."""
    from lightning_parallel.parallel.offload.state import local_state

    payload = local_state(engine, rank=rank)
    path = Path(folder) / NVME_STATE_DIR / nvme_state_file(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)
    return path


# ---------------------------------------------------------------------------------------------- read, same layout
def load(strategy: CheckpointStrategy, path: Path, *, read_engine_folder: Callable[[], dict[str, Any]],
         nvme_engine: Any | None = None, fitting: bool = True) -> dict[str, Any]:
    """DeepSpeed's own load (``read_engine_folder``: Lightning's ``DeepSpeedStrategy.load_checkpoint``, which puts
    the partitions into the engine and returns the client state), then -- with ``nvme_engine`` -- this rank's
    NVMe-offloaded state, restored and verified; this rank's RNG states are kept for the start of training."""
    client_state = read_engine_folder()
    check_format_version(client_state, where=path)
    if nvme_engine is not None:
        if not (path / NVME_STATE_DIR).is_dir():
            raise RuntimeError(
                f"{path} has no {NVME_STATE_DIR}/ folder: it was not written by lp_zero_offload "
                "with NVMe offload, and DeepSpeed's own checkpoint does not restore NVMe-offloaded state "
                "(it would resume from the initial weights). Refusing to resume from it."
            )
        if not fitting:
            raise RuntimeError(
                f"validate/test/predict from the NVMe-offloaded checkpoint {path}: DeepSpeed's engine "
                "would evaluate without the saved weights. Fix: load lightning_parallel.strategies.zero_offload."
                "convert_to_fp32_state_dict(path) into the module and evaluate it without offload."
            )
        load_nvme_state(nvme_engine, path, rank=strategy.global_rank)
        strategy.barrier("lp_zero_offload_nvme_state_loaded")
    rng.restore_rng_states(client_state, rank=strategy.global_rank, world_size=strategy.world_size,
                           module=strategy.lightning_module)
    return client_state


def load_nvme_state(engine: Any, folder: str | Path, *, rank: int) -> int:
    """Restore (and verify) this rank's NVMe-offloaded partition saved by :func:`save_nvme_state` in the checkpoint
    ``folder``; returns the tensors checked. ``FileNotFoundError`` without the file, ``ValueError`` for another world
    size or model, :class:`~lightning_parallel.parallel.offload.state.ResumeVerificationError` if the engine did not
    take the saved values."""
    from lightning_parallel.parallel.offload.state import restore_local_state

    path = Path(folder) / NVME_STATE_DIR / nvme_state_file(rank)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: this checkpoint holds no NVMe-offloaded state for rank {rank}.")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    return restore_local_state(engine, payload, where=str(path))


def layout_mismatch(path: Path, *, zero_stage: int, world_size: int) -> str | None:
    """Why DeepSpeed's own load cannot resume this folder of another ZeRO stage or world size (it resumes on the
    same ones only), or None (also when the folder is not readable: DeepSpeed's own load then says why)."""
    try:
        info = detect(path)
    except CheckpointFormatError:
        return None
    if info is None or (info.zero_stage in (None, zero_stage) and info.world_size in (None, world_size)):
        return None
    return (
        f"{path} was saved by lp_zero_offload at ZeRO-{info.zero_stage} on {info.world_size} ranks; this run is "
        f"ZeRO-{zero_stage} on {world_size} ranks, and DeepSpeed resumes its folders on the same stage and world "
        "size only (ZeRO-1/2 runs read other layouts' state themselves; this one cannot). Fix: resume with that "
        "layout, or at ZeRO-1/2 with CPU offload."
    )


# ---------------------------------------------------------------------------------------------- offline read
def detect(folder: Path, *, trusted: bool = False) -> CheckpointInfo | None:
    """The folder's :class:`CheckpointInfo` (ZeRO stage, world size, tag, NVMe offload), or None if it has neither
    ``latest`` nor a ``<tag>/*_model_states.pt``; refused when incomplete."""
    if not ((folder / DEEPSPEED_LATEST_FILE).is_file() or any(folder.glob(f"*/{DEEPSPEED_MODEL_STATES_GLOB}"))):
        return None
    tag = _deepspeed_tag(folder)
    sub = folder / tag
    model_files = sorted(sub.glob(DEEPSPEED_MODEL_STATES_GLOB))
    optim_files = sorted(sub.glob(DEEPSPEED_OPTIM_STATES_GLOB))
    if not model_files or not optim_files:
        raise CheckpointFormatError(
            f"{sub}: {len(model_files)} *_model_states.pt and {len(optim_files)} *_optim_states.pt files; expected a "
            "DeepSpeed ZeRO checkpoint (model states and one optimizer-state partition per rank)."
        )
    first = next((f for f in model_files if f.name in DEEPSPEED_RANK0_MODEL_STATES), model_files[0])
    states = _load_model_states(first)
    check_format_version(states, where=first)
    zero = (states.get("ds_config") or {}).get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    world = int(states.get("dp_world_size") or len(optim_files))
    if stage < 1 or len(optim_files) != world:
        raise CheckpointFormatError(
            f"{sub}: ZeRO stage {stage} written by {world} data-parallel ranks, but {len(optim_files)} "
            "*_optim_states.pt files; expected a ZeRO (stage 1-3) checkpoint with one optimizer-state file per rank."
        )
    nvme = any((zero.get(k) or {}).get("device") == "nvme" for k in ("offload_param", "offload_optimizer"))
    nvme_dir = folder / NVME_STATE_DIR
    nvme_files = tuple(sorted(nvme_dir.glob(NVME_STATE_GLOB))) if nvme_dir.is_dir() else ()
    if nvme and len(nvme_files) != world:
        raise CheckpointFormatError(
            f"{folder}: written with NVMe offload, but {nvme_dir} holds {len(nvme_files)} {NVME_STATE_GLOB} files "
            f"for {world} ranks. DeepSpeed does not save or restore NVMe-offloaded state reliably, so its own "
            "partitions are not read for it; expected one NVMe state file per rank, as lp_zero_offload writes them."
        )
    fmt: CheckpointFormat = "deepspeed_nvme" if nvme else "deepspeed"
    return CheckpointInfo(format=fmt, path=folder, files=(*model_files, *optim_files, *nvme_files), zero_stage=stage,
                          world_size=world, tag=tag, checkpoint=states)


def _deepspeed_tag(folder: Path) -> str:
    latest = folder / DEEPSPEED_LATEST_FILE
    if latest.is_file():
        tag = latest.read_text().strip()
        if not (folder / tag).is_dir():
            raise CheckpointFormatError(f"{latest} names the tag {tag!r}, but {folder / tag} is not a folder; expected "
                                        "a DeepSpeed checkpoint folder with that tag's sub-folder.")
        return tag
    tags = sorted({f.parent.name for f in folder.glob(f"*/{DEEPSPEED_MODEL_STATES_GLOB}")})
    if len(tags) != 1:
        raise CheckpointFormatError(f"{folder}: no '{DEEPSPEED_LATEST_FILE}' file and {len(tags)} tag sub-folders "
                                    f"({tags[:4]}); expected a DeepSpeed folder naming its tag in "
                                    f"'{DEEPSPEED_LATEST_FILE}'.")
    return tags[0]


def _load_model_states(file: Path) -> dict[str, Any]:
    """A DeepSpeed model-states file: ``weights_only=True`` where its content allows (DeepSpeed 0.19 writes plain
    containers, tensors and ``torch.Size``), else ``weights_only=False`` -- the folder's optimizer-state files are
    read that way by DeepSpeed's ``zero_to_fp32`` in any case (they hold DeepSpeed objects)."""
    try:
        states = load_torch_file(file, what="a DeepSpeed model-states file")
    except CheckpointFormatError:
        states = load_torch_file(file, trusted=True, what="a DeepSpeed model-states file")
    if not isinstance(states, dict) or "module" not in states or "ds_config" not in states:
        raise CheckpointFormatError(f"{file}: no 'module' and 'ds_config' entries; expected a DeepSpeed model-states "
                                    "file.")
    return states


def read_full(info: CheckpointInfo, *, trusted: bool = False) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Lightning's client state from rank 0's model-states file; weights from DeepSpeed's fp32 reconstruction of the
    rank partitions, or (NVMe offload) from the per-rank state files lp_zero_offload writes."""
    assert info.tag is not None and info.checkpoint is not None
    model_states = info.checkpoint
    rest = {k: v for k, v in model_states.items() if k not in _DEEPSPEED_KEYS}
    buffer_names = set(model_states.get("buffer_names") or ())
    buffers = {k: v for k, v in (model_states.get("module") or {}).items() if k in buffer_names}
    if info.format == "deepspeed_nvme":
        param_names = [n for group in model_states.get("param_shapes") or [] for n in group]
        param_names += list((model_states.get("frozen_param_shapes") or {}).keys())
        state = _nvme_params(info.path / NVME_STATE_DIR, param_names)
        for name, value in buffers.items():  # as zero_to_fp32 does: buffers from the model states, fp32
            state[name] = value.float() if value.is_floating_point() else value
    else:
        state = _zero_to_fp32(info.path, info.tag)
    return strip_wrapper_prefixes(state, leading=_DEEPSPEED_LEADING), rest


@contextlib.contextmanager
def deepspeed_quietly() -> Iterator[None]:
    """Around DeepSpeed's checkpoint readers (``zero_to_fp32``): their progress prints (stdout) and bars (stderr) go
    nowhere, and tqdm starts no monitor thread -- its first bar would start one that lives as long as the process,
    and a process that read a DeepSpeed checkpoint and then forks ranks (``start_method="fork"``) would fork with
    that thread alive (what a forked child inherits from a multi-threaded parent is unsafe)."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    interval = tqdm.monitor_interval if tqdm is not None else None
    if tqdm is not None:
        tqdm.monitor_interval = 0
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if tqdm is not None:
            tqdm.monitor_interval = interval


def _zero_to_fp32(folder: Path, tag: str) -> dict[str, Tensor]:
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as err:
        raise CheckpointFormatError(f"{folder}: a DeepSpeed checkpoint; reading it needs DeepSpeed "
                                    "(pip install -e '.[deepspeed]').") from err
    try:
        with deepspeed_quietly():
            state = dict(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag))
    except (FileNotFoundError, ValueError) as err:
        raise CheckpointFormatError(f"{folder}: DeepSpeed could not rebuild the fp32 weights ({err}); expected a "
                                    "complete ZeRO checkpoint folder.") from err
    # zero_to_fp32 returns views into one flat vector per group: give each tensor its own storage
    return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in state.items()}


def assemble_nvme_states(folder: str | Path) -> dict[str, Tensor]:
    """Full fp32 parameters from the per-rank NVMe state files in ``folder`` (``lp_offload_state/``; offline, no
    process group): each ZeRO-3 parameter is its ranks' partitions concatenated, padding dropped, reshaped."""
    files = sorted(Path(folder).glob(NVME_STATE_GLOB))
    if not files:
        raise FileNotFoundError(f"{folder} holds no {NVME_STATE_GLOB} files.")
    payloads = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    world = payloads[0]["world_size"]
    if len(payloads) != world:
        raise ValueError(f"{folder} holds {len(payloads)} rank files, but they were written by {world} ranks.")
    out: dict[str, Tensor] = {}
    for name, shape in payloads[0]["shapes"].items():
        if name not in payloads[0]["params"]:
            continue
        flat = torch.cat([p["params"][name]["fp32"].flatten() for p in payloads])
        out[name] = flat[: math.prod(shape)].reshape(shape).clone()
    return out


def _nvme_params(nvme_dir: Path, param_names: list[str]) -> dict[str, Tensor]:
    """Full fp32 parameters from the per-rank NVMe state files (their partitions concatenated, padding dropped)."""
    try:
        state = assemble_nvme_states(nvme_dir)  # torch.load(weights_only=True)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        raise CheckpointFormatError(f"{nvme_dir}: {err}; expected one {NVME_STATE_GLOB} per rank.") from err
    saved = strip_wrapper_prefixes(state, leading=_DEEPSPEED_LEADING)
    wanted = strip_wrapper_prefixes(dict.fromkeys(param_names, None), leading=_DEEPSPEED_LEADING)
    missing = sorted(set(wanted) - set(saved))
    if missing:
        raise CheckpointFormatError(
            f"{nvme_dir}: no NVMe state for parameters {missing[:5]} (frozen parameters are not saved there); "
            "their trained values are not in this checkpoint."
        )
    return state


_DS_SKIP_GROUP_KEYS = frozenset({"params", "bias_correction"})  # DeepSpeed CPU Adam only: torch Adam always corrects


def read_optimizer_state(info: CheckpointInfo) -> dict[str, Any]:
    """Adam's per-parameter state from a DeepSpeed ZeRO folder, in torch's one-device per-index form: each state
    key's flat partitions (one per rank and param group) put through DeepSpeed's own ``zero_to_fp32``
    reconstruction, as the fp32 masters are, numbered group by group in the recorded order. Reads the optimizer
    files with ``weights_only=False`` (DeepSpeed objects): only for folders you trust."""
    from deepspeed.utils import zero_to_fp32 as z

    assert info.tag is not None
    folder = info.path / info.tag
    with deepspeed_quietly():
        model_states = z.parse_model_states(z.get_model_state_files(str(folder)))
        files = z.get_optim_files(str(folder))
        parts = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
    stage = int(parts[0]["zero_stage"])
    # the host optimizer over each rank's flat partitions (ZeRO-1/2: base_optimizer_state; ZeRO-3: optimizer_state_dict)
    base = [p.get("base_optimizer_state") or p["optimizer_state_dict"] for p in parts]
    n_groups = len(model_states[0].param_shapes)  # the user's param groups (ZeRO-1/2 keep one flat group each)
    if stage == 3 and len(base[0]["param_groups"]) != n_groups:
        raise ResumeError(
            f"{info.path}: a ZeRO-3 DeepSpeed folder whose optimizer holds {len(base[0]['param_groups'])} sub-groups "
            f"for {n_groups} param groups; the files do not say which sub-group belongs to which group (their "
            "hyper-parameters, such as weight decay, may differ). Fix: resume it with lp_zero_offload at ZeRO-3, or "
            "save with a sub_group_size at least the model's parameter count."
        )
    first = base[0]["state"][min(base[0]["state"])] if base[0]["state"] else {}
    keys = [k for k, v in first.items() if isinstance(v, Tensor) and v.dim() == 1]
    step = first.get("step", base[0]["param_groups"][0].get("step", 0))
    per_key: dict[str, dict[str, Tensor]] = {}
    for key in keys:
        if stage <= 2:
            flat = [[b["state"][g][key] for g in range(n_groups)] for b in base]
            paddings = parts[0].get("param_alignment_paddings")
            with deepspeed_quietly():
                rebuilt = z._get_fp32_state_dict_from_zero2_checkpoint(len(parts), flat, model_states, True, paddings)
        else:  # one flat partition per sub-group, in the host optimizer's order
            flat3 = [[b["state"][i][key] for i in sorted(b["state"])] for b in base]
            with deepspeed_quietly():
                rebuilt = z.to_torch_tensor(  # ZeRO-3 returns lazily gathered tensors
                    z._get_fp32_state_dict_from_zero3_checkpoint(len(parts), flat3, model_states, True))
        per_key[key] = {k: v.detach().clone() for k, v in rebuilt.items()}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for g, shapes in enumerate(model_states[0].param_shapes):
        ids = []
        for name in shapes:
            state[index] = {key: per_key[key][name] for key in keys}
            state[index]["step"] = torch.tensor(float(step))
            ids.append(index)
            index += 1
        saved = base[0]["param_groups"][min(g, len(base[0]["param_groups"]) - 1)]
        groups.append({**{k: v for k, v in saved.items() if k not in _DS_SKIP_GROUP_KEYS and k != "step"},
                       "params": ids})
    return {"state": state, "param_groups": groups}


def convert_to_fp32_state_dict(checkpoint_dir: str | Path, output_file: str | Path | None = None, *,
                               tag: str = DEEPSPEED_DEFAULT_TAG) -> dict[str, Tensor]:
    """One fp32 state dict (keyed as ``module.state_dict()``) from a ZeRO checkpoint folder, loadable on one device.

    Parameters come from the NVMe state files when the folder has them (DeepSpeed's own files hold no NVMe-offloaded
    values), else from DeepSpeed's ``zero_to_fp32`` reconstruction of the rank partitions; buffers from the engine's
    model-states file. ``output_file`` (optional) receives ``{"state_dict": ...}`` (``torch.load`` it on one device).
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = Path(checkpoint_dir)
    nvme = folder / NVME_STATE_DIR
    if nvme.is_dir():
        state = assemble_nvme_states(nvme)
        model_file = next(iter(sorted((folder / tag).glob(DEEPSPEED_MODEL_STATES_GLOB))), None)
        if model_file is not None:  # buffers: named at the file's top level, their values in its "module" dict
            saved = torch.load(model_file, map_location="cpu", weights_only=False)
            module = saved.get("module") or {}
            for name in saved.get("buffer_names") or []:
                if name in module:
                    state.setdefault(name, module[name])
    else:
        with deepspeed_quietly():
            state = dict(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag))
    if output_file is not None:
        torch.save({"state_dict": state}, output_file)
    return state
