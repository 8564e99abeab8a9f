#!/usr/bin/env bash
# GCA's learned retriever against two ablations, 3 seeds each, on King James Bible
# filler, into experiments/gca/results/passkey.jsonl (one record per run, length and
# depth with every example's hit; the table: lhc report experiments/gca):
#   experiments/gca/run_seeds.sh /tmp/gca-seeds
# Retrievers (GCAConfig.retriever): learned (the paper), no_grad (the same scores with
# their gradient stopped: the retriever is not trained by the loss), mean_pool (not
# learned at all: cosine of mean-pooled chunk representations). Each run: the tiny
# config, 2,000 steps at 512 tokens, then 10 examples per (length, depth) cell at 512 to
# 524,288 tokens (1,000x). Every run resumes from its checkpoints; a run whose records
# are in the results file is skipped. About 1.5 CPU-hours per run on 2 cores.
set -euo pipefail
OUT=${1:?usage: run_seeds.sh OUT_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
RESULTS=$HERE/results/passkey.jsonl
mkdir -p "$OUT"
TEXT=${TEXT:-$OUT/kjv.txt}
[ -s "$TEXT" ] || "$HERE/../kjv_text.sh" "$TEXT"
for seed in ${SEEDS:-0 1 2}; do
  for retriever in ${RETRIEVERS:-learned no_grad mean_pool}; do
    label="$retriever"
    if [ -f "$RESULTS" ] && grep -q "\"label\": \"$label\", \"seed\": $seed," "$RESULTS"; then
      continue
    fi
    run="$OUT/$retriever-$seed"
    common=(--config.seed="$seed" --config.model.retriever="$retriever"
      --config.data.filler_paths="('$TEXT',)" --config.num_steps=2000)
    nice lhc train --config configs/gca_passkey.py:tiny --workdir "$run" "${common[@]}" \
      --config.progress_bar=False
    nice lhc eval --workdir "$run" \
      --config.passkey_eval.lengths="(512,2048,8192,32768,131072,524288)" \
      --config.passkey_eval.samples=10 --config.passkey_eval.batch_size=5 \
      --config.passkey_eval.results="$RESULTS" --config.passkey_eval.label="$label"
  done
done
