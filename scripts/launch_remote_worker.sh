#!/usr/bin/env bash
# Start a rollout worker on a remote machine over ssh, encrypted and authenticated with CurveZMQ.
#
#   scripts/launch_remote_worker.sh USER@HOST LEARNER_ADDRESS WORKER_ID [extra `heterorl rollout` options]
#
# e.g. scripts/launch_remote_worker.sh me@gpu-box tcp://203.0.113.7:5555 berlin-0 --throttle 1
#
# What it does:
#   1. makes the worker's key pair here (keys/WORKER_ID.key, keys/WORKER_ID.key_secret) unless it exists,
#      and adds the public half to the learner's allow-list folder (allowed/);
#   2. copies the worker's secret key and the learner's public key (keys/learner.key) to the remote host;
#   3. runs `heterorl rollout` there under nohup, logging to ~/heterorl-WORKER_ID.log.
# The remote host needs only `pip install heterorl` (and torch). Make the learner's keys first with
#   heterorl keys --name learner --out keys
# and start the learner with --curve-secret keys/learner.key_secret --allow-keys allowed.
# Environment: HETERORL (remote command, default "heterorl"), KEYS (default keys), ALLOWED (default allowed).
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
host=$1 address=$2 worker=$3
shift 3
keys=${KEYS:-keys} allowed=${ALLOWED:-allowed} remote_cmd=${HETERORL:-heterorl}
[ -f "$keys/learner.key" ] || { echo "missing $keys/learner.key: run 'heterorl keys --name learner --out $keys'" >&2; exit 2; }
[ -f "$keys/$worker.key_secret" ] || heterorl keys --name "$worker" --out "$keys"
mkdir -p "$allowed"
cp "$keys/$worker.key" "$allowed/"
ssh "$host" "mkdir -p ~/.heterorl-keys && chmod 700 ~/.heterorl-keys"
scp -q "$keys/$worker.key_secret" "$keys/learner.key" "$host:~/.heterorl-keys/"
ssh "$host" "nohup $remote_cmd rollout --connect '$address' --worker-id '$worker' \
    --curve-secret ~/.heterorl-keys/$worker.key_secret --server-key ~/.heterorl-keys/learner.key $* \
    > ~/heterorl-$worker.log 2>&1 < /dev/null & echo started $worker on $host, log ~/heterorl-$worker.log"
