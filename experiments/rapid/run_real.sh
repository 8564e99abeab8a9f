#!/usr/bin/env bash
# RAPID on pretrained models, questions about facts inserted into a public-domain book
# (the King James Bible), into experiments/rapid/results/<model>.jsonl.gz (gzip; rerun to resume):
#   experiments/rapid/run_real.sh smollm2   # SmolLM2-135M-Instruct at 2K, 4K and 7,936 tokens
#   experiments/rapid/run_real.sh qwen      # Qwen2.5-Coder-0.5B-Instruct at 16,000 and 32,000
#   lhc report experiments/rapid            # the tables
# At least 100 questions per length, half of them paraphrased (no word shared with the
# fact, so BM25 retrieval must miss some): SmolLM2 25 contexts x 4 facts, Qwen 9 x 12 (a
# 32K prefill takes about 10 minutes on a 2-core CPU). The target on the whole context,
# RAG alone and RAPID with the model as its own RAG drafter (self-speculation) at eta 0,
# 10 and 20; BM25 over 128-token chunks, budget max(512, N / 24); greedy, 64 new
# tokens, gamma 10.
set -euo pipefail
WHICH=${1:?usage: run_real.sh smollm2|qwen [WORK_DIR]}
WORK=${2:-/tmp/rapid-real}
HERE=$(cd "$(dirname "$0")" && pwd)
case "$WHICH" in
  smollm2) MODEL=smollm2-135m-instruct NAME=smollm2 LENGTHS=2048,4096,7936 SAMPLES=25 FACTS=4 BATCH=5 ;;
  qwen) MODEL=qwen2.5-coder-0.5b-instruct NAME=qwen25coder LENGTHS=16000,32000 SAMPLES=9 FACTS=12 BATCH=1 ;;
  *) echo "run_real.sh: expected smollm2 or qwen, got '$WHICH'" >&2; exit 2 ;;
esac
mkdir -p "$WORK"
HAYSTACK=${HAYSTACK:-$WORK/kjv.txt}
[ -s "$HAYSTACK" ] || "$HERE/../kjv_text.sh" "$HAYSTACK"
nice lhc bench rapid --checkpoint "$MODEL" --dtype float32 --haystack "$HAYSTACK" \
  --context-lengths "$LENGTHS" --samples "$SAMPLES" --facts-per-context "$FACTS" \
  --context-batch "$BATCH" --paraphrased 0.5 --seed 0 --new-tokens 64 --gamma 10 \
  --etas 0,10,20 --chunk-size 128 --min-budget 512 --ratio 24 \
  --results "$HERE/results/$NAME.jsonl.gz" --json "$WORK/$WHICH.json"
