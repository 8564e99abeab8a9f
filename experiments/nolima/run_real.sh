#!/usr/bin/env bash
# NoLiMa on pretrained models, with a public-domain book (the King James Bible) as
# haystack, into experiments/nolima/results/<model>.jsonl.gz (one record per test,
# gzip-compressed: the answers make a plain file too large to commit; rerun to resume):
#   experiments/nolima/run_real.sh smollm2     # SmolLM2-135M-Instruct, 250 to 7,680 tokens
#   experiments/nolima/run_real.sh qwen        # Qwen2.5-Coder-0.5B-Instruct, 250 to 8,000
#   experiments/nolima/run_real.sh qwen-long   # the same at 16,000 and 32,000 tokens
#   lhc report experiments/nolima              # the tables
# lhc's needle set, one needle order per fact (alternating: 22 facts, each with its direct
# and one-hop question, 9 with a two-hop one too), 3 depths, 2 shuffles of the book (one
# at 16K and 32K, to keep the CPU time within reach), the character's name drawn per
# needle placement, chat template, greedy answers of up to 192 tokens. First, the
# knowledge check: every latent pair at 250 tokens of a held-out shuffle. SmolLM2 sweeps
# every pair; Qwen (4x the compute per token) only the facts whose latent association it
# knows, each with its literal question (--known-only): what the comparison of latent
# and literal decay needs, at a CPU cost this machine can pay up to 32K.
set -euo pipefail
WHICH=${1:?usage: run_real.sh smollm2|qwen|qwen-long [WORK_DIR]}
WORK=${2:-/tmp/nolima-real}
HERE=$(cd "$(dirname "$0")" && pwd)
case "$WHICH" in
  smollm2) MODEL=smollm2-135m-instruct NAME=smollm2 LENGTHS=250,500,1000,4000,7680 HAYSTACKS=2 KNOWN= ;;
  qwen) MODEL=qwen2.5-coder-0.5b-instruct NAME=qwen25coder LENGTHS=250,500,1000,4000,8000 HAYSTACKS=2 KNOWN=--known-only ;;
  qwen-long) MODEL=qwen2.5-coder-0.5b-instruct NAME=qwen25coder LENGTHS=16000,32000 HAYSTACKS=1 KNOWN=--known-only ;;
  *) echo "run_real.sh: expected smollm2, qwen or qwen-long, got '$WHICH'" >&2; exit 2 ;;
esac
mkdir -p "$WORK"
HAYSTACK=${HAYSTACK:-$WORK/kjv.txt}
[ -s "$HAYSTACK" ] || "$HERE/../kjv_text.sh" "$HAYSTACK"
nice lhc bench nolima --checkpoint "$MODEL" --label "$MODEL" --dtype float32 \
  --haystack "$HAYSTACK" --shuffle 4000 --filter --haystacks "$HAYSTACKS" --orders alternate \
  --probe $KNOWN --lengths "$LENGTHS" --depths 0,0.5,1 --max-new-tokens 192 --seed 0 \
  --results "$HERE/results/$NAME.jsonl.gz" --json "$WORK/$WHICH.json"
