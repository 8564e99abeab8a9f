# shellcheck shell=bash
# Shared settings and gcloud helpers for create_tpu_vm.sh, run.sh and babysit.sh.
# Sourced, never run. Every setting is an environment variable with a default; the
# scripts' flags overwrite the variables, and babysit.sh exports them to its children.

LHC_GCP_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

LHC_SCRIPT_NAME=${0##*/}

lhc_log() {
  local now
  if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 402)); then
    printf -v now '%(%H:%M:%S)T' -1
  else
    now=$(date +%H:%M:%S) # macOS /bin/bash 3.2 has no %(...)T
  fi
  printf '[%s %s] %s\n' "$now" "$LHC_SCRIPT_NAME" "$*" >&2
}

lhc_die() {
  lhc_log "error: $*"
  exit 1
}

# Wrong invocation: the calling script defines `usage`.
lhc_usage_error() {
  printf '%s: %s\n\n' "$LHC_SCRIPT_NAME" "$1" >&2
  usage >&2
  exit 2
}

lhc_is_uint() {
  [[ $1 =~ ^[0-9]+$ ]]
}

# Prints a command the way a shell would read it back.
lhc_quote_cmd() {
  local quoted=() arg word
  for arg in "$@"; do
    printf -v word '%q' "$arg"
    quoted+=("$word")
  done
  printf '%s' "${quoted[*]}"
}

# --- settings -------------------------------------------------------------------------

lhc_tpu_defaults() {
  : "${LHC_TPU_PROJECT:=}"
  : "${LHC_TPU_ZONE:=}"
  : "${LHC_TPU_NAME:=}"
  : "${LHC_TPU_ACCELERATOR:=v5litepod-8}"
  : "${LHC_TPU_RUNTIME_VERSION:=}"
  : "${LHC_TPU_SPOT:=0}"
  : "${LHC_TPU_PREEMPTIBLE:=0}"
  : "${LHC_TPU_QUEUED:=0}"
  : "${LHC_TPU_POLL_SECONDS:=30}"
  : "${LHC_TPU_WAIT_TIMEOUT:=3600}"
  : "${LHC_TPU_CREATE_FLAGS:=}"
}

lhc_tpu_options_help() {
  cat <<'EOF'
VM options (flag / environment variable / default):
  --name NAME             LHC_TPU_NAME             lhc-$USER-<accelerator>
  --zone ZONE             LHC_TPU_ZONE             by accelerator: v5litepod us-west4-a,
                                                   v5p us-east5-a, v6e us-east5-b,
                                                   v4 us-central2-b, else us-central1-a
  --project PROJECT       LHC_TPU_PROJECT          gcloud's configured project
  --accelerator TYPE      LHC_TPU_ACCELERATOR      v5litepod-8 (e.g. v5litepod-16, v5p-16)
  --runtime-version V     LHC_TPU_RUNTIME_VERSION  by accelerator: v5litepod
                                                   v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5,
                                                   v6e v2-alpha-tpuv6e, else tpu-ubuntu2204-base
  --spot                  LHC_TPU_SPOT=1           Spot VM (cheap, can be preempted)
  --preemptible           LHC_TPU_PREEMPTIBLE=1    legacy preemptible VM
  --on-demand             LHC_TPU_SPOT=0 LHC_TPU_PREEMPTIBLE=0 (default)
  --queued                LHC_TPU_QUEUED=1         create through a queued resource
  --poll-seconds S        LHC_TPU_POLL_SECONDS     30 (sleep between state polls)
  --wait-timeout S        LHC_TPU_WAIT_TIMEOUT     3600 (wait for READY; 0 waits forever)
  --create-flag FLAG      LHC_TPU_CREATE_FLAGS     extra flag for the create call, repeatable
                                                   (e.g. --create-flag=--reserved); the
                                                   variable holds space-separated flags
EOF
}

