#!/usr/bin/env bash
# NoLiMa on the real model (SmolLM2-135M-Instruct, float32, CPU) with a public-domain
# book as haystack: the King James Bible of Debian's bible-kjv-text (any plain-text book,
# e.g. from Project Gutenberg, can take its place: HAYSTACK=book.txt).
#   experiments/nolima/run_smollm2.sh /tmp/nolima-smollm2
# 1. the haystack text (apt-get download of bible-kjv and bible-kjv-text, one verse per
#    line, verse numbers and chapter headings dropped), unless HAYSTACK names a file;
# 2. the sweep: PAIRS question-needle pairs of lhc's needle set drawn with SEED, 5 depths
#    at LENGTHS, 3 depths (0, 0.5, 1) at LONG (7680 tokens: with the chat template and
#    192 answer tokens, what fits the model's 8,192), shuffled snippets of the book with
#    keyword lines dropped. Results go to OUT/results.jsonl one test at a time: rerun to
#    resume;
# 3. the tables and plots over every test in OUT/results.jsonl (OUT/summary.txt, OUT/plots);
# 4. tests/s at 1K, 4K and 7.5K tokens (each length in a fresh process).
set -euo pipefail
OUT=${1:?usage: run_smollm2.sh OUT_DIR}
MODEL=${MODEL:-smollm2-135m-instruct}
PAIRS=${PAIRS:-12}
SEED=${SEED:-0}
LENGTHS=${LENGTHS:-250,500,1000,2000,4000}
LONG=${LONG:-7680}
mkdir -p "$OUT"
HAYSTACK=${HAYSTACK:-$OUT/kjv.txt}
"$(dirname "$0")/../kjv_text.sh" "$HAYSTACK"
sweep() {  # sweep LENGTHS DEPTHS NAME
  lhc bench nolima --checkpoint "$MODEL" --dtype float32 --haystack "$HAYSTACK" --shuffle 4000 \
    --filter --pairs "$PAIRS" --seed "$SEED" --lengths "$1" --depths "$2" \
    --results "$OUT/results.jsonl" --json "$OUT/$3.json" | tee "$OUT/$3.txt"
}
sweep "$LENGTHS" 5 sweep
[ -z "$LONG" ] || sweep "$LONG" 0,0.5,1 sweep_long
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import sys
from lhc import nolima
records = nolima.read_results(f"{sys.argv[1]}/results.jsonl")
result = nolima.summary(records)
print(nolima.table(result))
print("\naccuracy over tests [95% Wilson interval] (tests)\n" + nolima.interval_table(result))
print("\nplots:", ", ".join(nolima.plot(records, f"{sys.argv[1]}/plots", "NoLiMa: SmolLM2-135M-Instruct")))
PY
[ -f "$OUT/throughput.json" ] || lhc bench nolima --checkpoint "$MODEL" --dtype float32 \
  --haystack "$HAYSTACK" --shuffle 4000 --filter --throughput --lengths 1024,4096,7680 --tests 4 \
  --json "$OUT/throughput.json" | tee "$OUT/throughput.txt"
