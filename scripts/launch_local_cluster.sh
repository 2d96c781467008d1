#!/usr/bin/env bash
# A learner and N rollout workers on this machine as separate processes, started by hand (what
# `heterorl train` does for you, spelled out), with an optional multi-rank learner under torchrun.
#
#   scripts/launch_local_cluster.sh [--workers N] [--ranks R] [--port P] [--throttle "1 2"] [-- config overrides]
#
# e.g. scripts/launch_local_cluster.sh --workers 3 --throttle "1 1 3" -- loss.name=gepo rl.steps=100
# Logs go to runs/cluster/logs/. Ctrl-C stops every process.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=2 ranks=1 port=5555 throttle="1"
while [ $# -gt 0 ]; do
    case $1 in
        --workers) workers=$2; shift 2 ;;
        --ranks) ranks=$2; shift 2 ;;
        --port) port=$2; shift 2 ;;
        --throttle) throttle=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "unknown option $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
bin=.venv/bin
run_dir=runs/cluster
mkdir -p "$run_dir/logs"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' INT TERM EXIT
if [ "$ranks" -gt 1 ]; then
    $bin/torchrun --standalone --nproc-per-node "$ranks" -m heterorl.cli learner --bind "tcp://127.0.0.1:$port" \
        logging.run_dir=$run_dir runtime.workers=$workers "$@" > "$run_dir/logs/learner.log" 2>&1 &
else
    $bin/heterorl learner --bind "tcp://127.0.0.1:$port" logging.run_dir=$run_dir runtime.workers=$workers "$@" \
        > "$run_dir/logs/learner.log" 2>&1 &
fi
learner=$!
pids+=($learner)
read -r -a factors <<< "$throttle"
for i in $(seq 0 $((workers - 1))); do
    f=${factors[$((i % ${#factors[@]}))]}
    $bin/heterorl rollout --connect "tcp://127.0.0.1:$port" --worker-id "worker-$i" --throttle "$f" \
        > "$run_dir/logs/worker-$i.log" 2>&1 &
    pids+=($!)
done
echo "learner pid $learner, $workers workers; logs in $run_dir/logs; metrics in $run_dir/metrics.jsonl"
wait "$learner"
