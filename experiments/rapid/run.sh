#!/usr/bin/env bash
# RAPID in miniature: train the target and the larger drafter, then one bench run per
# context length (accuracy and tokens/s of target-only, RAG-only and RAPID).
#   experiments/rapid/run.sh /tmp/rapid
# Tables land in OUT/bench_<length>.txt (and .json); about 75 minutes on a 2-core CPU
# (training 50, the 32K run 12 of the rest).
set -euo pipefail
OUT=${1:?usage: run.sh OUT_DIR}
LENGTHS=${LENGTHS:-"1024 2048 8192 16384 32768"}
mkdir -p "$OUT"
[ -d "$OUT/target/checkpoints" ] || lhc train --config configs/rapid_passkey.py:tiny --workdir "$OUT/target"
[ -d "$OUT/large/checkpoints" ] || lhc train --config configs/rapid_passkey.py:large --workdir "$OUT/large"
for length in $LENGTHS; do
  lhc bench rapid --workdir "$OUT/target" --draft-workdir "$OUT/large" \
    --context-lengths "$length" --samples 8 --new-tokens 64 --gamma 10 \
    --etas 0,5,10,20 --upward-etas 0,40 --chunk-size 128 --min-budget 512 --ratio 64 \
    --repeats 1 --json "$OUT/bench_$length.json" | tee "$OUT/bench_$length.txt"
done
