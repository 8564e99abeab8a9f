#!/usr/bin/env bash
# Runs an lhc command on every worker of a TPU VM: copies the code (or lets the workers
# clone it), runs setup_worker.sh, then `LHC_DISTRIBUTED=1 lhc ARGS...` on all workers at
# once, so that jax.distributed.initialize() joins them into one job. Output goes to one
# log per worker on the workers and to a combined log here. Exits with gcloud's status.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
  cat <<EOF
Usage: $(basename "$0") [options] -- LHC_ARGS...

Runs \`lhc LHC_ARGS...\` with LHC_DISTRIBUTED=1 on all workers of an existing TPU VM
(create it with create_tpu_vm.sh). A leading "lhc" in LHC_ARGS is dropped.

$(lhc_tpu_options_help)

$(lhc_run_options_help)

  -h, --help              show this help

Logs: $(basename "$0") tees every worker's output to LOG_DIR/NAME-RUN_ID.log here; each
worker also writes ~/lhc-logs/RUN_ID.HOSTNAME.log.

Example:
  $(basename "$0") --name lhc-v5e -- train --config configs/lm_assoc_recall.py:small \\
      --workdir gs://BUCKET/lhc/run1 --config.seed=1
EOF
}

# Prints a path on the workers as shell words: relative ones are relative to $HOME there.
_remote_path() {
  if [[ $1 == /* ]]; then
    printf '%q' "$1"
  else
    # shellcheck disable=SC2016  # $HOME is expanded on the worker
    printf '"$HOME"/%q' "$1"
  fi
}

# Copies the files git would track (or everything but .git, venvs and caches outside git)
# into a tarball, so the workers get an exact mirror of the local checkout.
_make_source_tarball() {
  local src=$1 out=$2
  if git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (
      cd "$src"
      git ls-files -z --cached --others --exclude-standard |
        while IFS= read -r -d '' file; do
          # Tracked files deleted in the working tree are listed too; skip them.
          if [[ -e $file ]]; then
            printf '%s\0' "$file"
          fi
        done |
        tar -czf "$out" --null -T -
    )
  else
    tar -C "$src" -czf "$out" --exclude=.git --exclude=.venv --exclude=__pycache__ \
      --exclude='*.egg-info' --exclude=./gcp/logs .
  fi
}

# The command every worker runs, as one string for `gcloud ... ssh --command`. Every
# value that comes from the user goes through printf %q.
# shellcheck disable=SC2016  # the $HOME, $log and $(hostname) here expand on the worker
_remote_command() {
  local copied=$1
  shift
  local remote_dir venv setup_args=() env_words=() line value script
  remote_dir=$(_remote_path "$LHC_REMOTE_DIR")
  venv=$(_remote_path "$LHC_VENV")
  setup_args=(--src-dir "$LHC_REMOTE_DIR" --venv "$LHC_VENV" --extras "$LHC_EXTRAS")
  if [[ -n $LHC_REPO_URL ]]; then
    setup_args+=(--repo "$LHC_REPO_URL" --ref "$LHC_REPO_REF")
  fi
  while IFS= read -r line; do
    if [[ -n $line ]]; then
      printf -v value '%q' "${line#*=}"
      env_words+=("${line%%=*}=$value")
    fi
  done <<<"$LHC_RUN_ENV"

  script='set -o pipefail; mkdir -p "$HOME"/lhc-logs; '
  script+="log=\"\$HOME\"/lhc-logs/$(printf '%q' "$LHC_RUN_ID").\"\$(hostname)\".log; "
  script+='{ '
  if [[ $copied == 1 ]]; then
    local staging
    staging=$(_remote_path "$LHC_REMOTE_DIR.incoming")
    script+="rm -rf $staging && mkdir -p $staging && "
    script+="tar -xzf \"\$HOME\"/lhc-src.tar.gz -C $staging && "
    script+="rm -rf $remote_dir && mv $staging $remote_dir && rm -f \"\$HOME\"/lhc-src.tar.gz && "
  fi
  script+="bash \"\$HOME\"/lhc-setup_worker.sh $(lhc_quote_cmd "${setup_args[@]}") && "
  script+="cd $remote_dir && "
  script+="LHC_DISTRIBUTED=1 ${env_words[*]+${env_words[*]} }$venv/bin/lhc $(lhc_quote_cmd "$@"); "
  script+='} 2>&1 | tee -a "$log"'
  printf '%s' "$script"
}

main() {
  lhc_tpu_defaults
  lhc_run_defaults
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
    esac
    lhc_tpu_parse_option "$@"
    ((LHC_CONSUMED > 0)) || lhc_run_parse_option "$@"
    ((LHC_CONSUMED > 0)) || lhc_usage_error "unknown argument '$1' (put the lhc arguments after --)"
    shift "$LHC_CONSUMED"
  done
  [[ ${1:-} == lhc ]] && shift
  (($# > 0)) || lhc_usage_error "no lhc command given (e.g. -- train --config ... --workdir gs://...)"
  lhc_tpu_finalize
  lhc_run_finalize

  local ssh_flags=()
  if [[ -n $LHC_TPU_SSH_FLAGS ]]; then
    read -r -a ssh_flags <<<"$LHC_TPU_SSH_FLAGS"
  fi
  local stage
  stage=$(mktemp -d)
  # shellcheck disable=SC2064  # expand $stage now: it is local to main
  trap "rm -rf '$stage'" EXIT
  cp "$LHC_GCP_DIR/setup_worker.sh" "$stage/lhc-setup_worker.sh"
  local files=("$stage/lhc-setup_worker.sh") copied=0
  if [[ -z $LHC_REPO_URL ]]; then
    lhc_log "packing $LHC_SRC"
    _make_source_tarball "$LHC_SRC" "$stage/lhc-src.tar.gz"
    files+=("$stage/lhc-src.tar.gz")
    copied=1
  fi

  local scp_cmd=(gcloud compute tpus tpu-vm scp "${files[@]}" "$LHC_TPU_NAME:"
    --zone "$LHC_TPU_ZONE" --worker=all)
  [[ -n $LHC_TPU_PROJECT ]] && scp_cmd+=(--project "$LHC_TPU_PROJECT")
  scp_cmd+=(${ssh_flags[@]+"${ssh_flags[@]}"})
  lhc_log "+ $(lhc_quote_cmd "${scp_cmd[@]}")"
  "${scp_cmd[@]}"

  local remote
  remote=$(_remote_command "$copied" "$@")
  mkdir -p "$LHC_LOG_DIR"
  local local_log="$LHC_LOG_DIR/$LHC_TPU_NAME-$LHC_RUN_ID.log"
  lhc_log "logs: $local_log here, ~/lhc-logs/$LHC_RUN_ID.<hostname>.log on each worker"
  local rc=0
  # Keep-alives make a dead (e.g. preempted) VM end the session within minutes instead
  # of leaving it hanging, so babysit.sh notices.
  lhc_gcloud tpu-vm ssh "$LHC_TPU_NAME" --worker=all \
    --ssh-flag=-oServerAliveInterval=60 --ssh-flag=-oServerAliveCountMax=5 \
    ${ssh_flags[@]+"${ssh_flags[@]}"} --command "$remote" 2>&1 | tee -a "$local_log" || rc=$?
  if ((rc == 0)); then
    lhc_log "lhc $1 finished on all workers of $LHC_TPU_NAME"
  else
    lhc_log "lhc $1 failed on $LHC_TPU_NAME (exit $rc); see $local_log"
  fi
  return "$rc"
}

main "$@"
