#!/usr/bin/env bash
# Prepares one TPU VM worker for lhc; run.sh copies this script to every worker and
# runs it there before the lhc command. Idempotent and safe to rerun: the venv is made
# once, the checkout is brought to the requested ref, and `pip install -e ".[tpu]"` runs
# only when pyproject.toml (or the extras) changed since the last successful install.
set -euo pipefail

usage() {
  cat <<EOF
Usage: $(basename "$0") [options]

Run on a TPU VM worker. Makes the venv if missing, clones or updates the repository (or
uses a directory already copied there), installs lhc when pyproject.toml changed, and
prints the JAX devices. Relative paths are relative to \$HOME.

Options (flag / environment variable / default):
  --src-dir DIR        LHC_SRC_DIR      ~/lhc    the lhc checkout on this worker
  --repo URL           LHC_REPO_URL     (none)   clone/update DIR from URL; without it DIR
                                                 must already hold the code (run.sh copies it)
  --ref REF            LHC_REPO_REF     main     branch, tag or commit to check out
  --venv DIR           LHC_VENV         ~/lhc-venv
  --extras LIST        LHC_EXTRAS       tpu      pip extras, e.g. tpu,prior ("" for none)
  --python EXE         LHC_PYTHON       newest python3.11+ on PATH, else a uv-managed 3.12
  --device-timeout S   LHC_DEVICE_TIMEOUT  300   limit for the device listing
  --no-device-check    LHC_DEVICE_CHECK=0        skip printing the JAX devices
  -h, --help           show this help
EOF
}

HOST=$(hostname)

log() {
  printf '[%s setup_worker %s] %s\n' "$(date +%H:%M:%S)" "$HOST" "$*" >&2
}

die() {
  log "error: $*"
  exit 1
}

usage_error() {
  printf '%s: %s\n\n' "$(basename "$0")" "$1" >&2
  usage >&2
  exit 2
}

SRC_DIR=${LHC_SRC_DIR:-lhc}
REPO_URL=${LHC_REPO_URL:-}
REPO_REF=${LHC_REPO_REF:-main}
VENV=${LHC_VENV:-lhc-venv}
EXTRAS=${LHC_EXTRAS-tpu}
PYTHON=${LHC_PYTHON:-}
DEVICE_TIMEOUT=${LHC_DEVICE_TIMEOUT:-300}
DEVICE_CHECK=${LHC_DEVICE_CHECK:-1}

