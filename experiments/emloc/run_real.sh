#!/usr/bin/env bash
# EMLoC on a pretrained model (bfloat16, as the paper), into
# experiments/emloc/results/<model>.jsonl (every method's row of each episode; rerun to
# resume):
#   experiments/emloc/run_real.sh smollm2   # SmolLM2-135M-Instruct
#   experiments/emloc/run_real.sh qwen      # Qwen2.5-Coder-0.5B-Instruct
#   lhc report experiments/emloc            # the tables
# Many-shot classification on the word-category and topic tasks (lhc.data.word_tasks:
# demonstrations from each task's train part, queries from its test part) at 32 and 64
# demonstrations, 20 episodes of 24 queries each; EMLoC at each delta against the full
# context, uniform pruning, SnapKV-style pruning and fewer shots at EMLoC's budget.
set -euo pipefail
WHICH=${1:?usage: run_real.sh smollm2|qwen}
case "$WHICH" in
  smollm2) MODEL=smollm2-135m-instruct ;;
  qwen) MODEL=qwen2.5-coder-0.5b-instruct ;;
  *) echo "run_real.sh: expected smollm2 or qwen, got '$WHICH'" >&2; exit 2 ;;
esac
HERE=$(cd "$(dirname "$0")" && pwd)
for shots in ${SHOTS:-32 64}; do
  for task in ${TASKS:-category-words topic-letters}; do
    nice lhc bench emloc --checkpoint "$MODEL" --dtype bfloat16 --tasks "$task" \
      --shots "$shots" --episodes "${EPISODES:-20}" --queries 24 --chunk-size 4 \
      --deltas "${DELTAS:-0.005,0.05}" --results "$HERE/results/$WHICH.jsonl"
  done
done
