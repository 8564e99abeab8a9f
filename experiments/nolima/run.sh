#!/usr/bin/env bash
# NoLiMa in miniature: train a decoder, GCA and Mamba-2 on the generated world of latent
# associations, then sweep each with the harness (plain, then multiple choice), and time
# the harness at 8K, 32K and 128K tokens.
#   experiments/nolima/run.sh /tmp/nolima
# Results: OUT/<model>.jsonl (resumable), OUT/<model>.txt, plots in OUT/plots_<model>/.
set -euo pipefail
OUT=${1:?usage: run.sh OUT_DIR}
MODELS=${MODELS:-"decoder gca mamba2"}
LENGTHS=${LENGTHS:-"250,500,1000,2000,4000,8000"}
mkdir -p "$OUT"
for model in $MODELS; do
  [ -d "$OUT/$model/checkpoints" ] || lhc train --config "configs/nolima_world.py:model=$model" --workdir "$OUT/$model"
done
for model in $MODELS; do
  lhc bench nolima --workdir "$OUT/$model" --world --lengths "$LENGTHS" --depths 4 --max-new-tokens 12 \
    --batch-size 8 --results "$OUT/$model.jsonl" --json "$OUT/$model.json" \
    --plots "$OUT/plots_$model" --title "NoLiMa world: $model" | tee "$OUT/$model.txt"
  lhc bench nolima --workdir "$OUT/$model" --world --lengths "$LENGTHS" --depths 4 --max-new-tokens 12 \
    --batch-size 8 --variant mc --question-types onehop,twohop \
    --results "$OUT/${model}_mc.jsonl" --json "$OUT/${model}_mc.json" | tee "$OUT/${model}_mc.txt"
done
lhc bench nolima --workdir "$OUT/decoder" --world --throughput --lengths 8192,32768 --tests 16 --max-new-tokens 12 --batch-size 8 \
  --json "$OUT/throughput.json" | tee "$OUT/throughput.txt"
lhc bench nolima --workdir "$OUT/decoder" --world --throughput --lengths 128000 --tests 1 --max-new-tokens 12 \
  --batch-size 1 --json "$OUT/throughput_128k.json" | tee "$OUT/throughput_128k.txt"
