#!/usr/bin/env bash
# Task superposition from scratch: train on single-task prompts, then measure each
# task's answer probability on prompts mixing two tasks at proportions 0, 0.1, ..., 1.
#   experiments/icl/superposition/run.sh /tmp/sup
# Tables land in OUT/curve_<kind>.txt (and .json).
set -euo pipefail
OUT=${1:?usage: run.sh OUT_DIR}
KINDS=${KINDS:-"bias_add"}
mkdir -p "$OUT"
for kind in $KINDS; do
  [ -d "$OUT/$kind/checkpoints" ] \
    || lhc train --config "configs/icl_superposition.py:kind=$kind" --workdir "$OUT/$kind"
  lhc bench icl superposition --workdir "$OUT/$kind" --prompts 100 \
    --json "$OUT/curve_$kind.json" | tee "$OUT/curve_$kind.txt"
done
