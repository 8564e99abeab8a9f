#!/usr/bin/env bash
# Keeps an lhc command running on a TPU VM until it succeeds: when the VM is missing,
# PREEMPTED or TERMINATED it is deleted and created again, and the command is rerun
# through run.sh (setup included). lhc resumes from the latest checkpoint in --workdir,
# so the workdir must outlive the VM (a gs:// path). Run this on a machine that stays up
# (a small VM or Cloud Shell in tmux), not on the TPU VM.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<EOF
Usage: $(basename "$0") [options] -- LHC_ARGS...

Loop: make sure the TPU VM exists and is READY (recreating it after preemption), run
\`lhc LHC_ARGS...\` on all workers with run.sh, and stop when it exits 0. Pass a gs://
--workdir so that every rerun resumes from the latest checkpoint.

$(lhc_tpu_options_help)

$(lhc_run_options_help)

Babysitting options (flag / environment variable / default):
  --max-attempts N        LHC_BABYSIT_MAX_ATTEMPTS  20  runs of the command (or failed
                                                        creations) before giving up
  --max-failures N        LHC_BABYSIT_MAX_FAILURES  3   failures on a VM that is still READY
                                                        afterwards (a bug, not a preemption)
  --delete-when-done      LHC_BABYSIT_DELETE_WHEN_DONE=1  delete the VM after success
  (--poll-seconds is also the sleep between attempts)
  -h, --help              show this help

Example:
  $(basename "$0") --name lhc-v5p --accelerator v5p-16 --spot -- \\
      train --config configs/lm_assoc_recall.py:small --workdir gs://BUCKET/lhc/run1
EOF
}

main() {
  lhc_tpu_defaults
  lhc_run_defaults
  local max_attempts=${LHC_BABYSIT_MAX_ATTEMPTS:-20}
  local max_failures=${LHC_BABYSIT_MAX_FAILURES:-3}
  local delete_when_done=${LHC_BABYSIT_DELETE_WHEN_DONE:-0}
  while (($#)); do
    if [[ $1 == --*=* ]]; then
      set -- "${1%%=*}" "${1#*=}" "${@:2}"
    fi
    case $1 in
      -h | --help)
        usage
        exit 0
        ;;
      --)
        shift
        break
        ;;
      --delete-when-done)
        delete_when_done=1
        shift
        continue
        ;;
      --max-attempts | --max-failures)
        (($# >= 2)) || lhc_usage_error "$1 needs a value"
        if [[ $1 == --max-attempts ]]; then max_attempts=$2; else max_failures=$2; fi
        shift 2
        continue
        ;;
    esac
    lhc_tpu_parse_option "$@"
    ((LHC_CONSUMED > 0)) || lhc_run_parse_option "$@"
    ((LHC_CONSUMED > 0)) || lhc_usage_error "unknown argument '$1' (put the lhc arguments after --)"
    shift "$LHC_CONSUMED"
  done
  [[ ${1:-} == lhc ]] && shift
  (($# > 0)) || lhc_usage_error "no lhc command given (e.g. -- train --config ... --workdir gs://...)"
  if ! lhc_is_uint "$max_attempts" || ((max_attempts == 0)); then
    lhc_usage_error "--max-attempts must be a positive number, got '$max_attempts'"
  fi
  if ! lhc_is_uint "$max_failures" || ((max_failures == 0)); then
    lhc_usage_error "--max-failures must be a positive number, got '$max_failures'"
  fi
  [[ $delete_when_done == 0 || $delete_when_done == 1 ]] ||
    lhc_usage_error "LHC_BABYSIT_DELETE_WHEN_DONE must be 0 or 1"
  lhc_tpu_finalize
  lhc_run_finalize
  lhc_tpu_describe_settings
  # The children read every setting from the environment.
  lhc_tpu_export
  lhc_run_export
  local run_id_base=$LHC_RUN_ID

  local attempt=0 failures=0 rc=1 state
  while ((attempt < max_attempts)); do
    attempt=$((attempt + 1))
    lhc_log "attempt $attempt of $max_attempts"
    if ! state=$(lhc_vm_state); then
      lhc_log "cannot read the state of $LHC_TPU_NAME; retrying in ${LHC_TPU_POLL_SECONDS}s"
      sleep "$LHC_TPU_POLL_SECONDS"
      continue
    fi
    lhc_log "state of $LHC_TPU_NAME: $state"
    case $state in
      PREEMPTED | TERMINATED)
        lhc_log "$LHC_TPU_NAME was $state; deleting it to create it again"
        lhc_delete_vm || true
        ;;
    esac
    if [[ $state != READY ]] && ! "$LHC_GCP_DIR/create_tpu_vm.sh"; then
      lhc_log "could not get $LHC_TPU_NAME READY; retrying in ${LHC_TPU_POLL_SECONDS}s"
      sleep "$LHC_TPU_POLL_SECONDS"
      continue
    fi

    export LHC_RUN_ID="$run_id_base-a$attempt"
    rc=0
    "$LHC_GCP_DIR/run.sh" -- "$@" || rc=$?
    if ((rc == 0)); then
      lhc_log "lhc $1 succeeded on attempt $attempt"
      if [[ $delete_when_done == 1 ]]; then
        lhc_delete_vm
      fi
      return 0
    fi
    state=$(lhc_vm_state) || state=UNREADABLE
    if [[ $state == READY ]]; then
      failures=$((failures + 1))
      lhc_log "lhc $1 exited $rc while $LHC_TPU_NAME stayed READY (failure $failures of $max_failures)"
      if ((failures >= max_failures)); then
        lhc_log "giving up: this looks like a bug rather than a preemption; the VM is left running"
        return "$rc"
      fi
    else
      lhc_log "lhc $1 exited $rc and $LHC_TPU_NAME is $state (preempted?)"
    fi
    lhc_log "retrying in ${LHC_TPU_POLL_SECONDS}s"
    sleep "$LHC_TPU_POLL_SECONDS"
  done
  lhc_log "giving up after $max_attempts attempts (last exit $rc)"
  return "$((rc == 0 ? 1 : rc))"
}

main "$@"
