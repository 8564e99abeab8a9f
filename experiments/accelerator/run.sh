#!/usr/bin/env bash
# One accelerator run: every Pallas kernel compiled and timed, decoding against the
# memory roofline, QuantSpec at long context, TabICL against its reference.
#
#   experiments/accelerator/run.sh OUT                 # on a GPU: at most about 8 minutes
#   experiments/accelerator/run.sh OUT --smoke         # anywhere: tiny shapes, kernels interpreted
#   experiments/accelerator/run.sh OUT --sections flash,quant
#
# Writes OUT/report.md, OUT/results.json, OUT/rows.jsonl and OUT/log.txt. Nothing is
# fetched: the wheels in experiments/accelerator/wheels (downloaded beforehand by
# wheels.sh on a machine with a package index) are installed offline into a private
# folder. PYTHON picks the interpreter (default python3).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ $# -lt 1 ] || [[ $1 == -* ]]; then
  echo "usage: $0 OUT [--smoke] [--sections a,b,...]" >&2
  exit 2
fi
out=$1
shift
python=${PYTHON:-python3}
wheels=${LHC_WHEELS:-$here/wheels}
mkdir -p "$out"
if compgen -G "$wheels/*.whl" > /dev/null; then
  site=$(mktemp -d)
  trap 'rm -rf "$site"' EXIT
  "$python" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$python" "$here/accelerator.py" --out "$out" "$@" 2>&1 | tee "$out/log.txt"
