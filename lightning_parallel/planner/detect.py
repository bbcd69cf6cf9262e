"""What ``lp_auto`` plans from: the hardware found at launch and the model's size read from the module.

Hardware (:func:`detect_hardware`), each value found, then replaced by a ``--planner.hardware`` profile, then by a
``--planner.*`` key:

* devices per node: ``trainer.devices`` (``auto``: the accelerator's device count; 1 on CPU, as Lightning counts);
  nodes: ``trainer.num_nodes``. ``--planner.nodes`` re-reads the same devices as that many simulated nodes (the run
  keeps its processes; only the plan, the mesh order included, sees nodes).
* memory per device: the accelerator's total memory; on CPU each rank's share of the host's RAM (ranks share it).
* link inside a node: ``nvidia-smi topo -m`` where it runs (an ``NV#`` entry between two GPUs: nvlink, else pcie);
  CPU ranks exchange through shared memory, counted as the fast (nvlink-class) link. Between nodes: ``fast``.
* host memory per node: the RAM found; NVMe: a ``--planner.nvme_path`` folder, checked writable.
* reserved per device (CUDA context, kernels, workspaces): min(1 GiB, 5 % of its memory) on accelerators, nothing
  on CPU; ``--planner.reserved_memory``.

The model (:func:`model_spec_from_module`): a :class:`lightning_parallel.models.GPT` (or any module whose hyper-
parameters carry ``n_layer``, ``n_head``, ``n_embd``) gives its shape, so activations and pipeline cuts are counted;
any other module gives its parameter count and its largest layer (the module with the most parameters of its own).
Counting reads ``numel`` only: a module built under ``torch.device("meta")`` is counted without allocating anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from lightning_parallel.parallel.offload.config import check_nvme_folder
from lightning_parallel.planner.hardware import Hardware, load_profile, make_hardware
from lightning_parallel.planner.model import ModelShape, ModelSpec
from lightning_parallel.planner.units import format_bytes, parse_bytes

__all__ = ["PlannerOptions", "detect_hardware", "model_spec_from_module", "nvlink_from_topology"]

CPU_PEAK_TFLOPS = 0.2
"""A CPU rank's rough fp32 throughput, for ranking layouts only."""


