# Shared helpers of the launch scripts (sourced, not run).
#
# Every helper works on the arguments of `asyncopd train` (a config path, --set
# overrides, --resume) and on a run's exchange directory (runs/<name>/exchange: see
# asyncopd_jax/pipeline/exchange.py).

PYTHON=${PYTHON:-python}

die() {
    echo "$(basename "$0"): error: $*" >&2
    exit 2
}

log() {
    echo "[$(date '+%H:%M:%S') $(basename "$0")] $*" >&2
}

# $1 as a YAML string for a --set override: a bare 4 or 0-3,5 could parse as a number
# or fail to be the string the config field wants.
yaml_str() {
    local q="'"
    printf "'%s'" "${1//$q/$q$q}"
}

# The absolute run directory that `asyncopd train "$@"` will use (output_dir/name after
# the --set overrides; the --resume directory when resuming). Fails, naming the field,
# when the config does not load: nothing is started with a bad config.
resolve_run_dir() {
    "$PYTHON" - "$@" <<'EOF'
import argparse, sys
from pathlib import Path

parser = argparse.ArgumentParser(add_help=False)
parser.add_argument("--config")
parser.add_argument("--set", action="append", default=[])
parser.add_argument("--resume")
args, _ = parser.parse_known_args(sys.argv[1:])
if args.resume:
    print(args.resume.rstrip("/") if "://" in args.resume else Path(args.resume).resolve())
    sys.exit(0)
try:
    from asyncopd_jax.cli import DEMO_CONFIG
    from asyncopd_jax.config import ConfigError, load_config
except ImportError as err:
    sys.exit(f"cannot import asyncopd_jax ({err}): activate the environment it is installed in, or set PYTHON")
try:
    cfg = load_config(args.config or DEMO_CONFIG, args.set)
except (ConfigError, ValueError) as err:
    sys.exit(f"error: {err}")
print(f"{cfg.output_dir.rstrip('/')}/{cfg.name}" if "://" in cfg.output_dir else (Path(cfg.output_dir) / cfg.name).resolve())
EOF
}

# Block until the learner has set up the exchange directory (layout.json present, no
# STOP left from an earlier incarnation). $1: exchange directory, $2: timeout in seconds.
wait_for_exchange() {
    local exchange=$1 timeout=$2 waited=0
    until [[ -f $exchange/layout.json && ! -e $exchange/STOP ]]; do
        if ((waited >= timeout)); then
            die "no learner set up $exchange within $timeout s (is the learner running, and is the directory shared?)"
        fi
        sleep 2
        waited=$((waited + 2))
    done
    sleep 2  # the learner writes layout.json last; let it finish
}

# The `asyncopd stage` options that give one stage process its devices; the process sets
# the platform's variables itself before JAX starts (asyncopd_jax.pipeline.host_env.device_env:
# CUDA_VISIBLE_DEVICES; libtpu's TPU_VISIBLE_CHIPS family for 1, 2, 4 or 8 chips of a host).
#   $1: cuda | tpu | cpu     $2: the devices (a CUDA device id or list, TPU chips such as
#   "0-3" or "4,5", or nothing for cpu)
stage_device_args() {
    local kind=$1 device=$2
    case $kind in
        cuda) [[ -z $device ]] || echo "--platform gpu --devices $device" ;;
        tpu) echo "--platform tpu --devices $device" ;;
        cpu) ;;
        *) die "device kind '$kind' is invalid; allowed: cuda, tpu, cpu" ;;
    esac
}
