#!/usr/bin/env bash
# Decision Transformer against the Decision Mixer and its two ablations (no auxiliary
# predictor; capacity fixed at half the tokens) on locally made datasets: Pendulum-v1
# medium (fast) and Hopper-v5 medium / medium-replay, several seeds each, then the table.
#   experiments/dm/run.sh /tmp/dm                 # everything (about 2.5 h on 2 cores)
#   PHASES=pendulum experiments/dm/run.sh /tmp/dm # one phase: pendulum, hopper
# JOBS (default 2) runs are trained at once; every run is skipped if it has finished.
set -euo pipefail
OUT=${1:?usage: run.sh OUT_DIR}
PHASES=${PHASES:-pendulum hopper}
JOBS=${JOBS:-2}
MODELS="dt dm dm_noaux dm_fixed"
# The same reduced size and schedule for every model (the paper's gym runs: width 128,
# 100k steps at 1e-4): width 64, a few thousand steps at 3e-4, rollouts at the end.
COMMON="width=64,lr=3e-4,batch=64"
mkdir -p "$OUT"

data() {  # env, sac steps, dataset steps
  local env=$1 name
  name=$(echo "${env%-v*}" | tr '[:upper:]' '[:lower:]')
  [ -f "$OUT/d4rl/$name-medium-replay.hdf5" ] \
    || python -m lhc.dm.behaviour --env "$env" --out "$OUT/d4rl" --sac-steps "$2" \
         --dataset-steps "$3" > "$OUT/$name-behaviour.log" 2>&1
  tail -7 "$OUT/$name-behaviour.log"
}

runs() {  # env, datasets, seeds, steps, episodes
  local env=$1 name data model seed
  name=$(echo "${env%-v*}" | tr '[:upper:]' '[:lower:]')
  for data in $2; do for seed in $3; do for model in $MODELS; do
    echo "$OUT/$name-$data/$model-seed$seed" \
      "configs/dm_gym.py:data=$OUT/d4rl/$name-$data.hdf5,env=$env,model=$model,seed=$seed,steps=$4,eval_every=$4,episodes=$5,$COMMON"
  done; done; done | xargs -P "$JOBS" -L 1 sh -c '
    grep -qs "eval/return_mean" "$0/metrics.jsonl" && exit 0
    mkdir -p "$0" && lhc train --config "$1" --workdir "$0" --config.progress_bar=False > "$0.log" 2>&1'
  python -m lhc.dm.report "$OUT/$name"-*/*/ | tee "$OUT/$name-table.txt"
}

for phase in $PHASES; do
  case $phase in
    pendulum) data Pendulum-v1 8000 20000; runs Pendulum-v1 "medium" "0 1 2" 1500 10 ;;
    hopper) data Hopper-v5 150000 100000; runs Hopper-v5 "medium medium-replay" "0 1" 2000 10 ;;
    *) echo "unknown phase $phase (expected pendulum, hopper)" >&2; exit 2 ;;
  esac
done
