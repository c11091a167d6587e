#!/usr/bin/env bash
# Issue 15's contention scenario on a CPU, through `headroom serve`'s HTTP API: the same client and schedulers as
# bench/gpu_contention.sh, on a random 16-layer hybrid (12 Gated DeltaNet + 4 attention layers, hidden 256, fp32)
# small enough for a CPU, with 4,000-token long prompts. CPU figures: what the schedulers do to one another, not
# what an H200 does. From the repo root, with the dev environment (make test builds .venv):
#   bash bench/cpu_contention.sh OUT       # writes OUT/contention.json (every run), OUT/contention_LABEL.json, logs
set -eu
out=$1; mkdir -p "$out"
export PATH="$PWD/.venv/bin:$PATH"
model=/tmp/headroom-cpu-contention
[ -f $model/config.json ] || python3 - "$model" <<'PY'
import sys, torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
config = Qwen3_5TextConfig(
    vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=16, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=32768,
    rms_norm_eps=1e-6, tie_word_embeddings=True)
torch.manual_seed(15)
model = Qwen3_5ForCausalLM(config)
for param in model.parameters():
    param.data.normal_(0, 0.05)
model.save_pretrained(sys.argv[1], safe_serialization=True)
PY
export CONTENTION_BASE="--model $model --device cpu --context-length 8192 --max-new-tokens 600 --max-running-requests 16 --chunked-prefill-size 1024 --max-total-tokens 65536"
export CONTENTION_LONG_TOKENS=${CONTENTION_LONG_TOKENS:-4000}
export CONTENTION_RUNS=${CONTENTION_RUNS:-"fair:--scheduler-policy fair|fcfs:--strict-fcfs|short_first_plain:--no-interjection|short_first:|short_first_itl50:--itl-target-ms 50"}
bash bench/gpu_contention.sh "$out"
