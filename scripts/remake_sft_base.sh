#!/usr/bin/env bash
# Remake a shipped SFT base from scratch:
#   scripts/remake_sft_base.sh           heterorl/assets/maze-sft-base  (5x5 mazes, maze_sft.yaml, ~5 min)
#   scripts/remake_sft_base.sh maze4     heterorl/assets/maze4-sft-base (4x4 mazes, maze4_sft.yaml, ~3.5 min)
#   scripts/remake_sft_base.sh add3      heterorl/assets/add3-sft-base  (3-digit addition, add3_sft.yaml, ~4 min)
# Further arguments are config overrides. Seed 0 everywhere (config `seed`, `policy.tiny.seed`); SFT stops at
# the first eval with held-out greedy success >= its config's sft.stop_success. Times are for 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
which=maze
if [[ $# -gt 0 && "$1" != *=* ]]; then which="$1"; shift; fi
case "$which" in
  maze)  config=maze_sft.yaml;  base=maze-sft-base ;;
  maze4) config=maze4_sft.yaml; base=maze4-sft-base ;;
  add3)  config=add3_sft.yaml;  base=add3-sft-base ;;
  *) echo "unknown base '$which': choose maze, maze4 or add3" >&2; exit 2 ;;
esac
rm -rf "runs/sft-$base"  # from scratch: a run dir with checkpoints is otherwise refused (`--resume` goes on)
.venv/bin/heterorl sft --config "$config" sft.output="heterorl/assets/$base" logging.run_dir="runs/sft-$base" "$@"
