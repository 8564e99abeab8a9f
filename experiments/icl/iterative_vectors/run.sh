#!/usr/bin/env bash
# Iterative Vectors on generated in-context classification: pretrain a decoder on
# prompts that each hold a new 2-class task, then compare the plain 1-shot prompt, Task
# Vectors and Iterative Vectors (grid chosen on validation by macro-F1) on fixed tasks,
# with the training prompts' input noise and with more.
#   experiments/icl/iterative_vectors/run.sh /tmp/iv
set -euo pipefail
OUT=${1:?usage: run.sh OUT_DIR}
mkdir -p "$OUT"
[ -d "$OUT/model/checkpoints" ] \
  || lhc train --config configs/icl_classification.py --workdir "$OUT/model"
for noise in 0.1 0.4; do
  lhc bench icl vectors --workdir "$OUT/model" --tasks 3 --classes 2 --shots 1 --noise "$noise" \
    --ext-shots 1,2 --episodes 200 --val-episodes 200 --test-episodes 1000 \
    --json "$OUT/vectors_noise$noise.json" | tee "$OUT/vectors_noise$noise.txt"
done
