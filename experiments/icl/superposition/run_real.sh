#!/usr/bin/env bash
# Task superposition on a pretrained model, into
# experiments/icl/superposition/results/<model>.jsonl (one record per sweep and seed
# with every prompt's probabilities; rerun to resume):
#   experiments/icl/superposition/run_real.sh smollm2   # SmolLM2-135M-Instruct
#   experiments/icl/superposition/run_real.sh gemma3    # Gemma 3 270M (base)
#   experiments/icl/superposition/run_real.sh qwen      # Qwen2.5-Coder-0.5B-Instruct
#   lhc report experiments/icl/superposition            # the tables
# First every task of every family alone (where the model stands; OUT/single.txt), then
# the proportion sweeps d in {0, 0.25, 0.5, 0.75, 1} of the first task of each mixture
# (SWEEPS), 32 demonstrations, 64 prompts per point, seeds 0-2 (a seed draws the
# demonstrations, their order and the queries), float32 on the CPU.
set -euo pipefail
WHICH=${1:?usage: run_real.sh smollm2|gemma3|qwen [OUT_DIR]}
case "$WHICH" in
  smollm2) MODEL=smollm2-135m-instruct ;;
  gemma3) MODEL=gemma3-270m ;;
  qwen) MODEL=qwen2.5-coder-0.5b-instruct ;;
  *) echo "run_real.sh: expected smollm2, gemma3 or qwen, got '$WHICH'" >&2; exit 2 ;;
esac
OUT=${2:-/tmp/sup-$WHICH}
HERE=$(cd "$(dirname "$0")" && pwd)
COMMON=(--checkpoint "$MODEL" --dtype float32 --demos 32)
mkdir -p "$OUT"
if [ ! -f "$OUT/single.json" ]; then
  nice lhc bench icl superposition "${COMMON[@]}" --seed 0 --single-task --prompts 16 \
    --family addition,country,copy,letters,arith,case,antonym,numbers \
    --json "$OUT/single.json.part" | tee "$OUT/single.txt"
  mv "$OUT/single.json.part" "$OUT/single.json"
fi
SWEEPS=${SWEEPS:-"copy:copy_a,copy_b letters:first_lower,first_upper antonym:antonym,copy
  case:upper,title case:copy,upper,title antonym:antonym,copy,upper"}
for seed in ${SEEDS:-0 1 2}; do
  for sweep in $SWEEPS; do  # FAMILY:TASKS, the first task's share swept
    nice lhc bench icl superposition "${COMMON[@]}" --seed "$seed" --family "${sweep%%:*}" \
      --tasks "${sweep#*:}" --points 5 --prompts 64 --results "$HERE/results/$WHICH.jsonl" \
      | tee -a "$OUT/sweeps.txt"
  done
done
