#!/usr/bin/env bash
# RAPID on the real model (SmolLM2-135M-Instruct, float32, CPU): questions about facts
# inserted into a public-domain book (the King James Bible of Debian's bible-kjv-text,
# made as experiments/nolima/run_smollm2.sh makes it; HAYSTACK=book.txt for another).
#   experiments/rapid/run_smollm2.sh /tmp/rapid-smollm2
# 10 contexts x 3 facts = 30 questions per length, at 2K, 4K and 7,936 tokens (what fits
# the model's 8,192 with the question and 64 new tokens). Target-only, RAG-only and RAPID
# (self-speculation) at eta 0/5/10/20; records go to OUT/results.jsonl one run at a time
# (rerun to resume); the table to OUT/table.txt.
set -euo pipefail
OUT=${1:?usage: run_smollm2.sh OUT_DIR}
MODEL=${MODEL:-smollm2-135m-instruct}
LENGTHS=${LENGTHS:-2048,4096,7936}
SEED=${SEED:-0}
mkdir -p "$OUT"
HAYSTACK=${HAYSTACK:-$OUT/kjv.txt}
"$(dirname "$0")/../kjv_text.sh" "$HAYSTACK"
lhc bench rapid --checkpoint "$MODEL" --dtype float32 --haystack "$HAYSTACK" \
  --context-lengths "$LENGTHS" --samples 10 --facts-per-context 3 --seed "$SEED" \
  --new-tokens 64 --gamma 10 --etas 0,5,10,20 --chunk-size 128 --min-budget 512 --ratio 24 \
  --results "$OUT/results.jsonl" --json "$OUT/table.json" | tee "$OUT/table.txt"