# Consumes one VM option from "$@" and sets LHC_CONSUMED to the number of words used
# (0 when the first word is not a VM option). Call with --opt=value already split.
# shellcheck disable=SC2034  # LHC_CONSUMED is read by the calling script
lhc_tpu_parse_option() {
  LHC_CONSUMED=0
  case $1 in
    --name | --zone | --project | --accelerator | --runtime-version | --poll-seconds | \
      --wait-timeout | --create-flag)
      (($# >= 2)) || lhc_usage_error "$1 needs a value"
      case $1 in
        --name) LHC_TPU_NAME=$2 ;;
        --zone) LHC_TPU_ZONE=$2 ;;
        --project) LHC_TPU_PROJECT=$2 ;;
        --accelerator) LHC_TPU_ACCELERATOR=$2 ;;
        --runtime-version) LHC_TPU_RUNTIME_VERSION=$2 ;;
        --poll-seconds) LHC_TPU_POLL_SECONDS=$2 ;;
        --wait-timeout) LHC_TPU_WAIT_TIMEOUT=$2 ;;
        --create-flag) LHC_TPU_CREATE_FLAGS="${LHC_TPU_CREATE_FLAGS:+$LHC_TPU_CREATE_FLAGS }$2" ;;
      esac
      LHC_CONSUMED=2
      ;;
    --spot) LHC_TPU_SPOT=1 LHC_TPU_PREEMPTIBLE=0 LHC_CONSUMED=1 ;;
    --preemptible) LHC_TPU_PREEMPTIBLE=1 LHC_TPU_SPOT=0 LHC_CONSUMED=1 ;;
    --on-demand) LHC_TPU_SPOT=0 LHC_TPU_PREEMPTIBLE=0 LHC_CONSUMED=1 ;;
    --queued) LHC_TPU_QUEUED=1 LHC_CONSUMED=1 ;;
  esac
}

# Fills the defaults that depend on the accelerator and checks every VM setting.
lhc_tpu_finalize() {
  local family=${LHC_TPU_ACCELERATOR%%-*}
  [[ $LHC_TPU_ACCELERATOR =~ ^[a-z0-9]+-[0-9]+$ ]] ||
    lhc_usage_error "accelerator must look like v5litepod-8 or v5p-16, got '$LHC_TPU_ACCELERATOR'"
  if [[ -z $LHC_TPU_ZONE ]]; then
    case $family in
      v5litepod | v5e) LHC_TPU_ZONE=us-west4-a ;;
      v5p) LHC_TPU_ZONE=us-east5-a ;;
      v6e) LHC_TPU_ZONE=us-east5-b ;;
      v4) LHC_TPU_ZONE=us-central2-b ;;
      *) LHC_TPU_ZONE=us-central1-a ;;
    esac
  fi
  if [[ -z $LHC_TPU_RUNTIME_VERSION ]]; then
    case $family in
      v5litepod | v5e) LHC_TPU_RUNTIME_VERSION=v2-alpha-tpuv5-lite ;;
      v5p) LHC_TPU_RUNTIME_VERSION=v2-alpha-tpuv5 ;;
      v6e) LHC_TPU_RUNTIME_VERSION=v2-alpha-tpuv6e ;;
      *) LHC_TPU_RUNTIME_VERSION=tpu-ubuntu2204-base ;;
    esac
  fi
  if [[ -z $LHC_TPU_NAME ]]; then
    local user
    user=$(printf '%s' "${USER:-user}" | tr '[:upper:]' '[:lower:]' | tr -c 'a-z0-9-' '-')
    LHC_TPU_NAME="lhc-${user}-${LHC_TPU_ACCELERATOR}"
  fi
  [[ $LHC_TPU_NAME =~ ^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$ ]] ||
    lhc_usage_error "VM name must be lowercase letters, digits and hyphens, got '$LHC_TPU_NAME'"
  [[ $LHC_TPU_ZONE =~ ^[a-z0-9-]+$ ]] || lhc_usage_error "bad zone '$LHC_TPU_ZONE'"
  local flag
  for flag in LHC_TPU_SPOT LHC_TPU_PREEMPTIBLE LHC_TPU_QUEUED; do
    [[ ${!flag} == 0 || ${!flag} == 1 ]] || lhc_usage_error "$flag must be 0 or 1, got '${!flag}'"
  done
  [[ $LHC_TPU_SPOT == 1 && $LHC_TPU_PREEMPTIBLE == 1 ]] &&
    lhc_usage_error "choose one of spot and preemptible"
  [[ $LHC_TPU_QUEUED == 1 && $LHC_TPU_PREEMPTIBLE == 1 ]] &&
    lhc_usage_error "queued resources take --spot, not --preemptible"
  lhc_is_uint "$LHC_TPU_POLL_SECONDS" ||
    lhc_usage_error "poll seconds must be a whole number, got '$LHC_TPU_POLL_SECONDS'"
  lhc_is_uint "$LHC_TPU_WAIT_TIMEOUT" ||
    lhc_usage_error "wait timeout must be a whole number, got '$LHC_TPU_WAIT_TIMEOUT'"
  # Checked here because a missing gcloud would otherwise read as a missing VM.
  command -v gcloud >/dev/null ||
    lhc_die "gcloud is not on PATH; install the Google Cloud CLI (https://cloud.google.com/sdk)"
  return 0
}

