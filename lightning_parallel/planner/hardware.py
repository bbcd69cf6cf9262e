"""The machines a plan is for: devices per node, nodes, memory, links; and the profiles in ``configs/hardware``.

Link kinds have rough per-device default speeds (bytes/s, :data:`~lightning_parallel.planner.rates.LINK_BANDWIDTH`):
NVLink/NVSwitch 150e9, PCIe between devices 12e9, a fast inter-node fabric (100-200 Gb/s InfiniBand per GPU) 12.5e9,
a slow one (10-25 Gb/s Ethernet shared by the node) 1.25e9, host <-> device 12e9, NVMe 3e9 per node. A profile's
``rates:`` section (or a calibration of the machine) replaces them in the step-time model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from lightning_parallel.planner.rates import LINK_BANDWIDTH, rates_from_dict
from lightning_parallel.planner.units import format_bytes, parse_bytes

__all__ = [
    "DEFAULT_RESERVED",
    "LINK_BANDWIDTH",
    "Hardware",
    "InterNode",
    "IntraNode",
    "hardware_profile_dir",
    "list_profiles",
    "load_profile",
    "make_hardware",
]

IntraNode = Literal["nvlink", "pcie"]
InterNode = Literal["fast", "slow"]
Accelerator = Literal["gpu", "cpu", "auto"]

DEFAULT_RESERVED = 2**30
"""The largest default runtime allowance per accelerator (1 GiB)."""




@dataclass(frozen=True)
class Hardware:
    """A cluster of identical nodes."""

    gpus_per_node: int = 1
    """Devices per node."""
    nodes: int = 1
    """Nodes."""
    gpu_memory: int = 80 * 2**30
    """Bytes of memory per device."""
    intra_node: IntraNode = "nvlink"
    """Link between devices of a node: nvlink (NVLink/NVSwitch) or pcie."""
    inter_node: InterNode = "fast"
    """Link between nodes: fast (InfiniBand-class) or slow (Ethernet-class)."""
    cpu_memory_per_node: int = 512 * 10**9
    """Bytes of host memory per node (what ZeRO-offload can use)."""
    nvme: bool = False
    """A fast local NVMe disk is present (ZeRO-Infinity offload)."""
    reserved_memory: int | None = None
    """Bytes per device the runtime takes before training (CUDA context, kernels, workspaces); None: the scaled
    default :attr:`reserved` states."""
    peak_tflops: float = 100.0
    """Peak 16-bit dense TFLOP/s per device (fp32 runs are taken at 1/4 of it); the step-time model's default rates
    derive from it when the profile has no ``rates:`` section."""
    accelerator: Accelerator = "auto"
    """What a written recipe puts in ``trainer.accelerator``."""
    name: str = "custom"
    """Profile name, 'detected' (the machine found at launch), or 'custom'."""
    rates: Any = field(default=None, compare=False, hash=False, repr=False)
    """Measured or vendor rates (:class:`lightning_parallel.planner.rates.Rates`, or the profile's ``rates:`` mapping
    it is read from); None: the calibration of this machine (when detected) or defaults from ``peak_tflops``."""

    def __post_init__(self) -> None:
        for key in ("gpus_per_node", "nodes", "gpu_memory", "cpu_memory_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hardware {key}={value!r} must be a positive integer.")
        if self.intra_node not in get_args(IntraNode):
            raise ValueError(f"--intra-node {self.intra_node!r}: use nvlink (NVLink/NVSwitch) or pcie.")
        if self.inter_node not in get_args(InterNode):
            raise ValueError(f"--inter-node {self.inter_node!r}: use fast (InfiniBand-class) or slow (Ethernet-class).")
        if self.accelerator not in get_args(Accelerator):
            raise ValueError(f"accelerator={self.accelerator!r}: use gpu, cpu or auto.")
        if isinstance(self.rates, dict):
            object.__setattr__(self, "rates", rates_from_dict(self.rates, source=f"profile {self.name}"))

    @property
    def reserved(self) -> int:
        """The runtime's allowance per device: ``reserved_memory`` when given, else nothing on CPU and
        min(1 GiB, 5 % of the device's memory) on accelerators (a CUDA context and workspaces take 0.3-1 GB on a
        large GPU; a small budget gets a proportionate share instead of a fixed GiB that would dwarf it)."""
        if self.reserved_memory is not None:
            return self.reserved_memory
        return 0 if self.accelerator == "cpu" else min(DEFAULT_RESERVED, self.gpu_memory // 20)

    def reserved_text(self) -> str:
        """Where :attr:`reserved` comes from, for the report."""
        if self.reserved_memory is not None:
            return f"{format_bytes(self.reserved)} (given)"
        if self.accelerator == "cpu":
            return "0 B (default on CPU: no device runtime)"
        return (f"{format_bytes(self.reserved)} (default: min(1 GiB, 5% of {format_bytes(self.gpu_memory)}); "
                "--reserved-memory to change)")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        inter = f", {self.inter_node} inter-node" if self.nodes > 1 else ""
        return (
            f"{self.nodes} node(s) x {self.gpus_per_node} device(s) of {format_bytes(self.gpu_memory)}, "
            f"{self.intra_node} intra-node{inter}, {format_bytes(self.cpu_memory_per_node)} host memory per node, "
            f"NVMe {'yes' if self.nvme else 'no'}"
        )


def hardware_profile_dir() -> Path:
    """``configs/hardware`` of the source tree this package sits in."""
    return Path(__file__).resolve().parents[2] / "configs" / "hardware"


def list_profiles() -> list[str]:
    folder = hardware_profile_dir()
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


_SIZE_KEYS = ("gpu_memory", "cpu_memory_per_node", "reserved_memory")


def load_profile(name_or_path: str, **overrides: Any) -> Hardware:
    """A profile by name (``dgx-a100-80gb``) or path; sizes may be strings (``80GiB``); overrides win."""
    path = Path(name_or_path)
    if not path.is_file():
        path = hardware_profile_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(
            f"--hardware {name_or_path!r}: no such profile. Available: {', '.join(list_profiles()) or 'none'} "
            f"(files in {hardware_profile_dir()}), or give the path of a YAML file."
        )
    data = yaml.safe_load(path.read_text()) or {}
    valid = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(f"hardware profile {path}: unknown keys {unknown}. Valid keys: {sorted(valid)}.")
    data.setdefault("name", path.stem)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return make_hardware(**data)


def make_hardware(**values: Any) -> Hardware:
    """A :class:`Hardware` from loose values: sizes as strings (``32GB``) or bytes."""
    for key in _SIZE_KEYS:
        if values.get(key) is not None and not (key == "reserved_memory" and values[key] in (0, "0")):
            values[key] = parse_bytes(values[key], name=key)
    return Hardware(**{k: v for k, v in values.items() if v is not None})