@dataclass
class PlannerOptions:
    """The ``planner`` section of a recipe (``--planner.KEY`` on the command line): what ``lp_auto`` is told instead
    of what it finds. Sizes are strings such as ``8MB`` (10^6 bytes) or ``80GiB`` (2^30 bytes)."""

    gpu_memory: str | None = None
    """Memory budget per device (on CPU: per rank). Default: found."""
    hardware: str | None = None
    """A profile of ``configs/hardware`` (name or YAML path) read instead of the machine; the keys below still win."""
    nodes: int | None = None
    """Plan for this many nodes (the devices split evenly among them); default ``trainer.num_nodes``."""
    intra_node: str | None = None
    """nvlink or pcie. Default: ``nvidia-smi topo -m`` on GPUs; nvlink-class on CPU (shared memory)."""
    inter_node: str | None = None
    """fast (InfiniBand-class) or slow (Ethernet-class). Default: fast."""
    cpu_memory: str | None = None
    """Host memory per node (what offload can use). Default: found."""
    reserved_memory: str | None = None
    """Per-device memory the runtime takes before training. Default: 1GiB on GPUs, 0 on CPU."""
    nvme_path: str | None = None
    """A folder on a fast local disk: allows ZeRO-Infinity (NVMe) offload layouts, which put their files there."""
    optimizer: str = "adamw"
    """The module's optimizer, for its bytes of state: adamw, adam, sgd-momentum or sgd."""
    activation_checkpointing: str = "auto"
    """auto (try none, selective, full per layout), none, selective or full."""
    micro_batch_size: int | None = None
    """Sequences per device per micro-batch. Default: the data module's ``batch_size``."""
    seq_len: int | None = None
    """Tokens per sequence. Default: the data module's ``block_size``, else the model's."""
    select: str = "fastest"
    """fastest: the layout with the highest predicted throughput (within 5 %, the guide's order decides); guide: the
    first in the decision guide's order, whatever its speed."""
    calibration: str | None = None
    """Where the step-time model's rates come from for the machine found: cached (a calibration of this machine when
    one is cached, the default), now (calibrate first when none is), none (defaults from the profile's peak); default
    ``$LIGHTNING_PARALLEL_CALIBRATION``, else cached. A ``hardware`` profile with a ``rates:`` section uses those."""
    start_method: str | None = None
    """How the chosen strategy starts its ranks: popen (default; re-runs the command per rank), spawn or fork
    (cheapest from an already-imported process: notebooks, tests)."""

    @classmethod
    def from_any(cls, value: Any) -> PlannerOptions:
        """From a PlannerOptions, a mapping or a namespace (the CLI's parsed section); None gives the defaults."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        data = dict(value) if isinstance(value, dict) else dict(vars(value))
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ValueError(f"planner keys {unknown} are not known. Valid keys: {sorted(valid)}.")
        return cls(**data)

    def given(self) -> dict[str, Any]:
        """The keys set to something else than their default."""
        defaults = PlannerOptions()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(defaults, f.name)}


def nvlink_from_topology(text: str) -> bool | None:
    """Read ``nvidia-smi topo -m``: True when two GPUs are joined by NVLink (an ``NV<k>`` cell in a GPU row), False
    when the matrix has GPU rows but none, None when there is no matrix."""
    rows = [line.split() for line in text.splitlines() if line.strip().startswith("GPU")]
    rows = [r for r in rows if len(r) > 1 and r[0][3:].isdigit()]
    if not rows:
        return None
    return any(cell.startswith("NV") and cell[2:].isdigit() for row in rows for cell in row[1:])


def _nvidia_topology() -> tuple[bool | None, str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi not found"
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"nvidia-smi topo -m failed ({err})"
    return nvlink_from_topology(out), "nvidia-smi topo -m"


def _accelerator_type(accelerator: str) -> str:
    """``cpu`` or the accelerator's device type (``cuda``, ...) for ``trainer.accelerator``."""
    name = str(accelerator).lower()
    if name == "cpu":
        return "cpu"
    if name in ("gpu", "cuda"):
        return "cuda"
    if name == "auto":
        current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return current.type if current is not None else "cpu"
    return name


def _devices_per_node(devices: Any, device_type: str) -> int:
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices == -1:
            return torch.accelerator.device_count() if device_type != "cpu" else os.cpu_count() or 1
        return devices
    if isinstance(devices, list | tuple):
        return len(devices)
    text = str(devices).strip()
    if text == "auto":
        return 1 if device_type == "cpu" else max(1, torch.accelerator.device_count())
    if text.lstrip("-").isdigit():
        return _devices_per_node(int(text), device_type)
    return len([p for p in text.split(",") if p.strip()])


def _host_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover - psutil comes with lightning's dependencies
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _device_memory(device_type: str) -> int:
    module = torch.get_device_module(device_type)
    return int(module.get_device_properties(0).total_memory)


