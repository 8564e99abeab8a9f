#!/usr/bin/env bash
# Context extension of SmolLM2-135M-Instruct from 8K to 16K tokens on King James Bible
# windows: YaRN against linear interpolation, LoRA, 50 steps; evaluated before and after.
#
#   experiments/context_extension/run.sh /tmp/context_extension
#
# Every step resumes: an evaluation skips the tests already in the results file, a
# training run continues from its last checkpoint (saved every step). On a 2-core CPU
# each evaluation takes about 2 hours, and a 16K training step over half an hour (its
# blocked attention alone, forward and backward, is about 3.3 s per layer at 4K tokens,
# 16x that at 16K, 30 layers, plus the rematerialised forward): the training runs need
# an accelerator.
set -euo pipefail
OUT=${1:-/tmp/context_extension}
HERE=$(cd "$(dirname "$0")" && pwd)
TEXT=${TEXT:-$OUT/kjv.txt}
RESULTS=${RESULTS:-$HERE/results/smollm2_16k.jsonl}
mkdir -p "$OUT"
[ -s "$TEXT" ] || "$HERE/../kjv_text.sh" "$TEXT"
evaluate() { nice python "$HERE/evaluate.py" --text "$TEXT" --out "$RESULTS" --chat "$@"; }

# Before: the checkpoint at 16K as it is, and with each scaling, untrained.
evaluate --checkpoint smollm2-135m-instruct --label base
evaluate --checkpoint smollm2-135m-instruct --rope yarn --label yarn_untrained
evaluate --checkpoint smollm2-135m-instruct --rope linear --label linear_untrained

# After: 50 steps of one 16,384-token window, LoRA rank 8 on q/k/v/o.
for scaling in yarn linear; do
  nice lhc train --config "configs/lm_finetune.py:long,scaling=$scaling" \
    --workdir "$OUT/$scaling" --config.data.paths="$TEXT" --config.progress_bar=False
  evaluate --workdir "$OUT/$scaling" --label "${scaling}_lora"
done
lhc report "$HERE"
