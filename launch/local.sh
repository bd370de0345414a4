#!/usr/bin/env bash
# One machine, N processes (master + workers), bound to loopback only.
#   launch/local.sh examples/unet_split/job.py 3 [rpcmp options]
set -euo pipefail
JOB=${1:?usage: launch/local.sh JOB [NPROCS] [options]}
NPROCS=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
exec rpcmp run "$JOB" --local "$NPROCS" "$@"
