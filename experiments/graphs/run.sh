#!/usr/bin/env bash
# GCN depth sweep on the power-5 task on a 16x16 grid: the model's range against the
# task's range during training (configs/graphs_range.py), then the table and plot.
#   experiments/graphs/run.sh /tmp/range                  # node level, copy
#   experiments/graphs/run.sh /tmp/range_graph ",graph_level=True,interaction=l2,activation=gelu"
set -euo pipefail
OUT=${1:?usage: run.sh OUT_DIR [CONFIG_ARGS]}
EXTRA=${2:-}
mkdir -p "$OUT"
for depth in 1 2 3 4 5 6 7 8; do
  grep -qs '"step": 1000, "eval' "$OUT/depth$depth/metrics.jsonl" \
    || lhc train --config "configs/graphs_range.py:depth=$depth$EXTRA" --workdir "$OUT/depth$depth" \
         --config.progress_bar=False
done
python -m lhc.graphs.report "$OUT"/depth{1,2,3,4,5,6,7,8} --plot "$OUT/range.png" | tee "$OUT/table.txt"
