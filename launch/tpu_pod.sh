#!/usr/bin/env bash
# A multi-host Cloud TPU slice: install the project on every worker and run the same
# `asyncopd train` on all of them (one learner process per host, jax.distributed).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: launch/tpu_pod.sh COMMAND [ARGS ...]

Commands (each runs on every worker of $TPU_NAME through
`gcloud compute tpus tpu-vm ssh --worker=all`):
  setup                 copy the project to $REMOTE_DIR on every worker and
                        `pip install -e ".[tpu]"` into $REMOTE_DIR/.venv
  train [CONFIG] [ARGS] start `asyncopd train --config CONFIG
                        --set distributed.initialize=true --set output_dir=$RUN_DIR ARGS`
                        on every worker, detached; JAX finds the coordinator,
                        the process count and this worker's id itself.
                        Continue a stopped run: train --resume $RUN_DIR/<name>
  stages [CONFIG] [ARGS] on every worker of $STAGE_TPU_NAME (a second slice that
                        reaches the same bucket or mounts the same directory): launch/stage_host.sh
                        with one rollout process per chip in $STAGE_CHIPS; give the
                        same CONFIG and ARGS as to train (they name the run)
  stop                  kill what train / stages started (by the process ids they
                        recorded); the run resumes from its last checkpoint
  logs                  follow worker 0's learner log
  exec 'SHELL COMMAND'  run a command on every worker (mount the shared file
                        system, copy model directories, nvidia-/tpu-info ...)

Environment (default in brackets):
  TPU_NAME          the learner's TPU slice                              (required)
  ZONE              its zone                                             (required)
  PROJECT           Google Cloud project       [gcloud's configured project]
  RUN_DIR           where the runs go: a bucket (gs://BUCKET/runs; the workers'
                    service account needs read and write on it) or a directory
                    every worker mounts at the same path (Filestore/NFS); becomes
                    output_dir, so the run is $RUN_DIR/<name>/ (a learner over
                    several hosts too: each checkpoints its own part)
                                                             (required: train, stages)
  REMOTE_DIR        the project's directory on each worker, relative to the
                    home directory or absolute                             [asyncopd]
  SOURCE            setup from: tarball (this checkout's tracked and untracked,
                    not ignored, files) or git ($REPO_URL at $GIT_REF)     [tarball]
  REPO_URL, GIT_REF for SOURCE=git                                   [-, main]
  REMOTE_PYTHON     Python >= 3.11 on the workers for the venv           [python3]
  PIP_ARGS          extra arguments to pip install                       []
  COORDINATOR_ADDRESS  "host:port" of worker 0; "" lets JAX detect it    []
  LOG_DIR           per-worker logs    [$RUN_DIR/launch-logs; for a bucket,
                    launch-logs in $REMOTE_DIR on each worker]
  STAGE_TPU_NAME    the stage slice (stages; stop and exec also reach it) []
  STAGE_ZONE        its zone                                             [$ZONE]
  STAGE_CHIPS       chips of each stage worker, one rollout process each [0 1 2 3]
  STAGE_SCORING_CHIPS  chips for teacher-scoring processes (needs
                    stages.scoring_processes >= 1 in the config)         []
  FOREGROUND        1: train / stages stay attached to this terminal     [0]
  GCLOUD_SSH_ARGS   extra gcloud ssh/scp flags, e.g. --tunnel-through-iap []

Nothing is downloaded at run time: put the model directories (student.path,
teacher.path) on every worker or on the shared file system first, e.g.
  launch/tpu_pod.sh exec 'asyncopd/.venv/bin/hf download Qwen/Qwen3-4B --local-dir ~/models/Qwen3-4B'
(after setup; or once onto the shared file system from any machine that mounts it)

Example:
  export TPU_NAME=opd-v5p-32 ZONE=us-east5-a RUN_DIR=/mnt/shared/runs
  launch/tpu_pod.sh exec 'sudo mkdir -p /mnt/shared && sudo mount -t nfs 10.0.0.2:/share /mnt/shared'
  launch/tpu_pod.sh setup
  launch/tpu_pod.sh train asyncopd_jax/configs/qwen3_0.6b_from_4b_tpu.yaml --set name=qwen3-0.6b-a
  STAGE_TPU_NAME=opd-v5p-8 launch/tpu_pod.sh stages asyncopd_jax/configs/qwen3_0.6b_from_4b_tpu.yaml --set name=qwen3-0.6b-a
  launch/tpu_pod.sh logs
EOF
}

