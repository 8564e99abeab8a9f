#!/usr/bin/env bash
# Iterative Vectors on the real model (SmolLM2-135M-Instruct, float32, CPU):
#   1. the plain prompt's macro-F1 and accuracy on validation episodes of every word task
#      (lhc.data.word_tasks) at 1, 2 and 4 demonstrations per class, to choose tasks
#      between chance and ceiling without looking at the test split;
#   2. clean prompt vs Task Vectors vs Iterative Vectors on the chosen tasks (TASKS) at
#      SHOTS demonstrations per class, one step per seed, the bench's default grid;
#   3. the seeds' rows in one table.
#   experiments/icl/iterative_vectors/run_smollm2.sh /tmp/iv-smollm2
# Each step writes OUT/<name>.txt and .json and is skipped when its .json exists
# (rerun to resume). Run from the repository root with lhc on the path.
set -euo pipefail
OUT=${1:?usage: run_smollm2.sh OUT_DIR}
MODEL=${MODEL:-smollm2-135m-instruct}
ALL=sentiment-letters,sentiment-words,sentiment-flipped,category-letters,category-words,category-names,case-letters,topic-letters,topic-swapped
# TASKS: the four whose 2-shot validation accuracy in step 1 lies clearly between chance
# and ceiling (README).
TASKS=${TASKS:-sentiment-letters,sentiment-words,case-letters,topic-letters}
SHOTS=${SHOTS:-2}
mkdir -p "$OUT"
step() {  # step NAME ARGS...: one bench run, skipped when done
  local name=$1
  shift
  [ -f "$OUT/$name.json" ] && return 0
  lhc bench icl vectors --checkpoint "$MODEL" --dtype float32 "$@" --json "$OUT/$name.json.part" \
    | tee "$OUT/$name.txt"
  mv "$OUT/$name.json.part" "$OUT/$name.json"
}
for shots in 1 2 4; do
  step "clean_shots$shots" --clean-only --word-tasks "$ALL" --shots "$shots" --val-episodes 128
done
SEEDS=${SEEDS:-1 2 3}
for seed in $SEEDS; do
  step "vectors_seed$seed" --word-tasks "$TASKS" --seeds "$seed" --shots "$SHOTS"
done
# 3. every seed's rows in one table (per task, then all)
files=$(for seed in $SEEDS; do printf '%s,' "$OUT/vectors_seed$seed.json"; done)
lhc bench icl vectors --merge "${files%,}" --json "$OUT/vectors.json" | tee "$OUT/vectors.txt"
