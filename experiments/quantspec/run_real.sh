#!/usr/bin/env bash
# QuantSpec's acceptance on a pretrained model, 20 prompts per length from a
# public-domain book (the King James Bible, each prompt at its own random offset), into
# experiments/quantspec/results/<model>_acceptance.jsonl (one record per draft, length,
# gamma and temperature with each prompt's accepted and drafted tokens; rerun to resume):
#   experiments/quantspec/run_real.sh smollm2   # SmolLM2-135M-Instruct at 1K, 4K, 8K
#   experiments/quantspec/run_real.sh qwen      # Qwen2.5-Coder-0.5B-Instruct at 8K, 16K, 32K
#   lhc report experiments/quantspec            # the tables
# Drafts: the 4-bit KV alone, and with INT4 MLP weights (asymmetric groups of 32) by
# round-to-nearest and by GPTQ; gamma 1, 2, 4, 6; greedy and T = 0.7; 64 new tokens;
# at T = 0.7, 2,000 speculative samples of the first two tokens after each length's first
# 512 prompt tokens tested against the target's exact distribution.
# Then the 4-bit KV alone at gamma 4 with KV groups of 16 and 32 (the full-precision
# buffer holds G to 2G - 1 recent tokens, so G sets both of the paper's knobs).
set -euo pipefail
WHICH=${1:?usage: run_real.sh smollm2|qwen [WORK_DIR]}
case "$WHICH" in
  smollm2) MODEL=smollm2-135m-instruct LENGTHS=1000,4000,8000 ABLATE=8000 ;;
  qwen) MODEL=qwen2.5-coder-0.5b-instruct LENGTHS=8000,16000,32000 ABLATE=8000 ;;
  *) echo "run_real.sh: expected smollm2 or qwen, got '$WHICH'" >&2; exit 2 ;;
esac
WORK=${2:-/tmp/quantspec-$WHICH}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$WORK"
HAYSTACK=${HAYSTACK:-$WORK/kjv.txt}
[ -s "$HAYSTACK" ] || "$HERE/../kjv_text.sh" "$HAYSTACK"
run() {
  nice lhc bench quantspec --configs llama-2-7b --contexts 4096 --checkpoint "$MODEL" \
    --dtype float32 --filler "$HAYSTACK" --batch 20 --new-tokens 64 \
    --results "$HERE/results/${WHICH}_acceptance.jsonl" "$@" | tee -a "$WORK/acceptance.txt"
}
run --prompt-lengths "$LENGTHS" --drafts kv4,kv4+rtn-asym-32,kv4+gptq-asym-32 \
  --gammas 1,2,4,6 --temperatures 0,0.7 --sampled-check 2000
for group in 16 32; do
  run --prompt-lengths "$ABLATE" --drafts kv4 --gammas 4 --temperatures 0,0.7 --group-size "$group"
done
