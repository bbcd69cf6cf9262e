"""DeepSpeed's C++ ops: which ones a configuration needs, whether they are built, and building them out loud.

DeepSpeed compiles its ops with ninja the first time a process uses them and caches the result in
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``); later processes load the cached ``.so`` in
well under a second. Measured cold on 2 shared CPU cores (deepspeed 0.19.8, torch 2.13 CPU): the CPU
accelerator's shared-memory collective op ~45 s (every ``deepspeed.init_distributed`` on CPU loads it), CPU Adam
~65-90 s (optimizer offload), ``pin_memory`` + ``async_io`` (NVMe offload, needs libaio) ~4-5 min. A silent minute
looks like a hang, so :func:`ensure_ops` says what it builds, where it caches it and how long it took; it runs in
the launching process before the ranks start, so the ranks only load.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = [
    "COLD_BUILD_SECONDS",
    "LIBAIO_HELP",
    "OpsUnavailableError",
    "ensure_ops",
    "libaio_available",
    "missing_ops",
    "op_is_built",
    "required_ops",
]

COLD_BUILD_SECONDS = {"deepspeed_shm_comm": 45, "cpu_adam": 65, "pin_memory": 20, "async_io": 260}
"""First-build cost per op measured on 2 CPU cores (what the progress message announces)."""

LIBAIO_HELP = (
    "NVMe offload needs DeepSpeed's async_io op, which links against libaio, and libaio's development files were "
    "not found. Fix: install them (Debian/Ubuntu: `apt-get install libaio-dev`; RHEL/Fedora: `yum install "
    "libaio-devel`; Arch: `pacman -S libaio`), or, if libaio is installed elsewhere, point CFLAGS/LDFLAGS at it; "
    "or use offload='cpu'."
)


class OpsUnavailableError(RuntimeError):
    """A DeepSpeed op this configuration needs cannot be built on this machine."""


# op name -> DeepSpeed builder class name (resolved through the current accelerator)
_BUILDERS = {
    "deepspeed_shm_comm": "ShareMemCommBuilder",
    "cpu_adam": "CPUAdamBuilder",
    "pin_memory": "PinMemoryBuilder",
    "async_io": "AsyncIOBuilder",
}


def required_ops(*, accelerator: str, offload_optimizer: str, offload_param: str) -> list[str]:
    """The ops a run loads, in build order: the CPU collective op (CPU accelerator), CPU Adam (optimizer offload),
    pin_memory and async_io (any NVMe offload)."""
    ops: list[str] = []
    if accelerator == "cpu":
        ops.append("deepspeed_shm_comm")
    if offload_optimizer != "none":
        ops.append("cpu_adam")
    if "nvme" in (offload_optimizer, offload_param):
        ops += ["pin_memory", "async_io"]
    return ops


def _build_dir(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def op_is_built(name: str) -> bool:
    """True when the op is installed with DeepSpeed or its JIT build is cached in ``TORCH_EXTENSIONS_DIR``."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(name, False):
        return True
    return (_build_dir(name) / f"{name}.so").is_file()


def missing_ops(names: Iterable[str]) -> list[str]:
    """The ops of ``names`` not built yet."""
    return [n for n in names if not op_is_built(n)]


def libaio_available() -> bool:
    """True when DeepSpeed's async_io op is built already, or libaio's headers and library can be linked."""
    if op_is_built("async_io"):
        return True
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and bool(builder.is_compatible(verbose=False))


def _say(message: str) -> None:
    print(f"[lp_zero_offload] {message}", file=sys.stderr, flush=True)


def ensure_ops(names: Iterable[str], *, report: Callable[[str], None] = _say) -> dict[str, float]:
    """Build (or load) each op of ``names``; report every build with its cache folder and its time.

    Returns ``{op: seconds}`` for the ops that had to be built. Raises :class:`OpsUnavailableError` when an op
    cannot be built here (no libaio for async_io, no compiler, no ninja), with the fix.
    """
    from deepspeed.accelerator import get_accelerator

    built: dict[str, float] = {}
    for name in names:
        if op_is_built(name):
            continue
        if name == "async_io" and not libaio_available():
            raise OpsUnavailableError(LIBAIO_HELP)
        builder = get_accelerator().create_op_builder(_BUILDERS[name])
        if builder is None:
            raise OpsUnavailableError(f"DeepSpeed's accelerator {get_accelerator()._name!r} has no {name} op.")
        where = os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")
        report(f"building DeepSpeed op {name!r} (first use on this machine; about "
               f"{COLD_BUILD_SECONDS.get(name, 60)} s on 2 cores; cached in {where})...")
        start = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as err:  # a compiler error: say which op and what to do
            raise OpsUnavailableError(
                f"building DeepSpeed op {name!r} failed: {err}. Fix: install a C++ compiler and ninja "
                "(`pip install ninja`), or preinstall the op (DS_BUILD_OPS=1 pip install deepspeed)."
            ) from err
        built[name] = time.perf_counter() - start
        report(f"built {name!r} in {built[name]:.0f} s")
    return built


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_parallel.parallel.offload.ops [op ...]``: build DeepSpeed's ops ahead of use (default:
    the CPU collective op and CPU Adam, plus pin_memory and async_io where libaio is available)."""
    args = list(sys.argv[1:] if argv is None else argv)
    names = args or required_ops(accelerator="cpu", offload_optimizer="cpu", offload_param="none")
    if not args and libaio_available():
        names += ["pin_memory", "async_io"]
    start = time.perf_counter()
    built = ensure_ops(names)
    _say(f"ops ready in {time.perf_counter() - start:.0f} s (built: {sorted(built) or 'none, all cached'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
