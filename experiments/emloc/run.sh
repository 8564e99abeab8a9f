#!/usr/bin/env bash
# EMLoC in miniature: train a text and an image many-shot classifier, then compare EMLoC
# with uniform pruning, SnapKV-style pruning and fewer shots at the same budget.
#   experiments/emloc/run.sh /tmp/emloc
# Tables land in OUT/bench_<modality>.txt (and .json).
set -euo pipefail
OUT=${1:?usage: run.sh OUT_DIR}
MODALITIES=${MODALITIES:-"text image"}
mkdir -p "$OUT"
# The image model starts from the trained text model (a new patch encoder, every
# parameter fine-tuned at 1e-3): trained from scratch it stayed at chance.
declare -A ARGS=([text]="modality=text" [image]="modality=image,lr=1e-3,init=$OUT/text")
for modality in $MODALITIES; do
  [ -d "$OUT/$modality/checkpoints" ] \
    || lhc train --config "configs/emloc_manyshot.py:${ARGS[$modality]}" --workdir "$OUT/$modality"
  lhc bench emloc --workdir "$OUT/$modality" --episodes 8 --queries 20 --chunk-size 4 \
    --deltas 0.005,0.05,0.2,0.5,2 --json "$OUT/bench_$modality.json" | tee "$OUT/bench_$modality.txt"
done
