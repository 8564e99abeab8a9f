#!/usr/bin/env bash
# Task superposition on the real model (SmolLM2-135M-Instruct, float32, CPU):
#   1. every task of every family alone (single-task accuracy, 32 demonstrations);
#   2. the proportion sweep d in {0, 0.25, 0.5, 0.75, 1} of pairs and K-task mixtures of
#      tasks the model does alone (STEPS below), 32 prompts per point;
#   3. shared-prefix scoring against each prompt + answer run separately (--baseline).
#   experiments/icl/superposition/run_smollm2.sh /tmp/sup-smollm2
# Each step writes OUT/<name>.txt and .json and is skipped when its .json exists
# (rerun to resume). Run from the repository root with lhc on the path.
set -euo pipefail
OUT=${1:?usage: run_smollm2.sh OUT_DIR}
MODEL=${MODEL:-smollm2-135m-instruct}
COMMON=(--checkpoint "$MODEL" --dtype float32 --demos 32 --seed 0)
mkdir -p "$OUT"
step() {  # step NAME ARGS...: one bench run, skipped when done
  local name=$1
  shift
  [ -f "$OUT/$name.json" ] && return 0
  lhc bench icl superposition "${COMMON[@]}" "$@" --json "$OUT/$name.json.part" \
    | tee "$OUT/$name.txt"
  mv "$OUT/$name.json.part" "$OUT/$name.json"
}
step single --single-task --prompts 16 \
  --family addition,country,copy,letters,arith,case,antonym,numbers
SWEEPS="copy:copy_a,copy_b letters:first_lower,first_upper antonym:antonym,copy case:upper,title
  case:copy,upper,title antonym:antonym,copy,upper"
for sweep in ${STEPS:-$SWEEPS}; do  # FAMILY:TASKS, the first task's share swept
  family=${sweep%%:*}
  tasks=${sweep#*:}
  step "sweep_${family}_${tasks//,/_}" --family "$family" --tasks "$tasks" --points 5 \
    --prompts 32
done
step baseline_copy --family copy --tasks copy_a,copy_b --points 2 --prompts 8 --baseline
step baseline_case --family case --tasks copy,upper,title --points 2 --prompts 8 --baseline
