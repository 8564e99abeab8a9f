#!/usr/bin/env bash
# Context extension of SmolLM2-135M-Instruct from 8K to 16K tokens on King James Bible
# windows: YaRN against linear interpolation, LoRA, 50 steps; evaluated before and after.
#
#   experiments/context_extension/run.sh /tmp/context_extension
#
# Every step resumes: an evaluation skips the tests already in the results file, a
# training run continues from its last checkpoint. About 8 CPU-hours on 2 cores.
set -euo pipefail
OUT=${1:-/tmp/context_extension}
HERE=$(cd "$(dirname "$0")" && pwd)
TEXT=${TEXT:-$OUT/kjv.txt}
RESULTS=${RESULTS:-$HERE/results/smollm2_16k.jsonl}
mkdir -p "$OUT"
[ -s "$TEXT" ] || "$HERE/../kjv_text.sh" "$TEXT"
evaluate() { nice python "$HERE/evaluate.py" --text "$TEXT" --out "$RESULTS" --chat "$@"; }

# The checkpoint at 16K as it is.
evaluate --checkpoint smollm2-135m-instruct --label base

# Each scaling after 50 steps of one 16,384-token window, LoRA rank 8 on q/k/v/o, and
# the same scaling untrained. The trained runs go first: their checkpoints live in $OUT,
# while the evaluations resume from the committed results.
for scaling in yarn linear; do
  nice lhc train --config "configs/lm_finetune.py:long,scaling=$scaling" \
    --workdir "$OUT/$scaling" --config.data.paths="$TEXT" --config.progress_bar=False
  evaluate --workdir "$OUT/$scaling" --label "${scaling}_lora"
done
for scaling in yarn linear; do
  evaluate --checkpoint smollm2-135m-instruct --rope "$scaling" --label "${scaling}_untrained"
done
lhc report "$HERE"