def detect_hardware(
    *, accelerator: Any = "auto", devices: Any = "auto", num_nodes: int = 1, options: PlannerOptions | None = None
) -> tuple[Hardware, list[str]]:
    """The :class:`Hardware` to plan for, and one note per value saying where it came from (found / given)."""
    opts = options or PlannerOptions()
    device_type = _accelerator_type(accelerator)
    per_node = _devices_per_node(devices, device_type)
    nodes = int(num_nodes or 1)
    notes: list[str] = []
    world = per_node * nodes
    if opts.nodes is not None:
        if opts.nodes < 1 or world % opts.nodes:
            raise ValueError(f"--planner.nodes {opts.nodes}: the {world} devices (devices {per_node} x num_nodes "
                             f"{nodes}) do not split into {opts.nodes} equal nodes. Fix: a divisor of {world}.")
        nodes, per_node = opts.nodes, world // opts.nodes
        notes.append(f"nodes {nodes} x {per_node} devices (given: --planner.nodes; the run keeps its {world} "
                     "processes)")
    else:
        notes.append(f"nodes {nodes} x {per_node} devices (found: trainer.devices, trainer.num_nodes)")
    values: dict[str, Any] = {"gpus_per_node": per_node, "nodes": nodes, "accelerator": "cpu" if device_type == "cpu"
                              else "gpu"}
    if opts.hardware:
        profile = load_profile(opts.hardware)
        for key in ("gpu_memory", "intra_node", "inter_node", "cpu_memory_per_node", "reserved_memory", "peak_tflops",
                    "nvme"):
            values[key] = getattr(profile, key)
        values.update(rates=profile.rates, name=profile.name)
        notes.append(f"memory, links and host from profile {profile.name!r} (given: --planner.hardware)")
    else:
        host = _host_memory()
        values.update(cpu_memory_per_node=host, name="detected")
        if device_type == "cpu":
            values.update(gpu_memory=host // per_node, intra_node="nvlink", reserved_memory=0,
                          peak_tflops=CPU_PEAK_TFLOPS)
            notes.append(f"memory per device {format_bytes(host // per_node)} (found: {format_bytes(host)} of RAM "
                         f"shared by {per_node} CPU ranks); link nvlink-class (CPU ranks use shared memory); "
                         "reserved 0 (no device runtime)")
        else:
            values.update(gpu_memory=_device_memory(device_type))
            nvlink, source = _nvidia_topology() if device_type == "cuda" else (None, "no topology tool")
            values["intra_node"] = "pcie" if nvlink is False else "nvlink"
            link = {True: "nvlink", False: "pcie", None: "nvlink (assumed)"}[nvlink]
            notes.append(f"memory per device {format_bytes(values['gpu_memory'])} (found: {device_type}); link {link} "
                         f"({source}); reserved for the runtime: min(1 GiB, 5% of it)")
        values["inter_node"] = "fast"
        notes.append(f"host memory {format_bytes(host)} per node (found)")
    sizes = {"gpu_memory": opts.gpu_memory, "cpu_memory_per_node": opts.cpu_memory,
             "reserved_memory": opts.reserved_memory}
    for key, value in sizes.items():
        if value is not None:
            flag = "--planner.cpu_memory" if key == "cpu_memory_per_node" else f"--planner.{key}"
            values[key] = 0 if key == "reserved_memory" and str(value).strip() == "0" else parse_bytes(value, name=flag)
            notes.append(f"{key} {format_bytes(values[key])} (given: {flag})")
    for key, value in (("intra_node", opts.intra_node), ("inter_node", opts.inter_node)):
        if value is not None:
            values[key] = value
            notes.append(f"{key} {value} (given: --planner.{key})")
    if opts.nvme_path:
        check_nvme_folder(opts.nvme_path, key="--planner.nvme_path", create=False)
        values["nvme"] = True
        notes.append(f"NVMe folder {opts.nvme_path} (given: --planner.nvme_path)")
    return make_hardware(**values), notes


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def model_spec_from_module(module: nn.Module) -> tuple[ModelSpec, str]:
    """The planner's view of ``module`` and a sentence saying how it was read (numel only: meta modules work)."""
    params = _unique_params(module)
    counted = sum(p.numel() for p in params)
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    hp = getattr(module, "hparams", None)
    keys = ("n_layer", "n_head", "n_embd")
    if hp is not None and all(k in hp for k in keys):
        shape_args = {k: hp[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dropout",
                                         "bias", "tie_embeddings") if k in hp}
        shape = ModelShape(**shape_args)
        spec = ModelSpec.from_shape(shape, name=f"{type(module).__name__} L={shape.n_layer} h={shape.n_embd} "
                                    f"a={shape.n_head} V={shape.vocab_size}")
        if counted and counted != spec.n_params:  # a GPT-like module with layers of its own: trust the count
            spec = ModelSpec(n_params=counted, largest_layer_params=max(largest, spec.largest_layer_params or 0),
                             shape=shape, name=spec.name)
        how = f"{spec.n_params:,} parameters, largest layer {spec.largest_layer_params:,} (shape from hyperparameters)"
        return spec, how
    if counted == 0:
        raise ValueError(f"lp_auto: {type(module).__name__} has no parameters to plan for (it builds its layers in "
                         "configure_model?). Fix: build them in __init__ (under torch.device('meta') if large), or "
                         "name a strategy.")
    spec = ModelSpec.from_params(counted, largest_layer_params=largest or None, name=type(module).__name__)
    return spec, (f"{counted:,} parameters, largest layer {largest:,} (counted; no GPT shape, so activations are not "
                  "estimated)")
