#!/usr/bin/env bash
# Decision Transformer against the Decision Mixer on strong locally made data: SAC
# trained to near D4RL's expert returns on Hopper-v5 and Walker2d-v5, then D4RL-style
# medium, medium-replay and medium-expert datasets from it; DT and DM at the released
# code's size, 3 seeds each; every rollout evaluation into
# experiments/dm/results/strong.jsonl. Rerun to resume: SAC continues from its last save,
# a dataset or run that exists is skipped.
#   experiments/dm/run_strong.sh /tmp/dm-strong      # everything, Hopper then Walker2d
#   ENVS=Hopper-v5 experiments/dm/run_strong.sh ...  # one environment
#   lhc report experiments/dm                        # the tables
# SAC: 1,000,000 steps (D4RL's SAC ran 1M for the medium-expert expert; its datasets
# hold 1M steps each, as here). DT / DM: configs/dm_gym.py's defaults (3 layers, 1 head,
# width 128, K = 20, AdamW 1e-4, batch 64), 10,000 steps, 10 rollouts at the end
# conditioned on the Decision Mixer's targets (hopper 3600, walker2d 5000).
set -euo pipefail
OUT=${1:?usage: run_strong.sh OUT_DIR}
ENVS=${ENVS:-Hopper-v5 Walker2d-v5}
SAC_STEPS=${SAC_STEPS:-1000000}
DATA_STEPS=${DATA_STEPS:-1000000}
STEPS=${STEPS:-10000}
HERE=$(cd "$(dirname "$0")" && pwd)
RESULTS=$HERE/results/strong.jsonl
mkdir -p "$OUT"
cd "$HERE/../.."
for env in $ENVS; do
  name=$(echo "${env%-v*}" | tr '[:upper:]' '[:lower:]')
  if [ ! -f "$OUT/d4rl/$name-returns.json" ]; then
    nice python -m lhc.dm.behaviour --env "$env" --out "$OUT/d4rl" --sac-steps "$SAC_STEPS" \
      --dataset-steps "$DATA_STEPS" --save-every 50000 >> "$OUT/$name-behaviour.log" 2>&1
  fi
  tail -8 "$OUT/$name-behaviour.log"
  for data in medium medium-replay medium-expert; do
    for seed in 0 1 2; do
      for model in dt dm; do
        run=$OUT/$name-$data/$model-seed$seed
        grep -qs "eval/return_mean" "$run/metrics.jsonl" && continue
        mkdir -p "$run"
        nice lhc train --config \
          "configs/dm_gym.py:data=$OUT/d4rl/$name-$data.hdf5,env=$env,model=$model,seed=$seed,steps=$STEPS,eval_every=$STEPS,episodes=10,results=$RESULTS" \
          --workdir "$run" --config.progress_bar=False > "$run.log" 2>&1
      done
    done
  done
done
echo "all runs done"
