#!/usr/bin/env bash
# QuantSpec's draft ablation at 8,000 tokens on the real model (SmolLM2-135M-Instruct,
# float32, CPU), prompts from a public-domain book (the King James Bible, made by
# experiments/kjv_text.sh; HAYSTACK=book.txt for another):
#   experiments/quantspec/run_ablation_8k.sh /tmp/quantspec-8k
# 1. the default draft (4-bit KV, asymmetric INT4 MLP weights in groups of 32), gamma 1-6,
#    greedy and T = 0.7;
# 2. the other drafts at gamma 4: 4-bit KV alone, INT4 weights alone (8-bit KV) at weight
#    groups of 64 and 192 (128 does not divide the model's 576 input rows), symmetric
#    against asymmetric, round-to-nearest against GPTQ, the MLP against every layer, and
#    both (the earlier default, and GPTQ's symmetric grid as the official code uses it);
# 3. the default draft with KV groups of 32 instead of the head's 64.
# One 8,000-token prompt, 64 new tokens. Acceptance does not depend on timing, so this
# runs fine beside other work. Each step writes OUT/stepN.json and is skipped when that
# file exists (rerun to resume); the tables go to OUT/stepN.txt.
set -euo pipefail
OUT=${1:?usage: run_ablation_8k.sh OUT_DIR}
MODEL=${MODEL:-smollm2-135m-instruct}
mkdir -p "$OUT"
HAYSTACK=${HAYSTACK:-$OUT/kjv.txt}
"$(dirname "$0")/../kjv_text.sh" "$HAYSTACK"
run() {
  local step=$1
  shift
  [ -s "$OUT/$step.json" ] && return 0
  lhc bench quantspec --configs llama-2-7b --contexts 4096 --checkpoint "$MODEL" \
    --dtype float32 --filler "$HAYSTACK" --prompt-lengths 8000 --new-tokens 64 \
    --temperatures 0,0.7 "$@" --json "$OUT/$step.json.part" | tee "$OUT/$step.txt"
  mv "$OUT/$step.json.part" "$OUT/$step.json"
}
run step1 --gammas 1,2,3,4,5,6 --drafts kv4+rtn-asym-32
run step2 --gammas 4 \
  --drafts kv4,kv8+rtn-sym-64,kv8+rtn-asym-64,kv8+gptq-asym-64,kv8+rtn-asym-192,kv8+rtn-asym-32-all,kv4+rtn-sym-64,kv4+gptq-sym-64
run step3 --gammas 4 --group-size 32 --drafts kv4+rtn-asym-32
