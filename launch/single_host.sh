#!/usr/bin/env bash
# One host, CPU or GPUs: the learner, rollout and teacher-scoring stages as separate
# processes, each on its own cores or devices.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: launch/single_host.sh [CONFIG.yaml] [asyncopd train arguments ...]

Runs `asyncopd train --config CONFIG.yaml --set stages.placement=processes` with
the core and device split below (no config: the built-in demo). The learner starts
the rollout and scoring processes itself, pins them, watches them and restarts them
(stages.restarts); policy snapshots go through RAM (/dev/shm) unless SNAPSHOT_DIR
says otherwise.

Each knob below is an environment variable. Unset (the default) keeps the config's
value; set, even to "", it is passed on as the --set override named beside it.

  LEARNER_CORES      stages.learner_cores    "auto", "" (unpinned) or a CPU list
  ROLLOUT_CORES      stages.rollout_cores    e.g. "2-5": dealt out to the processes
  SCORING_CORES      stages.scoring_cores
  ROLLOUT_PROCESSES  stages.rollouts   (the batch is split into this many groups)
  SCORING_PROCESSES  stages.scoring_processes   (0: rollout processes score their groups)
  ROLLOUT_DEVICES    stages.rollout_devices     CUDA_VISIBLE_DEVICES of every rollout process
  SCORING_DEVICES    stages.scoring_devices     CUDA_VISIBLE_DEVICES of every scoring process
  SNAPSHOT_DIR       stages.snapshot_dir        "auto": /dev/shm if writable, else <run>/snapshots
  RESTARTS           stages.restarts
  NICENESS           stages.rollout_niceness
and for the learner process (inherited by the stage processes unless they get their own):
  LEARNER_DEVICES    CUDA_VISIBLE_DEVICES of the learner (its mesh covers these)
  MEM_FRACTION       XLA_PYTHON_CLIENT_MEM_FRACTION (set it when processes share a GPU:
                     each takes 75 % of a GPU's memory by default)
  PLATFORM           JAX_PLATFORMS, e.g. "cpu" to keep every stage off an accelerator

Arguments after the config go to `asyncopd train` unchanged, after the script's own
--set options (so they win): --set a.b=c, --resume RUN_DIR, --no-progress.

Examples:
  # 8-core CPU box: learner on 0-2, two rollout processes on 3-5 and 6-7
  LEARNER_CORES=0-2 ROLLOUT_CORES=3-7 ROLLOUT_PROCESSES=2 launch/single_host.sh asyncopd_jax/configs/demo.yaml
  # one GPU shared by the learner and one rollout process that also scores
  MEM_FRACTION=0.45 ROLLOUT_DEVICES=0 launch/single_host.sh my.yaml --set name=one-gpu
  # two GPUs: learner on 0, rollout (+ scoring) on 1
  LEARNER_DEVICES=0 ROLLOUT_DEVICES=1 SCORING_PROCESSES=0 launch/single_host.sh my.yaml
EOF
}

[[ ${1:-} == -h || ${1:-} == --help ]] && { usage; exit 0; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$HERE/common.sh"

command -v asyncopd >/dev/null || die "asyncopd is not on PATH (activate the environment it is installed in)"
args=()
if [[ $# -gt 0 && $1 != -* ]]; then
    [[ -f $1 ]] || die "config file not found: $1"
    args=(--config "$1")
    shift
fi

sets=(--set stages.placement=processes)
add_set() {  # $1: environment variable, $2: config field, $3: str | int; only when the variable is set
    if [[ -n ${!1+x} ]]; then
        if [[ $3 == str ]]; then
            sets+=(--set "$2=$(yaml_str "${!1}")")
        else
            sets+=(--set "$2=${!1}")
        fi
    fi
}
add_set LEARNER_CORES stages.learner_cores str
add_set ROLLOUT_CORES stages.rollout_cores str
add_set SCORING_CORES stages.scoring_cores str
add_set ROLLOUT_PROCESSES stages.rollouts int
add_set SCORING_PROCESSES stages.scoring_processes int
add_set ROLLOUT_DEVICES stages.rollout_devices str
add_set SCORING_DEVICES stages.scoring_devices str
add_set SNAPSHOT_DIR stages.snapshot_dir str
add_set RESTARTS stages.restarts int
add_set NICENESS stages.rollout_niceness int

[[ -n ${LEARNER_DEVICES+x} ]] && export CUDA_VISIBLE_DEVICES=$LEARNER_DEVICES
[[ -n ${MEM_FRACTION+x} ]] && export XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION
[[ -n ${PLATFORM+x} ]] && export JAX_PLATFORMS=$PLATFORM

log "asyncopd train ${args[*]} ${sets[*]} $*"
exec asyncopd train "${args[@]}" "${sets[@]}" "$@"
