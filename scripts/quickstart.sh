#!/usr/bin/env bash
# Set up (see scripts/_env.sh) and run the main job: the reference GPT on the embedded corpus with lp_ddp on
# 2 processes. Extra arguments are passed to `lightning-parallel fit` (e.g. --trainer.max_steps 50).
export LP_SKIP_DEEPSPEED="${LP_SKIP_DEEPSPEED:-1}"  # lp_ddp does not use DeepSpeed: no install, no op build
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
start=$(date +%s)
"$VENV/bin/lightning-parallel" fit --config recipes/quickstart.yaml "$@"
echo "[quickstart] wall time $(( $(date +%s) - start )) s"