lhc_tpu_export() {
  export LHC_TPU_PROJECT LHC_TPU_ZONE LHC_TPU_NAME LHC_TPU_ACCELERATOR \
    LHC_TPU_RUNTIME_VERSION LHC_TPU_SPOT LHC_TPU_PREEMPTIBLE LHC_TPU_QUEUED \
    LHC_TPU_POLL_SECONDS LHC_TPU_WAIT_TIMEOUT LHC_TPU_CREATE_FLAGS
}

lhc_tpu_describe_settings() {
  local tier=on-demand
  [[ $LHC_TPU_SPOT == 1 ]] && tier=spot
  [[ $LHC_TPU_PREEMPTIBLE == 1 ]] && tier=preemptible
  [[ $LHC_TPU_QUEUED == 1 ]] && tier="$tier, queued"
  lhc_log "VM $LHC_TPU_NAME: $LHC_TPU_ACCELERATOR in $LHC_TPU_ZONE${LHC_TPU_PROJECT:+ (project $LHC_TPU_PROJECT)}, runtime $LHC_TPU_RUNTIME_VERSION, $tier"
}

# --- gcloud ---------------------------------------------------------------------------

# lhc_gcloud GROUP VERB NAME [ARGS...] runs
#   gcloud compute tpus GROUP VERB NAME --zone ZONE [--project P] ARGS...
lhc_gcloud() {
  local group=$1 verb=$2 name=$3
  shift 3
  local cmd=(gcloud compute tpus "$group" "$verb" "$name" --zone "$LHC_TPU_ZONE")
  [[ -n $LHC_TPU_PROJECT ]] && cmd+=(--project "$LHC_TPU_PROJECT")
  cmd+=("$@")
  if [[ $verb != describe ]]; then
    lhc_log "+ $(lhc_quote_cmd "${cmd[@]}")"
  fi
  "${cmd[@]}"
}

# Prints the state of GROUP's NAME (READY, PREEMPTED, ACTIVE, ...) or NOT_FOUND.
# Returns 1, after printing gcloud's error, when the state cannot be read.
_lhc_state() {
  local group=$1 format=$2 err out
  err=$(mktemp)
  if out=$(lhc_gcloud "$group" describe "$LHC_TPU_NAME" --format="value($format)" 2>"$err"); then
    rm -f "$err"
    printf '%s\n' "${out:-UNKNOWN}"
  elif grep -qiE 'NOT_FOUND|not found|does not exist' "$err"; then
    rm -f "$err"
    echo NOT_FOUND
  else
    cat "$err" >&2
    rm -f "$err"
    return 1
  fi
}

lhc_vm_state() {
  _lhc_state tpu-vm state
}

lhc_queued_state() {
  _lhc_state queued-resources state.state
}

# Deletes the VM (with its queued resource when queued); a missing VM is not an error.
lhc_delete_vm() {
  if [[ $LHC_TPU_QUEUED == 1 ]]; then
    local qstate
    qstate=$(lhc_queued_state) || return 1
    if [[ $qstate != NOT_FOUND ]]; then
      lhc_gcloud queued-resources delete "$LHC_TPU_NAME" --force --quiet
      return
    fi
  fi
  local state
  state=$(lhc_vm_state) || return 1
  if [[ $state != NOT_FOUND ]]; then
    lhc_gcloud tpu-vm delete "$LHC_TPU_NAME" --quiet
  fi
}

# --- run settings (run.sh, babysit.sh) -----------------------------------------------

lhc_run_defaults() {
  : "${LHC_REPO_URL:=}"
  : "${LHC_REPO_REF:=main}"
  : "${LHC_SRC:=}"
  : "${LHC_REMOTE_DIR:=lhc}"
  : "${LHC_VENV:=lhc-venv}"
  : "${LHC_EXTRAS=tpu}"
  : "${LHC_RUN_ENV:=}"
  : "${LHC_RUN_ID:=}"
  : "${LHC_LOG_DIR:=$LHC_GCP_DIR/logs}"
  : "${LHC_TPU_SSH_FLAGS:=}"
}

