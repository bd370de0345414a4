#!/usr/bin/env bash
# Several nodes with torchrun: run this on every node, the same way.
#   HEAD=10.0.0.1 NODES=3 IFACE=eth0 launch/multinode.sh examples/unet_split/job.py [rpcmp options]
# HEAD is the address of the node that hosts the rendezvous (it passes is_host=true);
# every node gives its own address on IFACE as --local-addr, so no hostname that maps to
# 127.0.1.1 ever travels. Check a node first with: rpcmp doctor --iface $IFACE --nodes $NODES
set -euo pipefail
JOB=${1:?usage: HEAD=ip NODES=n IFACE=eth0 launch/multinode.sh JOB [options]}
shift
: "${HEAD:?set HEAD to the rendezvous node address}" "${NODES:?set NODES}" "${IFACE:?set IFACE}"
ADDR=$(ip -4 -o addr show dev "$IFACE" | awk '{split($4, a, "/"); print a[1]; exit}')
[[ -n "$ADDR" ]] || { echo "no IPv4 address on $IFACE" >&2; exit 2; }
IS_HOST=false; [[ "$ADDR" == "$HEAD" ]] && IS_HOST=true
exec torchrun --nnodes="$NODES" --nproc-per-node="${NPROC_PER_NODE:-1}" --rdzv-backend=c10d \
  --rdzv-endpoint="$HEAD:${RDZV_PORT:-29400}" --rdzv-conf "is_host=$IS_HOST" --local-addr "$ADDR" \
  -m rpcmp.master "$JOB" --iface "$IFACE" "$@"
