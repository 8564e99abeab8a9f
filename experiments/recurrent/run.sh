#!/usr/bin/env bash
# Trains a zero-state baseline at 256 tokens, post-trains a copy of it with each initial
# state (zero as the control, noise, fitted, passing, tbtt), then evaluates all six to
# 100x the training length:
#
#   MODEL=mamba2 SEED=0 experiments/recurrent/run.sh /tmp/runs
#
# Environment: MODEL (mamba2 | gla), SEED, STEPS (baseline steps, 3000), POST (post-
# training steps, 300), SAMPLES (passkey samples per length and depth, 8), RESULTS (a
# JSON-lines file: one record per run with its curves and every passkey hit). Run from
# the repository root with lhc installed.
set -euo pipefail
runs=${1:?usage: run.sh RUNS_DIR}
model=${MODEL:-mamba2}
seed=${SEED:-0}
steps=${STEPS:-3000}
post=${POST:-300}
samples=${SAMPLES:-8}
config="configs/recurrent_passkey.py:tiny,model=${model}"
name="${model}_s${seed}"
base="${runs}/${name}_base"
flags=(--config.seed="${seed}" --config.progress_bar=False --config.tensorboard=False)

if [ ! -d "${base}/checkpoints/${steps}" ]; then
  lhc train --config "${config}" "${flags[@]}" --config.num_steps="${steps}" --workdir "${base}"
fi
workdirs=("${base}")
for init in zero noise fitted passing tbtt; do
  dir="${runs}/${name}_${init}"
  if [ ! -d "${dir}/checkpoints/$((steps + post))" ]; then
    rm -rf "${dir}"
    cp -r "${base}" "${dir}"
    lhc train --config "${config},init=${init}" "${flags[@]}" \
      --config.num_steps="$((steps + post))" --workdir "${dir}"
  fi
  workdirs+=("${dir}")
done
results=()
if [ -n "${RESULTS:-}" ]; then results=(--results "${RESULTS}"); fi
python experiments/recurrent/curves.py --workdirs "${workdirs[@]}" \
  --length 25600 --passkey-lengths 256 1024 4096 25600 --samples "${samples}" \
  --out "${runs}/${name}_curves" "${results[@]}" | tee "${runs}/${name}_curves.md"