lhc_run_options_help() {
  cat <<'EOF_HELP'
Code and run options (flag / environment variable / default):
  --src DIR               LHC_SRC              the checkout holding this script; copied to
                                               every worker (files git would track, or all
                                               but .git/.venv/caches outside git)
  --repo URL              LHC_REPO_URL         (none) clone URL on the workers instead of
                                               copying --src
  --ref REF               LHC_REPO_REF         main (branch, tag or commit, with --repo)
  --remote-dir DIR        LHC_REMOTE_DIR       lhc (on the workers, relative to $HOME)
  --venv DIR              LHC_VENV             lhc-venv (on the workers, relative to $HOME)
  --extras LIST           LHC_EXTRAS           tpu (pip extras installed on the workers)
  --env KEY=VALUE         LHC_RUN_ENV          extra environment for lhc, repeatable
                                               (e.g. LIBTPU_INIT_ARGS=...); the variable
                                               holds one KEY=VALUE per line
  --run-id ID             LHC_RUN_ID           UTC time, e.g. 20250101T120000Z (log names)
  --log-dir DIR           LHC_LOG_DIR          gcp/logs (local copy of all workers' output)
  --ssh-flag FLAG         LHC_TPU_SSH_FLAGS    extra gcloud ssh/scp flag, repeatable (e.g.
                                               --ssh-flag=--internal-ip); space-separated
EOF_HELP
}

# Like lhc_tpu_parse_option, for the code and run options.
# shellcheck disable=SC2034  # LHC_CONSUMED is read by the calling script
lhc_run_parse_option() {
  LHC_CONSUMED=0
  case $1 in
    --src | --repo | --ref | --remote-dir | --venv | --extras | --env | --run-id | --log-dir | \
      --ssh-flag)
      (($# >= 2)) || lhc_usage_error "$1 needs a value"
      case $1 in
        --src) LHC_SRC=$2 ;;
        --repo) LHC_REPO_URL=$2 ;;
        --ref) LHC_REPO_REF=$2 ;;
        --remote-dir) LHC_REMOTE_DIR=$2 ;;
        --venv) LHC_VENV=$2 ;;
        --extras) LHC_EXTRAS=$2 ;;
        --env) LHC_RUN_ENV="${LHC_RUN_ENV:+$LHC_RUN_ENV$'\n'}$2" ;;
        --run-id) LHC_RUN_ID=$2 ;;
        --log-dir) LHC_LOG_DIR=$2 ;;
        --ssh-flag) LHC_TPU_SSH_FLAGS="${LHC_TPU_SSH_FLAGS:+$LHC_TPU_SSH_FLAGS }$2" ;;
      esac
      LHC_CONSUMED=2
      ;;
  esac
}

# A path on the workers that scripts delete and replace: never $HOME itself or outside it
# by accident.
_lhc_check_remote_path() {
  local what=$1 path=$2
  [[ -n $path && $path =~ ^[A-Za-z0-9._/-]+$ ]] ||
    lhc_usage_error "$what must be a plain path, got '$path'"
  case "/$path/" in
    */../* | */./* | //) lhc_usage_error "$what must not contain '.' or '..' parts, got '$path'" ;;
  esac
  [[ $path != /* || $path =~ ^/[^/]+/[^/]+/[^/]+ ]] ||
    lhc_usage_error "$what: an absolute path needs three parts (or give one relative to \$HOME), got '$path'"
}

lhc_run_finalize() {
  if [[ -z $LHC_REPO_URL ]]; then
    [[ -n $LHC_SRC ]] || LHC_SRC=$(cd "$LHC_GCP_DIR/.." && pwd)
    [[ -f $LHC_SRC/pyproject.toml ]] ||
      lhc_usage_error "--src must be an lhc checkout (no pyproject.toml in '$LHC_SRC')"
  fi
  [[ -n $LHC_REPO_REF ]] || lhc_usage_error "--ref must not be empty"
  _lhc_check_remote_path --remote-dir "$LHC_REMOTE_DIR"
  _lhc_check_remote_path --venv "$LHC_VENV"
  [[ $LHC_EXTRAS =~ ^[A-Za-z0-9_,-]*$ ]] || lhc_usage_error "bad extras '$LHC_EXTRAS'"
  [[ -n $LHC_RUN_ID ]] || LHC_RUN_ID=$(date -u +%Y%m%dT%H%M%SZ)
  [[ $LHC_RUN_ID =~ ^[A-Za-z0-9._-]+$ ]] ||
    lhc_usage_error "run id must be letters, digits, '.', '_' or '-', got '$LHC_RUN_ID'"
  local line
  while IFS= read -r line; do
    [[ -z $line || $line =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] ||
      lhc_usage_error "--env takes KEY=VALUE, got '$line'"
  done <<<"$LHC_RUN_ENV"
  return 0
}

lhc_run_export() {
  export LHC_REPO_URL LHC_REPO_REF LHC_SRC LHC_REMOTE_DIR LHC_VENV LHC_EXTRAS LHC_RUN_ENV \
    LHC_RUN_ID LHC_LOG_DIR LHC_TPU_SSH_FLAGS
}
