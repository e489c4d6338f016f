#!/usr/bin/env bash
# Rollout / teacher-scoring stage processes started by hand, one per device, on a host
# that mounts the run directory (the learner's host or another one).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: launch/stage_host.sh EXCHANGE_DIR

Starts `asyncopd stage rollout|scoring` processes that join a running
`asyncopd train` (stages.placement = processes) through its exchange directory
EXCHANGE_DIR = <output_dir>/<name>/exchange. Each process takes tickets (rollout)
or sampled groups (scoring) from the shared spools, like the stage processes the
learner starts itself. Waits until the learner has set the directory up, restarts a
process that dies (handing its claimed records back first) and returns when the
run stops (EXCHANGE_DIR/STOP) or on Ctrl-C / SIGTERM, which stops its processes.

The host must see the run directory, the snapshot directory and the model
directories at the same absolute paths as the learner (layout.json and config.yaml
in the exchange directory name them).

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
  PYTHON           the Python of the environment asyncopd is installed in  [python]

Logs: EXCHANGE_DIR/logs/<name>.log (next to those of the learner's own processes).

Example (4 more rollout processes on GPUs 0-3 of a second node):
  ROLLOUT_DEVICES="0 1 2 3" INDEX_BASE=100 launch/stage_host.sh /shared/runs/qwen3/exchange
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
    while [[ ! -e $EXCHANGE/STOP ]]; do
        give_back_claims "$EXCHANGE" "$name"
        (
            if [[ $DEVICE_KIND == cpu ]]; then export JAX_PLATFORMS=cpu; fi
            # shellcheck disable=SC2046  # the device options split into words on purpose
            exec asyncopd stage "$role" --exchange "$EXCHANGE" --index "$index" --cores "$cores" \
                --niceness "$NICENESS" $(stage_device_args "$DEVICE_KIND" "$device")
        ) >>"$EXCHANGE/logs/$name.log" 2>&1 &
        child=$!
        rc=0
        wait "$child" || rc=$?
        child=""
        ((rc == 0)) && return 0
        [[ -e $EXCHANGE/STOP ]] && return 0
        if ((tries >= STAGE_RESTARTS)); then
            log "$name exited with code $rc and has no restarts left; see $EXCHANGE/logs/$name.log"
            return "$rc"
        fi
        tries=$((tries + 1))
        log "$name exited with code $rc; restart $tries of $STAGE_RESTARTS in 5 s"
        sleep 5
    done
}

log "waiting for the learner to set up $EXCHANGE"
wait_for_exchange "$EXCHANGE" "$EXCHANGE_TIMEOUT"
mkdir -p "$EXCHANGE/logs"

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
