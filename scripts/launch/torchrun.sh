#!/usr/bin/env bash
# Launch `lightning-parallel fit --config RECIPE [extra args]` on THIS node with torchrun. Run it once per node, with
# the same options everywhere except the node rank:
#
#   node 0:  scripts/launch/torchrun.sh --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr node0 recipes/X.yaml
#   node 1:  scripts/launch/torchrun.sh --nnodes 2 --nproc-per-node 8 --node-rank 1 --master-addr node0 recipes/X.yaml
#
# torchrun starts the ranks (one per GPU); Lightning sees the torchelastic environment (RANK, WORLD_SIZE, ...) and
# starts no process of its own. The script passes --trainer.num_nodes and --trainer.devices equal to the launch, so
# the recipe's layout is resolved against the real world size (nnodes x nproc-per-node). `--help` for the options.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/launch/torchrun.sh [OPTIONS] RECIPE [EXTRA FIT ARGS...]

Runs `lightning-parallel fit --config RECIPE --trainer.num_nodes NNODES --trainer.devices NPROC [EXTRA FIT ARGS]`
under torchrun on this node (static rendezvous at MASTER_ADDR:MASTER_PORT). Run it on every node; only
--node-rank differs.

Options (each falls back to the environment variable in brackets, then to the default):
  --nnodes N            number of nodes                        [NNODES]          default 1
  --nproc-per-node N    ranks on this node (one per GPU)       [GPUS_PER_NODE, NPROC_PER_NODE]
                        default: the GPUs nvidia-smi lists, else 1 (CPU: say how many processes)
  --node-rank R         this node's rank, 0 .. NNODES-1        [NODE_RANK]       default 0
  --master-addr HOST    address of node 0, reachable by all    [MASTER_ADDR]     default 127.0.0.1
  --master-port PORT    free TCP port on node 0                [MASTER_PORT]     default 29500
  --python PATH         the Python that has lightning_parallel [LP_PYTHON]
                        default: $VIRTUAL_ENV/bin/python, else this repository's .venv, else python3
  --dry-run             print the torchrun command and exit
  -h, --help            this text

Extra arguments after RECIPE go to `lightning-parallel fit` (e.g. --trainer.max_steps 100). Do not pass
--trainer.devices or --trainer.num_nodes there: they come from --nproc-per-node and --nnodes.
The collective timeout (how long ranks wait for a lost peer) is the strategy's `timeout`, e.g.
  --trainer.strategy lightning_parallel.LPDDPStrategy --trainer.strategy.init_args.timeout 0:05:00

Examples:
  # 2 nodes x 8 GPUs
  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 GPUS_PER_NODE=8 scripts/launch/torchrun.sh recipes/gpt_zero2.yaml
  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 GPUS_PER_NODE=8 scripts/launch/torchrun.sh recipes/gpt_zero2.yaml
  # one machine, 2 CPU processes
  scripts/launch/torchrun.sh --nproc-per-node 2 recipes/quickstart.yaml --trainer.max_steps 20
EOF
}

die() { echo "torchrun.sh: error: $*" >&2; echo "(scripts/launch/torchrun.sh --help for the options)" >&2; exit 2; }

int_arg() {  # name value: the value must be a non-negative integer
  [[ "$2" =~ ^[0-9]+$ ]] || die "$1 must be a non-negative integer, got '$2'"
}

count_gpus() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi -L | grep -c '^GPU' || true
  else
    echo 0
  fi
}

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
nnodes="${NNODES:-1}"
nproc="${GPUS_PER_NODE:-${NPROC_PER_NODE:-}}"
node_rank="${NODE_RANK:-0}"
master_addr="${MASTER_ADDR:-127.0.0.1}"
master_port="${MASTER_PORT:-29500}"
python="${LP_PYTHON:-}"
dry_run=0

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --nnodes) [ $# -ge 2 ] || die "$1 needs a value"; nnodes="$2"; shift 2 ;;
    --nnodes=*) nnodes="${1#*=}"; shift ;;
    --nproc-per-node|--nproc_per_node|--gpus-per-node) [ $# -ge 2 ] || die "$1 needs a value"; nproc="$2"; shift 2 ;;
    --nproc-per-node=*|--nproc_per_node=*|--gpus-per-node=*) nproc="${1#*=}"; shift ;;
    --node-rank|--node_rank) [ $# -ge 2 ] || die "$1 needs a value"; node_rank="$2"; shift 2 ;;
    --node-rank=*|--node_rank=*) node_rank="${1#*=}"; shift ;;
    --master-addr|--master_addr) [ $# -ge 2 ] || die "$1 needs a value"; master_addr="$2"; shift 2 ;;
    --master-addr=*|--master_addr=*) master_addr="${1#*=}"; shift ;;
    --master-port|--master_port) [ $# -ge 2 ] || die "$1 needs a value"; master_port="$2"; shift 2 ;;
    --master-port=*|--master_port=*) master_port="${1#*=}"; shift ;;
    --python) [ $# -ge 2 ] || die "$1 needs a value"; python="$2"; shift 2 ;;
    --python=*) python="${1#*=}"; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    -*) die "unknown option '$1' (options come before the recipe)" ;;
    *) break ;;
  esac
done

[ $# -ge 1 ] || { usage >&2; die "no recipe given"; }
recipe="$1"; shift
[ -f "$recipe" ] || die "recipe '$recipe' is not a file"
for arg in "$@"; do
  case "$arg" in
    --trainer.devices|--trainer.devices=*|--trainer.num_nodes|--trainer.num_nodes=*)
      die "'$arg': the launch sets --trainer.devices and --trainer.num_nodes (use --nproc-per-node / --nnodes)" ;;
  esac
done

if [ -z "$nproc" ]; then
  nproc="$(count_gpus)"
  [ "$nproc" -ge 1 ] 2>/dev/null || nproc=1
fi
int_arg --nnodes "$nnodes"; int_arg --nproc-per-node "$nproc"; int_arg --node-rank "$node_rank"
int_arg --master-port "$master_port"
[ "$nnodes" -ge 1 ] || die "--nnodes must be >= 1"
[ "$nproc" -ge 1 ] || die "--nproc-per-node must be >= 1"
[ "$node_rank" -lt "$nnodes" ] || die "--node-rank $node_rank must be < --nnodes $nnodes"

if [ -z "$python" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    python="$VIRTUAL_ENV/bin/python"
  elif [ -x "$REPO/.venv/bin/python" ]; then
    python="$REPO/.venv/bin/python"
  else
    python="$(command -v python3 || command -v python || true)"
  fi
fi
[ -n "$python" ] && [ -x "$(command -v "$python" || true)" ] || die "no Python found (set LP_PYTHON or --python)"

# torchrun is `python -m torch.distributed.run`; the workers run `python -m lightning_parallel` (the CLI's module).
cmd=("$python" -m torch.distributed.run
     --nnodes "$nnodes" --nproc-per-node "$nproc" --node-rank "$node_rank"
     --master-addr "$master_addr" --master-port "$master_port"
     -m lightning_parallel fit --config "$recipe" "$@"
     --trainer.num_nodes "$nnodes" --trainer.devices "$nproc")

echo "[torchrun.sh] node $node_rank/$nnodes: $nproc rank(s) here, world size $((nnodes * nproc)), rendezvous" \
     "$master_addr:$master_port" >&2
if [ "$dry_run" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
