#!/usr/bin/env bash
# Creates a Cloud TPU VM (directly or through a queued resource) and waits until it is
# READY. Idempotent: a READY VM is left alone, a starting one is waited for, a stopped
# one is started, a preempted or terminated one is deleted and created again.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<EOF
Usage: $(basename "$0") [options]

Creates the TPU VM unless it already exists and is READY, then waits until it is READY.

$(lhc_tpu_options_help)

  -h, --help              show this help

Examples:
  $(basename "$0") --name lhc-v5e --accelerator v5litepod-8 --spot
  LHC_TPU_NAME=lhc-v5p LHC_TPU_ACCELERATOR=v5p-16 $(basename "$0") --queued --spot
EOF
}

main() {
  lhc_tpu_defaults
  while (($#)); do
    if [[ $1 == --*=* ]]; then
      set -- "${1%%=*}" "${1#*=}" "${@:2}"
    fi
    case $1 in
      -h | --help)
        usage
        exit 0
        ;;
    esac
    lhc_tpu_parse_option "$@"
    ((LHC_CONSUMED > 0)) || lhc_usage_error "unknown argument '$1'"
    shift "$LHC_CONSUMED"
  done
  lhc_tpu_finalize
  lhc_tpu_describe_settings

  local state
  state=$(lhc_vm_state) || lhc_die "cannot read the state of $LHC_TPU_NAME (see gcloud's message above)"
  lhc_log "state of $LHC_TPU_NAME: $state"
  case $state in
    READY)
      lhc_log "$LHC_TPU_NAME exists and is READY; nothing to do"
      return 0
      ;;
    NOT_FOUND) _create ;;
    PREEMPTED | TERMINATED)
      # Spot and preemptible VMs cannot be restarted; only a new VM brings the TPU back.
      lhc_delete_vm
      _create
      ;;
    STOPPED)
      lhc_gcloud tpu-vm start "$LHC_TPU_NAME"
      ;;
    CREATING | STARTING | RESTARTING | REPAIRING | REIMAGING | UNHIDING) ;;
    *)
      lhc_die "$LHC_TPU_NAME is $state; wait, or delete it: gcloud compute tpus tpu-vm delete $LHC_TPU_NAME --zone $LHC_TPU_ZONE"
      ;;
  esac
  _wait_until_ready
}

_create() {
  local extra=()
  if [[ -n $LHC_TPU_CREATE_FLAGS ]]; then
    read -r -a extra <<<"$LHC_TPU_CREATE_FLAGS"
  fi
  if [[ $LHC_TPU_QUEUED == 1 ]]; then
    local qstate
    qstate=$(lhc_queued_state) || lhc_die "cannot read the queued resource $LHC_TPU_NAME"
    case $qstate in
      NOT_FOUND) ;;
      FAILED | SUSPENDED | SUSPENDING)
        lhc_log "queued resource $LHC_TPU_NAME is $qstate; deleting it"
        lhc_gcloud queued-resources delete "$LHC_TPU_NAME" --force --quiet
        ;;
      *)
        lhc_log "queued resource $LHC_TPU_NAME is already $qstate"
        return 0
        ;;
    esac
    local args=(--node-id "$LHC_TPU_NAME" --accelerator-type "$LHC_TPU_ACCELERATOR"
      --runtime-version "$LHC_TPU_RUNTIME_VERSION")
    [[ $LHC_TPU_SPOT == 1 ]] && args+=(--spot)
    lhc_gcloud queued-resources create "$LHC_TPU_NAME" "${args[@]}" ${extra[@]+"${extra[@]}"}
  else
    local args=(--accelerator-type "$LHC_TPU_ACCELERATOR" --version "$LHC_TPU_RUNTIME_VERSION")
    [[ $LHC_TPU_SPOT == 1 ]] && args+=(--spot)
    [[ $LHC_TPU_PREEMPTIBLE == 1 ]] && args+=(--preemptible)
    lhc_gcloud tpu-vm create "$LHC_TPU_NAME" "${args[@]}" ${extra[@]+"${extra[@]}"}
  fi
}

_wait_until_ready() {
  local start=$SECONDS state qstate
  while :; do
    state=$(lhc_vm_state) || state=UNREADABLE
    if [[ $state == READY ]]; then
      lhc_log "$LHC_TPU_NAME is READY"
      return 0
    fi
    case $state in
      PREEMPTED | TERMINATED) lhc_die "$LHC_TPU_NAME became $state while starting" ;;
    esac
    if [[ $LHC_TPU_QUEUED == 1 && $state == NOT_FOUND ]]; then
      qstate=$(lhc_queued_state) || qstate=UNREADABLE
      case $qstate in
        FAILED | SUSPENDED | NOT_FOUND)
          lhc_die "queued resource $LHC_TPU_NAME is $qstate: gcloud compute tpus queued-resources describe $LHC_TPU_NAME --zone $LHC_TPU_ZONE"
          ;;
      esac
      state="$state (queued resource $qstate)"
    fi
    if ((LHC_TPU_WAIT_TIMEOUT > 0 && SECONDS - start >= LHC_TPU_WAIT_TIMEOUT)); then
      lhc_die "$LHC_TPU_NAME is not READY after ${LHC_TPU_WAIT_TIMEOUT}s (last state: $state)"
    fi
    lhc_log "$LHC_TPU_NAME is $state; checking again in ${LHC_TPU_POLL_SECONDS}s"
    sleep "$LHC_TPU_POLL_SECONDS"
  done
}

main "$@"
