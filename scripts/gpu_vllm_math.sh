#!/usr/bin/env bash
# The GPU recipe (experiments/configs/gpu_vllm_math.yaml): install the project with vLLM on a CUDA host, check
# the GPUs, then one learner (GPU 0) and three vLLM rollout workers (GPUs 1-3) on a local model and math file.
#
#   MODEL=/models/Qwen2.5-1.5B-Instruct DATA=/data/gsm8k_train.jsonl scripts/gpu_vllm_math.sh [overrides...]
#   CONFIG=experiments/configs/gpu_vllm_code.yaml MODEL=/models/Qwen2.5-Coder-0.5B-Instruct scripts/gpu_vllm_math.sh
#
# MODEL: a local Hugging Face folder (0.5B-1.5B fits one GPU per process); DATA: {"prompt", "answer"} JSONL, for
# a config whose task reads a file (the math one); CONFIG: the run's config (default: gpu_vllm_math.yaml; the
# code task's recipe generates its problems and needs no DATA).
# Fewer GPUs: e.g. runtime.workers=1 'runtime.worker_devices=["1"]', or share GPU 0 with
# runtime.vllm_gpu_memory_utilization=0.4 'runtime.worker_devices=["0"]'. Extra arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to a local Hugging Face model folder}"
CONFIG="${CONFIG:-experiments/configs/gpu_vllm_math.yaml}"
[ -f "$CONFIG" ] || { echo "CONFIG=$CONFIG: no such file" >&2; exit 1; }
data=()
if grep -q "name: jsonl" "$CONFIG"; then
    : "${DATA:?set DATA to a JSONL file with a prompt and an answer on each line}"
    data=(task.options.path="$DATA")
fi
command -v nvidia-smi > /dev/null || { echo "no nvidia-smi: this recipe needs CUDA GPUs" >&2; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# the [vllm] extra pulls the CUDA vLLM wheel and the torch it pins (not the CPU wheel the Makefile installs)
.venv/bin/pip install -q -e ".[vllm]"
.venv/bin/python -c "import torch, vllm; assert torch.cuda.is_available(); print('torch', torch.__version__, \
'vllm', vllm.__version__, torch.cuda.device_count(), 'GPUs')"
exec .venv/bin/heterorl train --config "$CONFIG" policy.model="$MODEL" "${data[@]}" "$@"
