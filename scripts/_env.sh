# Shared set-up for scripts/quickstart.sh and scripts/test.sh (sourced, not run). LP_SKIP_DEEPSPEED=1 skips DeepSpeed
# (lp_zero_offload) and its ops; the quick start sets it, since its lp_ddp run does not use DeepSpeed.
#
# Works on a fresh machine: creates .venv (or uses $LP_VENV, or the virtual environment already active), installs
# torch only if it is missing, then the package with its dev extras.
#   * A torch that is already importable (a GPU user's own CUDA build) is never touched.
#   * No torch and an NVIDIA GPU (nvidia-smi lists one): the default torch from the package index (CUDA build).
#   * No torch and no GPU: a CPU build, pinned to $LP_TORCH_VERSION (default 2.13.0), so pip does not pull a
#     multi-GB CUDA build onto a CPU-only machine. Where the index serves CUDA builds by default, point pip at a
#     CPU wheel index with LP_TORCH_INDEX_URL (for example PyTorch's own CPU index).
# Re-runs skip the install when pyproject.toml has not changed (stamp file in the venv).
set -euo pipefail

LP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$LP_ROOT"

lp_python() {
  for candidate in python3.12 python3.11 python3.10 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "lightning-parallel: Python >= 3.10 is required and none was found on PATH" >&2
  return 1
}

if [ -n "${LP_VENV:-}" ]; then
  VENV="$LP_VENV"
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  VENV="$VIRTUAL_ENV"
else
  VENV="$LP_ROOT/.venv"
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$(lp_python)" -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] no torch in $VENV; NVIDIA GPU found: installing the default (CUDA) torch"
    "$PY" -m pip install --quiet torch
  else
    spec="torch==${LP_TORCH_VERSION:-2.13.0}"
    echo "[setup] no torch in $VENV and no GPU: installing the CPU build $spec"
    if [ -n "${LP_TORCH_INDEX_URL:-}" ]; then
      "$PY" -m pip install --quiet "$spec" --index-url "$LP_TORCH_INDEX_URL"
    else
      "$PY" -m pip install --quiet "$spec"
    fi
  fi
fi

stamp="$VENV/.lightning-parallel-installed"
want="$(cat pyproject.toml | cksum) $LP_ROOT"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing lightning-parallel (editable) with its dev extras into $VENV"
  "$PY" -m pip install --quiet -e ".[dev]"
  echo "$want" > "$stamp"
fi
# DeepSpeed (lp_zero_offload): its sdist imports torch while building, so it is built against the torch installed
# above (--no-build-isolation, never a second torch) in a step of its own. LP_SKIP_DEEPSPEED=1 skips it and the
# offload tests then skip with that reason. Its C++ ops compile on first use (announced; cached in
# TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions: keep that folder between CI runs to skip the compile).
if [ -z "${LP_SKIP_DEEPSPEED:-}" ]; then
  if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("deepspeed") is None)'; then
    echo "[setup] installing DeepSpeed (lp_zero_offload), built against the installed torch"
    "$PY" -m pip install --quiet setuptools wheel ninja packaging
    "$PY" -m pip install --quiet --no-build-isolation "deepspeed>=0.16" ||
      echo "[setup] WARNING: DeepSpeed did not install; lp_zero_offload and its tests are unavailable"
  fi
  # NVMe offload needs libaio's headers (DeepSpeed's async_io op). Installed here only as root on Debian/Ubuntu;
  # elsewhere the NVMe tests skip and say why.
  if command -v dpkg >/dev/null 2>&1 && ! dpkg -s libaio-dev >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "[setup] installing libaio-dev (NVMe offload)"
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev; } >/dev/null 2>&1 ||
        echo "[setup] libaio-dev could not be installed: the NVMe offload tests will be skipped"
    else
      echo "[setup] libaio-dev is missing (needs root: apt-get install libaio-dev): NVMe offload tests will be skipped"
    fi
  fi
fi
# DeepSpeed compiles its C++ ops the first time a process uses them (minutes on a small machine: CPU collective op,
# CPU Adam, and pin_memory + async_io for NVMe). For the test suite (LP_BUILD_DEEPSPEED_OPS=1, set by scripts/test.sh)
# that happens here, announced, not inside a test under a per-test timeout: each build prints what it builds and how
# long it took; cached ones load in a second. The quick start (lp_ddp) neither installs DeepSpeed nor waits for it.
if [ -z "${LP_SKIP_DEEPSPEED:-}" ] && [ -n "${LP_BUILD_DEEPSPEED_OPS:-}" ] &&
   "$PY" -c 'import deepspeed' >/dev/null 2>&1; then
  "$PY" -c 'import sys; from lightning_parallel.parallel.offload.ops import main; sys.exit(main())' ||
    echo "[setup] WARNING: DeepSpeed's ops did not build; lp_zero_offload will try again (and say why) on first use"
fi
"$PY" -c 'import torch, lightning; print(f"[setup] torch {torch.__version__}, lightning {lightning.__version__}, cuda available: {torch.cuda.is_available()}")'
