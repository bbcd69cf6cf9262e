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
#
# Elastic (--elastic MIN:MAX): torchrun's elastic agent with a c10d rendezvous at --master-addr:--master-port; run
# the same command on every node (no --node-rank). A failure ends the world and the agents restart it on the nodes
# that are left (between MIN and MAX), up to --max-restarts times; each (re)start reads the world it got, resolves
# the layout again and resumes from the newest complete checkpoint (--ckpt_path last). docs/elastic.md.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/launch/torchrun.sh [OPTIONS] RECIPE [EXTRA FIT ARGS...]

Runs `lightning-parallel fit --config RECIPE --trainer.num_nodes NNODES --trainer.devices NPROC [EXTRA FIT ARGS]`
under torchrun on this node (static rendezvous at MASTER_ADDR:MASTER_PORT). Run it on every node; only
--node-rank differs.

Options (each falls back to the environment variable in brackets, then to the default):
  --nnodes N            number of nodes                        [NNODES]          default 1
  --elastic MIN:MAX     elastic: between MIN and MAX nodes (c10d rendezvous at --master-addr:--master-port,
                        restarts on the nodes left after a failure, resumes from the newest checkpoint)
                                                               [LP_ELASTIC_NODES]
  --max-restarts N      elastic: restarts of the world before the job fails   [MAX_RESTARTS]  default 3
  --rdzv-id ID          elastic: the job's name in the rendezvous, the same on every node
                                                               [RDZV_ID]         default lightning-parallel
  --rdzv-conf K=V,...   elastic: more c10d rendezvous settings (e.g. is_host=1 on the node that hosts the store);
                        defaults last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5
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
--trainer.devices or --trainer.num_nodes there: they come from --nproc-per-node and --nnodes (elastic: from the
world each restart gets). Elastic runs add --ckpt_path last unless you pass --ckpt_path, and stop a rank 15 s after
the rank it watches went silent (LP_WATCHDOG_PEER_TIMEOUT) so that a lost node ends the world within seconds.
The collective timeout (how long ranks wait for a lost peer) is the strategy's `timeout`, e.g.
  --trainer.strategy lightning_parallel.LPDDPStrategy --trainer.strategy.init_args.timeout 0:05:00

Examples:
  # 2 nodes x 8 GPUs
  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 GPUS_PER_NODE=8 scripts/launch/torchrun.sh recipes/gpt_zero2.yaml
  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 GPUS_PER_NODE=8 scripts/launch/torchrun.sh recipes/gpt_zero2.yaml
  # one machine, 2 CPU processes
  scripts/launch/torchrun.sh --nproc-per-node 2 recipes/quickstart.yaml --trainer.max_steps 20
  # elastic: 1 to 4 nodes of 8 GPUs, the same command on every node
  scripts/launch/torchrun.sh --elastic 1:4 --nproc-per-node 8 --master-addr node0 recipes/X.yaml
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
elastic="${LP_ELASTIC_NODES:-}"
max_restarts="${MAX_RESTARTS:-3}"
rdzv_id="${RDZV_ID:-lightning-parallel}"
rdzv_conf=""

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
    --elastic) [ $# -ge 2 ] || die "$1 needs a value"; elastic="$2"; shift 2 ;;
    --elastic=*) elastic="${1#*=}"; shift ;;
    --max-restarts|--max_restarts) [ $# -ge 2 ] || die "$1 needs a value"; max_restarts="$2"; shift 2 ;;
    --max-restarts=*|--max_restarts=*) max_restarts="${1#*=}"; shift ;;
    --rdzv-id|--rdzv_id) [ $# -ge 2 ] || die "$1 needs a value"; rdzv_id="$2"; shift 2 ;;
    --rdzv-id=*|--rdzv_id=*) rdzv_id="${1#*=}"; shift ;;
    --rdzv-conf|--rdzv_conf) [ $# -ge 2 ] || die "$1 needs a value"; rdzv_conf="$2"; shift 2 ;;
    --rdzv-conf=*|--rdzv_conf=*) rdzv_conf="${1#*=}"; shift ;;
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

if [ -n "$elastic" ]; then
  [[ "$elastic" =~ ^([0-9]+):([0-9]+)$ ]] || die "--elastic takes MIN:MAX nodes (e.g. 1:4), got '$elastic'"
  min_nodes="${BASH_REMATCH[1]}"; max_nodes="${BASH_REMATCH[2]}"
  { [ "$min_nodes" -ge 1 ] && [ "$min_nodes" -le "$max_nodes" ]; } || die "--elastic $elastic: need 1 <= MIN <= MAX"
  int_arg --max-restarts "$max_restarts"
  conf="last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5${rdzv_conf:+,$rdzv_conf}"
  resume=(--ckpt_path last)
  for arg in "$@"; do
    case "$arg" in --ckpt_path|--ckpt_path=*) resume=() ;; esac
  done
  # the ranks read the world from torchrun at every (re)start (LP_ELASTIC); a silent peer ends its watcher in 15 s
  export LP_ELASTIC=1
  export LP_WATCHDOG_PEER_TIMEOUT="${LP_WATCHDOG_PEER_TIMEOUT:-15}"
  # a fresh store for each world's process group: the agent's shared store keeps the previous world's keys, and a
  # restarted world would read the dead world's addresses (pytorch/pytorch#135712)
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  cmd=("$python" -m torch.distributed.run
       --nnodes "$min_nodes:$max_nodes" --nproc-per-node "$nproc" --max-restarts "$max_restarts"
       --rdzv-backend c10d --rdzv-endpoint "$master_addr:$master_port" --rdzv-id "$rdzv_id" --rdzv-conf "$conf"
       -m lightning_parallel fit --config "$recipe" "$@" ${resume[@]+"${resume[@]}"})
  echo "[torchrun.sh] elastic: $min_nodes to $max_nodes node(s) of $nproc rank(s), up to $max_restarts restart(s)," \
       "c10d rendezvous '$rdzv_id' at $master_addr:$master_port" >&2
else
  # torchrun is `python -m torch.distributed.run`; the workers run `python -m lightning_parallel` (the CLI's module).
  cmd=("$python" -m torch.distributed.run
       --nnodes "$nnodes" --nproc-per-node "$nproc" --node-rank "$node_rank"
       --master-addr "$master_addr" --master-port "$master_port"
       -m lightning_parallel fit --config "$recipe" "$@"
       --trainer.num_nodes "$nnodes" --trainer.devices "$nproc")
  echo "[torchrun.sh] node $node_rank/$nnodes: $nproc rank(s) here, world size $((nnodes * nproc)), rendezvous" \
       "$master_addr:$master_port" >&2
fi
if [ "$dry_run" = 1 ]; then
  [ -z "$elastic" ] || printf 'LP_ELASTIC=1 LP_WATCHDOG_PEER_TIMEOUT=%q TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ' \
                              "$LP_WATCHDOG_PEER_TIMEOUT"
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
