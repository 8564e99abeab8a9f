#!/usr/bin/env bash
# PENCIL against chain of thought past the crossover, with seeds, into
# experiments/pencil/results/qbf_3_8.jsonl (one record per held-out instance; rerun to
# resume: a run whose records are all there is skipped, a stopped one continues from
# its checkpoint):
#   experiments/pencil/run_seeds.sh [WORK_DIR]    # workdirs under WORK_DIR
#   lhc report experiments/pencil                 # the tables
# The scaling setup (configs/pencil_qbf.py:scaling: the 0.79M model, 2,400 steps of 16
# rows) trained on a mixture of QBF with n = 3-8 variables (a size drawn per row), for
# seeds 0 and 1 of each format at a context limit of 512 tokens, then the CoT control:
# the same rows (16 a step, 2,400 steps) at 2,048 tokens. Each run is evaluated at its
# end on 200 held-out instances per size (the same instances for every run of a seed),
# greedily, up to 32,768 new tokens (the longest reference trace at n = 8 in 1,000
# instances has 25,070 tokens).
set -euo pipefail
WORK=${1:-/tmp/pencil-seeds}
HERE=$(cd "$(dirname "$0")" && pwd)
RESULTS=$HERE/results/qbf_3_8.jsonl
SIZES=6 INSTANCES=200
mkdir -p "$WORK"
# tcmalloc made training about 30% faster on the 2-core CPU (README); optional.
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -e "$TCMALLOC" ] && export LD_PRELOAD=$TCMALLOC

done_records() {  # format seed limit -> the number of distinct instances recorded
  python - "$RESULTS" "$@" <<'PY'
import json, os, sys
path, fmt, seed, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
keys = set()
if os.path.exists(path):
    for line in open(path):
        if line.endswith("\n"):
            r = json.loads(line)
            if (r["format"], r["seed"], r["context_limit"]) == (fmt, seed, limit):
                keys.add((r["size"], r["instance"]))
print(len(keys))
PY
}

run() {  # format seed limit
  local format=$1 seed=$2 limit=$3
  local name=qbf38_${format}_${limit}_s${seed}
  if [ "$(done_records "$format" "$seed" "$limit")" -ge $((SIZES * INSTANCES)) ]; then
    echo "$name: done"; return
  fi
  echo "$name: training and evaluating in $WORK/$name"
  nice lhc train --config "configs/pencil_qbf.py:scaling,mix=3-8,format=$format" \
    --workdir "$WORK/$name" --config.seed="$seed" \
    --config.model.max_len="$limit" --config.data.context_limit="$limit" \
    --config.pencil_eval.max_new_tokens=32768 --config.pencil_eval.results="$RESULTS" \
    --config.progress_bar=False > "$WORK/$name.log" 2>&1
}

cd "$HERE/../.."
for seed in 0 1; do
  run pencil "$seed" 512
  run cot "$seed" 512
done
for seed in 0 1; do
  run cot "$seed" 2048
done
echo "all runs done"
