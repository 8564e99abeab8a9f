#!/usr/bin/env bash
# The recurrent interventions over 10 seeds, 32 passkey keys per cell, into
# experiments/recurrent/results/<model>.jsonl (one record per run; rerun to resume: a
# seed whose records are there is skipped):
#   MODEL=mamba2 experiments/recurrent/run_seeds.sh /tmp/recurrent-seeds
set -euo pipefail
RUNS=${1:?usage: run_seeds.sh RUNS_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
model=${MODEL:-mamba2}
export RESULTS=$HERE/results/$model.jsonl SAMPLES=${SAMPLES:-32} MODEL=$model
for seed in ${SEEDS:-0 1 2 3 4 5 6 7 8 9}; do
  if [ -f "$RESULTS" ] && grep -q "\"run\": \"${model}_s${seed}_tbtt\"" "$RESULTS"; then
    continue
  fi
  SEED=$seed nice "$HERE/run.sh" "$RUNS"
done
