#!/usr/bin/env bash
# One multi-GPU node: the learner on some GPUs, rollout and teacher scoring on others,
# one stage process per GPU. Also the per-node step of launch/slurm_gpu.sbatch.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: launch/gpu_node.sh [CONFIG.yaml] [asyncopd train arguments ...]

Runs `asyncopd train --config CONFIG.yaml` with stages.placement = processes and
splits this node's GPUs three ways (the defaults are for 8 GPUs):

  learner   CUDA_VISIBLE_DEVICES=$LEARNER_GPUS for the learner process; its mesh
            (learner.mesh) covers exactly these GPUs
  rollout   one process per GPU in $ROLLOUT_GPUS (samples with the newest policy
            snapshot; scores its own groups when $SCORING_GPUS is empty)
  scoring   one teacher-scoring process per GPU in $SCORING_GPUS

The learner starts the first rollout and the first scoring process itself
(stages.rollouts = 1 on the first rollout GPU, stages.scoring_processes = 1
on the first scoring GPU: it watches and restarts those); this script starts the
others with launch/stage_host.sh once the learner is up, and stops them when the
learner exits. Every rollout group is learner.batch_size sequences (the batch divided
by stages.rollouts = 1): size the KV cache for that (docs/scaling.md).

On node NODE_RANK > 0 of a multi-node run (launch/slurm_gpu.sbatch) the learner
process is a follower of the one on node 0 and starts no stage processes; this
script then starts one per GPU of ROLLOUT_GPUS and SCORING_GPUS on this node.

Environment (default in brackets):
  LEARNER_GPUS     CUDA_VISIBLE_DEVICES of the learner                    [0,1,2,3]
  ROLLOUT_GPUS     space-separated, one rollout process per entry         [4 5]
  SCORING_GPUS     space-separated, one scoring process per entry; ""
                   = rollout processes score their own groups              [6 7]
  MEM_FRACTION     XLA_PYTHON_CLIENT_MEM_FRACTION for every process (each
                   GPU belongs to one process, so most of it may be taken)  [0.90]
  NODE_RANK        this node's number in a multi-node run     [$SLURM_NODEID or 0]
  STAGE_RESTARTS   restarts of a stage process (the learner's own processes:
                   stages.restarts in the config)                          [3]
  EXCHANGE_TIMEOUT seconds the extra stage processes wait for the learner  [3600]
  PYTHON           the Python asyncopd is installed in                     [python]

Arguments after the config go to `asyncopd train` unchanged and come after the
script's own --set options, so they win (do not override stages.rollouts,
stages.scoring_processes or their devices: the script derives them).

Example (8 GPUs: learner 0-3, rollout 4-5, scoring 6-7):
  launch/gpu_node.sh asyncopd_jax/configs/qwen3_1.7b_from_8b_gpu.yaml --set name=qwen3-1.7b-a
EOF
}

[[ ${1:-} == -h || ${1:-} == --help ]] && { usage; exit 0; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$HERE/common.sh"

LEARNER_GPUS=${LEARNER_GPUS-0,1,2,3}
ROLLOUT_GPUS=${ROLLOUT_GPUS-4 5}
SCORING_GPUS=${SCORING_GPUS-6 7}
MEM_FRACTION=${MEM_FRACTION:-0.90}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
STAGE_RESTARTS=${STAGE_RESTARTS:-3}
EXCHANGE_TIMEOUT=${EXCHANGE_TIMEOUT:-3600}
export STAGE_RESTARTS EXCHANGE_TIMEOUT

command -v asyncopd >/dev/null || die "asyncopd is not on PATH (activate the environment it is installed in)"
args=()
if [[ $# -gt 0 && $1 != -* ]]; then
    [[ -f $1 ]] || die "config file not found: $1"
    args=(--config "$1")
    shift
fi
args+=("$@")

read -r -a rollout <<<"$ROLLOUT_GPUS"
read -r -a scoring <<<"$SCORING_GPUS"
((${#rollout[@]} > 0)) || die "ROLLOUT_GPUS is empty: at least one rollout GPU is needed"
[[ -n $LEARNER_GPUS ]] || die "LEARNER_GPUS is empty"

stage_set=(--set stages.placement=processes
    --set stages.rollouts=1 --set "stages.rollout_devices=$(yaml_str "${rollout[0]}")")
if ((${#scoring[@]})); then
    stage_set+=(--set stages.scoring_processes=1 --set "stages.scoring_devices=$(yaml_str "${scoring[0]}")")
else
    stage_set+=(--set stages.scoring_processes=0)
fi

run_dir=$(resolve_run_dir "${stage_set[@]}" "${args[@]}") || exit 2
exchange=$run_dir/exchange
export XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION

# The stage processes this script starts: on node 0 all but the first of each role
# (the learner starts those), on other nodes all of them.
if ((NODE_RANK == 0)); then
    extra_rollout=("${rollout[@]:1}")
    extra_scoring=("${scoring[@]:1}")
    index_base=1
else
    extra_rollout=("${rollout[@]}")
    extra_scoring=("${scoring[@]}")
    index_base=$((NODE_RANK * 100))
fi

stage_pid=""
cleanup() {
    if [[ -n $stage_pid ]] && kill -0 "$stage_pid" 2>/dev/null; then
        kill -TERM "$stage_pid" 2>/dev/null || true
        wait "$stage_pid" 2>/dev/null || true
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ((${#extra_rollout[@]} + ${#extra_scoring[@]})); then
    log "node $NODE_RANK: extra stage processes on GPUs ${extra_rollout[*]} ${extra_scoring[*]} (after the learner is up)"
    DEVICE_KIND=cuda ROLLOUT_DEVICES="${extra_rollout[*]}" SCORING_DEVICES="${extra_scoring[*]}" \
        INDEX_BASE=$index_base bash "$HERE/stage_host.sh" "$exchange" &
    stage_pid=$!
fi

log "node $NODE_RANK: learner on GPUs $LEARNER_GPUS, run directory $run_dir"
rc=0
CUDA_VISIBLE_DEVICES=$LEARNER_GPUS asyncopd train "${stage_set[@]}" "${args[@]}" || rc=$?
exit "$rc"