if [[ $# -eq 0 ]]; then usage >&2; exit 2; fi
if [[ $1 == -h || $1 == --help ]]; then usage; exit 0; fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=launch/common.sh
source "$HERE/common.sh"

COMMAND=$1
shift
TPU_NAME=${TPU_NAME:-}
ZONE=${ZONE:-}
PROJECT=${PROJECT:-}
RUN_DIR=${RUN_DIR:-}
REMOTE_DIR=${REMOTE_DIR:-asyncopd}
SOURCE=${SOURCE:-tarball}
REPO_URL=${REPO_URL:-}
GIT_REF=${GIT_REF:-main}
REMOTE_PYTHON=${REMOTE_PYTHON:-python3}
PIP_ARGS=${PIP_ARGS:-}
COORDINATOR_ADDRESS=${COORDINATOR_ADDRESS:-}
if [[ $RUN_DIR == *://* ]]; then LOG_DIR=${LOG_DIR:-launch-logs}; else LOG_DIR=${LOG_DIR:-${RUN_DIR:+$RUN_DIR/launch-logs}}; fi
STAGE_TPU_NAME=${STAGE_TPU_NAME:-}
STAGE_ZONE=${STAGE_ZONE:-$ZONE}
STAGE_CHIPS=${STAGE_CHIPS-0 1 2 3}
STAGE_SCORING_CHIPS=${STAGE_SCORING_CHIPS-}
FOREGROUND=${FOREGROUND:-0}
GCLOUD_SSH_ARGS=${GCLOUD_SSH_ARGS:-}

[[ -n $TPU_NAME ]] || die "set TPU_NAME (the TPU slice of the learner)"
[[ -n $ZONE ]] || die "set ZONE (the zone of $TPU_NAME)"
command -v gcloud >/dev/null || die "gcloud is not on PATH"
read -r -a ssh_extra <<<"$GCLOUD_SSH_ARGS"

# Run a bash script on every worker of a slice. $1: slice, $2: zone, $3: script.
# The script travels base64-encoded, so no shell on the way re-reads its quoting.
on_workers() {
    local name=$1 zone=$2 script=$3 encoded
    encoded=$(printf '%s' "$script" | base64 | tr -d '\n')
    gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" ${PROJECT:+--project "$PROJECT"} --worker=all \
        "${ssh_extra[@]}" --command "echo $encoded | base64 -d | bash"
}

# The words of "$@" quoted for bash.
quoted() {
    local out="" word
    for word in "$@"; do out+=" $(printf '%q' "$word")"; done
    printf '%s' "${out# }"
}

# Arguments of `asyncopd train` on the workers: [CONFIG] ARGS → --config CONFIG ARGS.
train_args() {
    local a=()
    if [[ $# -gt 0 && $1 != -* ]]; then
        a=(--config "$1")
        shift
    fi
    a+=(--set distributed.initialize=true --set "output_dir=$(yaml_str "$RUN_DIR")")
    [[ -n $COORDINATOR_ADDRESS ]] && a+=(--set "distributed.coordinator_address=$(yaml_str "$COORDINATOR_ADDRESS")")
    a+=("$@")
    quoted "${a[@]}"
}

# Start a command detached (FOREGROUND=0) or attached, recording its process group.
# $1: name (pid file ~/.asyncopd-$1.pid, log $LOG_DIR/$1-<host>.log), $2: bash commands
# ending in an exec of the long-running process (so the recorded pid is its own).
detached() {
    local name=$1 command=$2 inner
    inner="echo \$\$ > ~/.asyncopd-$name.pid
$command"
    cat <<EOF
mkdir -p $(printf '%q' "$LOG_DIR")
log=$(printf '%q' "$LOG_DIR")/$name-\$(hostname).log
pidfile=~/.asyncopd-$name.pid
if [ -f "\$pidfile" ] && kill -0 "\$(cat "\$pidfile")" 2>/dev/null; then
    echo "\$(hostname): $name is already running (pid \$(cat "\$pidfile")); launch/tpu_pod.sh stop first" >&2
    exit 1
fi
if [ $(printf '%q' "$FOREGROUND") = 1 ]; then
    bash -c $(printf '%q' "$inner") 2>&1 | tee "\$log"
else
    setsid nohup bash -c $(printf '%q' "$inner") >"\$log" 2>&1 </dev/null &
    echo "\$(hostname): started $name, log \$log"
fi
EOF
}

enter_project() {
    cat <<EOF
set -euo pipefail
cd $(printf '%q' "$REMOTE_DIR")
. .venv/bin/activate
EOF
}

case $COMMAND in
    setup)
        remote_dir=$(printf '%q' "$REMOTE_DIR")
        if [[ $SOURCE == tarball ]]; then
            tgz=$(mktemp "${TMPDIR:-/tmp}/asyncopd-src.XXXXXX.tgz")
            trap 'rm -f "$tgz"' EXIT
            git -C "$REPO_ROOT" ls-files -z -co --exclude-standard | tar -C "$REPO_ROOT" --null -T - -czf "$tgz"
            log "copying $(du -h "$tgz" | cut -f1) of sources to every worker of $TPU_NAME"
            gcloud compute tpus tpu-vm scp "$tgz" "$TPU_NAME:/tmp/asyncopd-src.tgz" --zone "$ZONE" \
                ${PROJECT:+--project "$PROJECT"} --worker=all "${ssh_extra[@]}"
            fetch="mkdir -p $remote_dir && tar -xzf /tmp/asyncopd-src.tgz -C $remote_dir && rm -f /tmp/asyncopd-src.tgz"
        elif [[ $SOURCE == git ]]; then
            [[ -n $REPO_URL ]] || die "SOURCE=git needs REPO_URL"
            fetch="[ -d $remote_dir/.git ] || git clone --quiet $(printf '%q' "$REPO_URL") $remote_dir
git -C $remote_dir fetch --quiet origin $(printf '%q' "$GIT_REF")
git -C $remote_dir checkout --quiet --detach FETCH_HEAD"
        else
            die "SOURCE=$SOURCE is invalid; allowed: tarball, git"
        fi
        on_workers "$TPU_NAME" "$ZONE" "set -euo pipefail
$fetch
py=$(printf '%q' "$REMOTE_PYTHON")
\"\$py\" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo \"\$(hostname): \$py is Python \$(\"\$py\" -V 2>&1); asyncopd needs >= 3.11 (set REMOTE_PYTHON)\" >&2; exit 1; }
[ -x $remote_dir/.venv/bin/python ] || \"\$py\" -m venv $remote_dir/.venv
. $remote_dir/.venv/bin/activate
pip install --quiet --upgrade pip
pip install --quiet $PIP_ARGS -e \"${remote_dir}[tpu]\"
echo \"\$(hostname): \$(asyncopd --help >/dev/null && echo asyncopd installed), jax \$(python -c 'import jax; print(jax.__version__)')\""
        ;;
    train)
        [[ -n $RUN_DIR ]] || die "set RUN_DIR (a bucket URL, or a directory every worker mounts at the same path)"
        command="exec asyncopd train --no-progress $(train_args "$@")"
        mounted="[[ $(printf '%q' "$RUN_DIR") == *://* || -d $(printf '%q' "$RUN_DIR") ]] || { echo \"\$(hostname): $RUN_DIR is not mounted\" >&2; exit 1; }"
        on_workers "$TPU_NAME" "$ZONE" "$(enter_project)
$mounted
$(detached train "$command")"
        ;;
    stages)
        [[ -n $RUN_DIR ]] || die "set RUN_DIR (a bucket URL, or a directory every worker mounts at the same path)"
        [[ -n $STAGE_TPU_NAME ]] || die "set STAGE_TPU_NAME (the slice that runs rollout and scoring)"
        # The exchange directory of the run, resolved on the worker from the same
        # arguments as train; each worker numbers its processes from 100·(worker + 1).
        command="source launch/common.sh
exchange=\$(resolve_run_dir $(train_args "$@"))/exchange
worker=\$(curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || echo 0)
export DEVICE_KIND=tpu ROLLOUT_DEVICES=$(printf '%q' "$STAGE_CHIPS") SCORING_DEVICES=$(printf '%q' "$STAGE_SCORING_CHIPS")
export INDEX_BASE=\$((100 * (worker + 1)))
exec bash launch/stage_host.sh \"\$exchange\""
        on_workers "$STAGE_TPU_NAME" "$STAGE_ZONE" "$(enter_project)
$(detached stages "$command")"
        ;;
    stop)
        script='for name in train stages; do
    pidfile=~/.asyncopd-$name.pid
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        echo "$(hostname): stopped $name (process group $pid)"
    fi
    rm -f "$pidfile"
done'
        on_workers "$TPU_NAME" "$ZONE" "$script"
        if [[ -n $STAGE_TPU_NAME ]]; then on_workers "$STAGE_TPU_NAME" "$STAGE_ZONE" "$script"; fi
        ;;
    logs)
        [[ -n $LOG_DIR ]] || die "set RUN_DIR or LOG_DIR"
        gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" ${PROJECT:+--project "$PROJECT"} --worker=0 \
            "${ssh_extra[@]}" --command "tail -n 200 -F $(printf '%q' "$LOG_DIR")/train-\$(hostname).log"
        ;;
    exec)
        [[ $# -ge 1 ]] || die "exec needs a shell command"
        on_workers "$TPU_NAME" "$ZONE" "$*"
        if [[ -n $STAGE_TPU_NAME ]]; then on_workers "$STAGE_TPU_NAME" "$STAGE_ZONE" "$*"; fi
        ;;
    *)
        usage >&2
        die "unknown command '$COMMAND'"
        ;;
esac
