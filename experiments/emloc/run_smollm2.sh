#!/usr/bin/env bash
# EMLoC on the real model (SmolLM2-135M-Instruct, float32, CPU): many-shot text
# classification with word-list tasks (lhc.data.word_tasks: demonstrations from each
# task's train part, queries from its test part), EMLoC at each delta against the full
# context, uniform pruning, SnapKV-style pruning and fewer shots at EMLoC's budget.
#   experiments/emloc/run_smollm2.sh /tmp/emloc-smollm2
# Each (task, shots) run writes OUT/<task>_shots<N>.txt and .json and is skipped when its
# .json exists (rerun to resume); OUT/table.md holds every run's means in one table.
set -euo pipefail
OUT=${1:?usage: run_smollm2.sh OUT_DIR}
MODEL=${MODEL:-smollm2-135m-instruct}
TASKS=${TASKS:-topic-letters sentiment-words category-words}
SHOTS=${SHOTS:-16 32}
EPISODES=${EPISODES:-5}
DELTAS=${DELTAS:-0.005,0.05}
mkdir -p "$OUT"
for shots in $SHOTS; do
  for task in $TASKS; do
    name="${task}_shots$shots"
    [ -f "$OUT/$name.json" ] && continue
    lhc bench emloc --checkpoint "$MODEL" --dtype float32 --tasks "$task" --shots "$shots" \
      --episodes "$EPISODES" --queries 24 --chunk-size 4 --deltas "$DELTAS" \
      --json "$OUT/$name.json.part" | tee "$OUT/$name.txt"
    mv "$OUT/$name.json.part" "$OUT/$name.json"
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/table.md"
import glob, json, os, sys
rows = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*_shots*.json"))):
    result = json.load(open(path))
    for t in result["table"]:
        rows.append(dict(t, shots=result["shots"]))
print("| task | shots | method | delta | accuracy | kept | memory (KiB) | compression (s) | compiling (s) |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
for r in sorted(rows, key=lambda r: (r["task"], r["shots"], r["delta"] or 0, r["method"])):
    delta = "—" if r["delta"] is None else f"{r['delta']:g}"
    print(f"| {r['task']} | {r['shots']} | {r['method']} | {delta} | {r['accuracy']:.3f} | "
          f"{r['kept']:.3f} | {r['memory_kib']:.0f} | {r['seconds']:.1f} | {r['compile_seconds']:.1f} |")
PY
