#!/usr/bin/env bash
# Set up (see scripts/_env.sh) and run the whole test suite. Extra arguments go to pytest.
export LP_BUILD_DEEPSPEED_OPS=1  # the offload tests need DeepSpeed's ops: build them in the set-up, not in a test
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
start=$(date +%s)
status=0
OMP_NUM_THREADS=1 "$PY" -m pytest -q -p no:cacheprovider --durations=10 "$@" || status=$?
echo "[test] wall time $(( $(date +%s) - start )) s"
exit $status
