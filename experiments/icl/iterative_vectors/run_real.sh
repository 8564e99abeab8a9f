#!/usr/bin/env bash
# Iterative Vectors against the plain prompt and Task Vectors on a pretrained model,
# into experiments/icl/iterative_vectors/results/<model>.jsonl (one record per task and
# seed with every test episode's predictions; rerun to resume):
#   experiments/icl/iterative_vectors/run_real.sh smollm2   # SmolLM2-135M-Instruct
#   experiments/icl/iterative_vectors/run_real.sh gemma3    # Gemma 3 270M (base)
#   experiments/icl/iterative_vectors/run_real.sh qwen      # Qwen2.5-Coder-0.5B-Instruct
#   lhc report experiments/icl/iterative_vectors            # the tables
# First the plain prompt on validation episodes of every word task at 1, 2 and 4
# demonstrations per class (where the model stands; OUT/clean_shots*.txt), then the four
# tasks TASKS at SHOTS demonstrations per class for seeds 1-3 (a seed draws the task's
# train / validation / test parts, the episodes and the extraction), the bench's default
# grid, float32 on the CPU, each test input the query once.
set -euo pipefail
WHICH=${1:?usage: run_real.sh smollm2|gemma3|qwen [OUT_DIR]}
case "$WHICH" in
  smollm2) MODEL=smollm2-135m-instruct ;;
  gemma3) MODEL=gemma3-270m ;;
  qwen) MODEL=qwen2.5-coder-0.5b-instruct ;;
  *) echo "run_real.sh: expected smollm2, gemma3 or qwen, got '$WHICH'" >&2; exit 2 ;;
esac
OUT=${2:-/tmp/iv-$WHICH}
HERE=$(cd "$(dirname "$0")" && pwd)
ALL=sentiment-letters,sentiment-words,sentiment-flipped,category-letters,category-words,category-names,case-letters,topic-letters,topic-swapped
TASKS=${TASKS:-sentiment-letters,sentiment-words,case-letters,topic-letters}
SHOTS=${SHOTS:-2}
mkdir -p "$OUT"
for shots in 1 2 4; do
  [ -f "$OUT/clean_shots$shots.json" ] && continue
  nice lhc bench icl vectors --checkpoint "$MODEL" --dtype float32 --clean-only \
    --word-tasks "$ALL" --shots "$shots" --val-episodes 128 \
    --json "$OUT/clean_shots$shots.json.part" | tee "$OUT/clean_shots$shots.txt"
  mv "$OUT/clean_shots$shots.json.part" "$OUT/clean_shots$shots.json"
done
for seed in ${SEEDS:-1 2 3}; do
  nice lhc bench icl vectors --checkpoint "$MODEL" --dtype float32 --word-tasks "$TASKS" \
    --seeds "$seed" --shots "$SHOTS" --results "$HERE/results/$WHICH.jsonl" \
    | tee -a "$OUT/vectors.txt"
done
