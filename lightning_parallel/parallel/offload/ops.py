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
    "BUILD_WAIT_SECONDS",
    "COLD_BUILD_SECONDS",
    "LIBAIO_HELP",
    "OpsUnavailableError",
    "ensure_ops",
    "libaio_available",
    "missing_ops",
    "op_is_built",
    "required_ops",
    "settle_lock",
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
    """True when the op is installed with DeepSpeed, or its JIT build is cached in ``TORCH_EXTENSIONS_DIR`` *for this
    environment*: torch rebuilds a cached op whose build file names another torch or DeepSpeed (another virtual
    environment sharing the cache folder), so such a cache counts as not built -- otherwise the set-up would report
    "cached" and the build would happen later, inside a run or a test."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(name, False):
        return True
    folder = _build_dir(name)
    return (folder / f"{name}.so").is_file() and _built_for_this_environment(folder) and _ninja_up_to_date(folder)


def _ninja_up_to_date(folder: Path) -> bool:
    """ninja's own answer for the cached build (``ninja -n``: "no work to do"): torch's loader runs ninja, which
    rebuilds when a source or header is newer than the build -- as in every freshly installed virtual environment,
    even at the same path. True when there is no build file or no ninja to ask."""
    import shutil
    import subprocess

    ninja = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
    if not (folder / "build.ninja").is_file() or not Path(ninja).is_file():
        return True
    try:
        out = subprocess.run([ninja, "-C", str(folder), "-n"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return True
    return out.returncode == 0 and "no work to do" in out.stdout


def _built_for_this_environment(folder: Path) -> bool:
    """The cached build in ``folder`` was made against this process's torch and DeepSpeed (its ``build.ninja`` links
    this torch's library folder and includes this DeepSpeed's sources); a cache without ``build.ninja`` is trusted."""
    ninja = folder / "build.ninja"
    if not ninja.is_file():
        return True
    import deepspeed
    import torch

    text = ninja.read_text(errors="replace")

    def named(module_file: str, template: str, sub: str = "") -> bool:  # as imported or with links resolved
        paths = {Path(module_file).parent, Path(module_file).resolve().parent}
        return any(template.format(path / sub if sub else path) in text for path in paths)

    return named(torch.__file__, "-L{}", "lib") and named(deepspeed.__file__, "{}")


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


BUILD_WAIT_SECONDS = float(os.environ.get("LP_OPS_BUILD_TIMEOUT", 1800))
"""How long to wait for another live process's build of an op before giving up (``LP_OPS_BUILD_TIMEOUT``)."""
_OWNER = "lock.lp_owner"
_STALE_AFTER = 60.0


def _compiling_in(folder: Path) -> list[int]:
    """Pids of processes whose working directory is ``folder`` (ninja and the compiler run there); Linux only."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(entry / "cwd")) == folder:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def settle_lock(name: str, *, report: Callable[[str], None] | None = None, timeout: float | None = None,
                poll: float = 2.0) -> None:
    """Before building ``name``: torch's build lock (``<build dir>/lock``) left by a build that was killed makes
    every later build wait forever. Remove it when no builder is alive -- the pid lightning-parallel recorded is gone,
    or (no record) nothing has compiled in the folder for a minute -- saying so; wait for a live builder up to
    ``timeout`` seconds (:data:`BUILD_WAIT_SECONDS`), reporting every 30 s, then raise :class:`OpsUnavailableError`
    naming the folder and the lock to delete."""
    from lightning_parallel.parallel.faults.watchdog import process_alive  # a zombie counts as gone

    say = report or _say
    folder = _build_dir(name)
    lock, owner_file = folder / "lock", folder / _OWNER
    limit = BUILD_WAIT_SECONDS if timeout is None else timeout
    start = last_report = time.monotonic()
    while lock.exists():
        owner = None
        try:
            owner = int(owner_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
        compiling = _compiling_in(folder)
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:
            continue  # the builder just finished
        dead_owner = owner is not None and not process_alive(owner) and not compiling
        orphan = owner is None and not compiling and age > _STALE_AFTER
        if dead_owner or orphan:
            why = (f"its builder, pid {owner}, is no longer running" if dead_owner else
                   f"no process has compiled in {folder} and the lock is {age:.0f} s old")
            lock.unlink(missing_ok=True)
            owner_file.unlink(missing_ok=True)
            say(f"removed a stale build lock {lock} ({why}: a build killed midway); building {name!r} again")
            return
        waited = time.monotonic() - start
        if waited > limit:
            raise OpsUnavailableError(
                f"DeepSpeed op {name!r}: another build (pid {owner if owner else 'unknown'}; compiling: "
                f"{compiling or 'none seen'}) has held {lock} for {waited:.0f} s (LP_OPS_BUILD_TIMEOUT={limit:.0f}). "
                f"Its files and ninja log are in {folder}. Fix: wait for it, or if no build is running, delete {lock}."
            )
        if time.monotonic() - last_report >= 30:
            say(f"waiting for another process's build of {name!r} (pid {owner or 'unknown'}, {waited:.0f} s so far; "
                f"folder {folder})")
            last_report = time.monotonic()
        time.sleep(poll)


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
        settle_lock(name, report=report)
        start = time.perf_counter()
        owner_file = _build_dir(name) / _OWNER
        try:
            owner_file.parent.mkdir(parents=True, exist_ok=True)
            owner_file.write_text(f"{os.getpid()} {os.uname().nodename}\n")
            builder.load(verbose=False)
        except Exception as err:  # a compiler error: say which op and what to do
            raise OpsUnavailableError(
                f"building DeepSpeed op {name!r} failed: {err}. Fix: install a C++ compiler and ninja "
                "(`pip install ninja`), or preinstall the op (DS_BUILD_OPS=1 pip install deepspeed)."
            ) from err
        finally:
            owner_file.unlink(missing_ok=True)
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