parse_args() {
  while (($#)); do
    if [[ $1 == --*=* ]]; then
      set -- "${1%%=*}" "${1#*=}" "${@:2}"
    fi
    case $1 in
      -h | --help)
        usage
        exit 0
        ;;
      --no-device-check)
        DEVICE_CHECK=0
        shift
        ;;
      --src-dir | --repo | --ref | --venv | --extras | --python | --device-timeout)
        (($# >= 2)) || usage_error "$1 needs a value"
        case $1 in
          --src-dir) SRC_DIR=$2 ;;
          --repo) REPO_URL=$2 ;;
          --ref) REPO_REF=$2 ;;
          --venv) VENV=$2 ;;
          --extras) EXTRAS=$2 ;;
          --python) PYTHON=$2 ;;
          --device-timeout) DEVICE_TIMEOUT=$2 ;;
        esac
        shift 2
        ;;
      *) usage_error "unknown argument '$1'" ;;
    esac
  done
  [[ -n $SRC_DIR ]] || usage_error "--src-dir must not be empty"
  [[ -n $VENV ]] || usage_error "--venv must not be empty"
  [[ -n $REPO_REF ]] || usage_error "--ref must not be empty"
  [[ $EXTRAS =~ ^[A-Za-z0-9_,-]*$ ]] || usage_error "bad extras '$EXTRAS'"
  [[ $DEVICE_TIMEOUT =~ ^[0-9]+$ ]] || usage_error "bad device timeout '$DEVICE_TIMEOUT'"
  [[ $DEVICE_CHECK == 0 || $DEVICE_CHECK == 1 ]] || usage_error "LHC_DEVICE_CHECK must be 0 or 1"
  [[ $SRC_DIR == /* ]] || SRC_DIR="$HOME/$SRC_DIR"
  [[ $VENV == /* ]] || VENV="$HOME/$VENV"
  return 0
}

sync_checkout() {
  if [[ -z $REPO_URL ]]; then
    [[ -f $SRC_DIR/pyproject.toml ]] ||
      die "$SRC_DIR/pyproject.toml is missing: copy the repository there or pass --repo URL"
    log "using the code in $SRC_DIR"
    return 0
  fi
  if [[ ! -d $SRC_DIR/.git ]]; then
    if [[ -e $SRC_DIR ]] && [[ -n $(ls -A "$SRC_DIR") ]]; then
      die "$SRC_DIR exists and is not a git checkout; move it away or use another --src-dir"
    fi
    log "cloning $REPO_URL into $SRC_DIR"
    git clone --quiet --no-checkout "$REPO_URL" "$SRC_DIR"
  else
    git -C "$SRC_DIR" remote set-url origin "$REPO_URL"
  fi
  # A detached checkout of FETCH_HEAD works the same for a branch, a tag or a commit, and
  # leaves every worker on exactly the fetched commit.
  git -C "$SRC_DIR" fetch --quiet origin "$REPO_REF"
  git -C "$SRC_DIR" checkout --quiet --detach FETCH_HEAD
  log "checked out $REPO_REF: $(git -C "$SRC_DIR" log -1 --format='%h %s')"
}

python_is_recent() {
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null
}

make_venv() {
  if [[ -x $VENV/bin/python ]]; then
    return 0
  fi
  if [[ -e $VENV ]]; then
    # Never delete a directory this script did not create.
    die "$VENV exists but has no bin/python; remove it or choose another --venv"
  fi
  local candidate python=""
  if [[ -n $PYTHON ]]; then
    python_is_recent "$PYTHON" || die "--python $PYTHON is missing or older than 3.11"
    python=$PYTHON
  else
    for candidate in python3.13 python3.12 python3.11 python3; do
      if command -v "$candidate" >/dev/null && python_is_recent "$candidate"; then
        python=$candidate
        break
      fi
    done
  fi
  log "creating $VENV"
  if [[ -n $python ]] && "$python" -m venv "$VENV"; then
    :
  else
    # TPU VM images ship an older python3 (Ubuntu 22.04 has 3.10) and sometimes no venv
    # module; uv brings its own interpreter.
    rm -rf "$VENV" # only what the failed venv call above created
    log "no usable python 3.11+ with venv; creating the venv with uv (python 3.12)"
    if ! python3 -m uv --version >/dev/null 2>&1; then
      python3 -m pip install --user --quiet uv ||
        python3 -m pip install --user --quiet --break-system-packages uv
    fi
    python3 -m uv venv --seed --python 3.12 "$VENV"
  fi
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
}

install_lhc() {
  local stamp=$VENV/.lhc-install-stamp want have=""
  want=$({
    sha256sum <"$SRC_DIR/pyproject.toml"
    printf 'extras=%s src=%s\n' "$EXTRAS" "$SRC_DIR"
  } | sha256sum | cut -d' ' -f1)
  [[ -f $stamp ]] && have=$(<"$stamp")
  if [[ $have == "$want" ]]; then
    log "lhc is installed and pyproject.toml is unchanged; skipping pip"
    return 0
  fi
  local target=.
  [[ -n $EXTRAS ]] && target=".[$EXTRAS]"
  log "installing lhc: pip install -e \"$target\""
  (cd "$SRC_DIR" && "$VENV/bin/python" -m pip install --quiet -e "$target")
  # Written only after a successful install, so a failed one is retried next time.
  printf '%s\n' "$want" >"$stamp"
}

print_devices() {
  [[ $DEVICE_CHECK == 1 ]] || return 0
  # On a multi-host slice this succeeds only when every worker runs it at the same time,
  # as run.sh does; the timeout keeps a lone or blocked worker from hanging here.
  if ! timeout "$DEVICE_TIMEOUT" "$VENV/bin/python" -c '
import jax
print(f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local of {jax.device_count()} devices")
print(jax.local_devices())
'; then
    log "warning: could not list the JAX devices (TPU busy or not every worker started?)"
  fi
}

main() {
  parse_args "$@"
  sync_checkout
  make_venv
  install_lhc
  print_devices
  log "worker ready: $SRC_DIR with $VENV"
}

main "$@"
