#!/usr/bin/env bash
# Downloads, on a machine with a package index, the pure-Python wheels that the
# accelerator run needs and the GPU machine's image lacks (tabicl 0.1.4, the TabICL
# reference), into experiments/accelerator/wheels (ignored by git). run.sh installs
# them offline.
#
#   experiments/accelerator/wheels.sh [PYTHON_VERSION]   # default 3.12, the GPU image's
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=${1:-3.12}
python=${PYTHON:-python3}
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
  -d "$here/wheels" tabicl==0.1.4
ls -l "$here/wheels"
