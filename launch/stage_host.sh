#!/usr/bin/env bash
# Rollout / teacher-scoring stage processes started by hand, one per device, on a host
# that reaches the run's exchange: a bucket URL, or a directory it mounts.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: launch/stage_host.sh EXCHANGE

Starts `asyncopd stage rollout|scoring` processes that join a running
`asyncopd train` (stages.placement = processes) through its exchange
EXCHANGE = <output_dir>/<name>/exchange: a bucket URL (gs://BUCKET/runs/NAME/exchange,
s3://…; the credentials and AWS_ENDPOINT_URL_S3 of this host's environment) or a
directory. Each process takes tickets (rollout) or sampled groups (scoring) from the
shared spools, like the stage processes the learner starts itself. Waits until the
learner has set the exchange up, restarts a process that dies (a restarted process
hands back what it had claimed) and returns when the run stops or on Ctrl-C / SIGTERM,
which stops its processes.

With a bucket the host needs nothing else of the learner's but the model directories,
at the paths the config names; with a directory it must also see the run and snapshot
directories at the learner's absolute paths.

Environment (default in brackets):
  DEVICE_KIND      cuda | tpu | cpu                                        [cuda]
  ROLLOUT_DEVICES  one rollout process per space-separated entry: CUDA
                   devices (cuda: "4" or "4,5"), TPU chips of this host
                   (tpu: "0-3" gives one process 4 chips; 1, 2, 4 or 8) or
                   a CPU list to pin to (cpu), e.g. "4 5"                   [0]
  SCORING_DEVICES  one scoring process per entry, same form; scoring
                   processes only get work if the learner started at least
                   one itself (stages.scoring_processes >= 1)               []
  INDEX_BASE       processes are named rollout-N / scoring-N from N =
                   INDEX_BASE; keep them apart from the learner's own
                   (0 .. stages.rollouts - 1) and other hosts'     [100]
  STAGE_CORES      "" leaves processes unpinned; "auto" deals this host's
                   cores out evenly (ignored for DEVICE_KIND=cpu)          []
  NICENESS         lower the stage processes' CPU priority by this much    [0]
  STAGE_RESTARTS   restarts per process before it is given up              [3]
  EXCHANGE_TIMEOUT seconds to wait for the learner to set up the exchange  [3600]
  LOG_DIR          where the logs go     [EXCHANGE/logs; ./stage-logs for a bucket]
  PYTHON           the Python of the environment asyncopd is installed in  [python]

Logs: LOG_DIR/<name>.log.

Examples (4 more rollout processes on GPUs 0-3 of a second node; on 4 chips of a TPU VM):
  ROLLOUT_DEVICES="0 1 2 3" INDEX_BASE=100 launch/stage_host.sh /shared/runs/qwen3/exchange
  DEVICE_KIND=tpu ROLLOUT_DEVICES="0-3" launch/stage_host.sh gs://my-bucket/runs/qwen3/exchange
EOF
}

[[ ${1:-} == -h || ${1:-} == --help ]] && { usage; exit 0; }
[[ $# -eq 1 ]] || { usage >&2; exit 2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$HERE/common.sh"

EXCHANGE=$1
DEVICE_KIND=${DEVICE_KIND:-cuda}
ROLLOUT_DEVICES=${ROLLOUT_DEVICES-0}
SCORING_DEVICES=${SCORING_DEVICES-}
INDEX_BASE=${INDEX_BASE:-100}
STAGE_CORES=${STAGE_CORES-}
NICENESS=${NICENESS:-0}
STAGE_RESTARTS=${STAGE_RESTARTS:-3}
EXCHANGE_TIMEOUT=${EXCHANGE_TIMEOUT:-3600}
if [[ $EXCHANGE == *://* ]]; then in_bucket=1; else in_bucket=0; fi
if ((in_bucket)); then LOG_DIR=${LOG_DIR:-stage-logs}; else LOG_DIR=${LOG_DIR:-$EXCHANGE/logs}; fi

# Whether the run has stopped, as far as this script can see: a bucket's STOP is read by
# the stage processes themselves (they exit 0 once the run stopped).
stopped() { ((in_bucket == 0)) && [[ -e $EXCHANGE/STOP ]]; }

command -v asyncopd >/dev/null || die "asyncopd is not on PATH (activate the environment it is installed in)"
read -r -a rollout_devices <<<"$ROLLOUT_DEVICES"
read -r -a scoring_devices <<<"$SCORING_DEVICES"
total=$((${#rollout_devices[@]} + ${#scoring_devices[@]}))
((total > 0)) || die "ROLLOUT_DEVICES and SCORING_DEVICES are both empty: nothing to start"

# The CPU list of process k of $total ("" = unpinned).
cores_for() {
    local k=$1 n share
    [[ $STAGE_CORES == auto ]] || { echo "$STAGE_CORES"; return; }
    n=$(nproc)
    share=$((n / total))
    ((share >= 1)) || { echo "$((k % n))"; return; }
    echo "$((k * share))-$((k * share + share - 1))"
}

# One stage process, restarted up to STAGE_RESTARTS times; returns when the run stops.
stage_loop() {
    local role=$1 index=$2 device=$3 cores=$4 name="$1-$2" tries=0 rc=0 child=""
    trap '[[ -n $child ]] && kill -TERM "$child" 2>/dev/null; wait 2>/dev/null; exit 143' TERM INT
    while ! stopped; do
        (
            if [[ $DEVICE_KIND == cpu ]]; then export JAX_PLATFORMS=cpu; fi
            # shellcheck disable=SC2046  # the device options split into words on purpose
            exec asyncopd stage "$role" --exchange "$EXCHANGE" --index "$index" --cores "$cores" \
                --niceness "$NICENESS" --wait-for-exchange "$EXCHANGE_TIMEOUT" \
                $(stage_device_args "$DEVICE_KIND" "$device")
        ) >>"$LOG_DIR/$name.log" 2>&1 &
        child=$!
        rc=0
        wait "$child" || rc=$?
        child=""
        ((rc == 0)) && return 0
        stopped && return 0
        if ((tries >= STAGE_RESTARTS)); then
            log "$name exited with code $rc and has no restarts left; see $LOG_DIR/$name.log"
            return "$rc"
        fi
        tries=$((tries + 1))
        log "$name exited with code $rc; restart $tries of $STAGE_RESTARTS in 5 s"
        sleep 5
    done
}

if ((in_bucket == 0)); then  # a bucket: each stage process waits for the exchange itself
    log "waiting for the learner to set up $EXCHANGE"
    wait_for_exchange "$EXCHANGE" "$EXCHANGE_TIMEOUT"
fi
mkdir -p "$LOG_DIR"

pids=()
stop_all() {
    trap - TERM INT
    ((${#pids[@]})) && kill -TERM "${pids[@]}" 2>/dev/null
    wait 2>/dev/null
    exit 143
}
trap stop_all TERM INT

k=0
for role in rollout scoring; do
    if [[ $role == rollout ]]; then devices=("${rollout_devices[@]}"); else devices=("${scoring_devices[@]}"); fi
    j=0
    for device in "${devices[@]}"; do
        if [[ $DEVICE_KIND == cpu ]]; then cores=$device; else cores=$(cores_for "$k"); fi
        index=$((INDEX_BASE + j))
        log "starting $role-$index (device ${device:-any}, cores ${cores:-any})"
        stage_loop "$role" "$index" "$device" "$cores" &
        pids+=($!)
        j=$((j + 1))
        k=$((k + 1))
    done
done

status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
log "all stage processes have stopped"
exit "$status"
