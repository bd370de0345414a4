#!/usr/bin/env bash
# A simulated multi-node cluster on one machine: one Linux network namespace per node,
# joined by a bridge in a switch namespace, one address per node. Runs a job on it with
# torchrun (c10d rendezvous) on every "node", then tears everything down, even on failure.
#
#   sudo launch/netns-cluster.sh [--nodes 3] [--nproc-per-node 1] [--timeout 600] [--logs DIR] -- JOB [rpcmp.master options]
#
# All nodes share one hostname, as many real clusters effectively do (hostname -> 127.0.1.1):
# the rendezvous host gets --rdzv-conf is_host=true and every node --local-addr ITS_IP, and
# rpcmp gets --iface eth0, so that every address that travels is one the others can reach.
set -euo pipefail

NODES=3
NPROC=1
LIMIT=600
LOGS=""
PY=${PYTHON:-python3}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) NODES=$2; shift 2 ;;
    --nproc-per-node) NPROC=$2; shift 2 ;;
    --timeout) LIMIT=$2; shift 2 ;;
    --logs) LOGS=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--nodes N] [--nproc-per-node K] [--timeout S] [--logs DIR] -- JOB [options]" >&2; exit 2 ;;
  esac
done
[[ $# -ge 1 ]] || { echo "usage: $0 [--nodes N] [--nproc-per-node K] [--timeout S] [--logs DIR] -- JOB [options]" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "netns-cluster: needs root (ip netns)" >&2; exit 2; }

ID=$$
SUBNET=10.231.$((ID % 200 + 20))
SW=rpcmp-sw-$ID
LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$LOGS"
namespaces=()

kill_in() {  # every process in namespace $1
  local pids
  pids=$(ip netns pids "$1" 2>/dev/null || true)
  [[ -n "$pids" ]] && kill -9 $pids 2>/dev/null || true
}
listed() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }

remove() {  # namespace $1 and what runs in it; says so when it cannot
  local try
  kill_in "$1"
  for try in 1 2 3 4 5 6 7 8 9 10; do
    ip netns del "$1" 2>/dev/null || true
    listed "$1" || return 0
    sleep 0.2
    kill_in "$1"
  done
  echo "netns-cluster: could not remove namespace $1: $(ip netns del "$1" 2>&1)" >&2
  return 1
}

cleanup() {
  local rc=$? ns
  trap - EXIT INT TERM
  for ns in "${namespaces[@]}"; do kill_in "$ns"; done
  for ns in "${namespaces[@]}"; do remove "$ns" || rc=1; done
  exit $rc
}

# A cluster whose script was SIGKILLed could not tear itself down: remove what it left (its pid is gone).
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^rpcmp-(n[0-9]+|sw)-[0-9]+$' || true); do
  kill -0 "${ns##*-}" 2>/dev/null && continue
  remove "$ns" && echo "netns-cluster: removed $ns, left by a cluster whose script was killed" >&2
done
trap cleanup EXIT INT TERM

ip netns add "$SW"; namespaces+=("$SW")
ip -n "$SW" link add br0 type bridge
ip -n "$SW" link set br0 up
for ((i = 0; i < NODES; i++)); do
  ns=rpcmp-n$i-$ID
  ip netns add "$ns"; namespaces+=("$ns")
  ip link add "vh$i-$ID" netns "$SW" type veth peer name eth0 netns "$ns"
  ip -n "$SW" link set "vh$i-$ID" master br0 up
  ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
done
echo "netns-cluster: $NODES nodes on $SUBNET.0/24 (rendezvous $SUBNET.1:29400), logs in $LOGS"

pids=()
for ((i = 0; i < NODES; i++)); do
  host=false; [[ $i -eq 0 ]] && host=true
  addr_opt=(--local-addr "$SUBNET.$((i + 1))")
  # RPCMP_NETNS_OMIT_LOCAL_ADDR=1 reproduces the classic fault, for the tests: see rpcmp/launch/network.py
  [[ -n "${RPCMP_NETNS_OMIT_LOCAL_ADDR:-}" ]] && addr_opt=()
  # RPCMP_NETNS_TORCHRUN_ARGS: more torchrun options for every node (e.g. --max-restarts=1)
  read -r -a extra <<<"${RPCMP_NETNS_TORCHRUN_ARGS:-}"
  ip netns exec "rpcmp-n$i-$ID" timeout --kill-after=10 "$LIMIT" \
    "$PY" -m torch.distributed.run --nnodes="$NODES" --nproc-per-node="$NPROC" \
      --rdzv-backend=c10d --rdzv-endpoint="$SUBNET.1:29400" --rdzv-conf "is_host=$host" \
      "${addr_opt[@]}" "${extra[@]}" \
      -m rpcmp.master "$@" --iface eth0 >"$LOGS/node$i.log" 2>&1 &
  pids+=($!)
done

failed=0
for ((i = 0; i < NODES; i++)); do
  if wait "${pids[$i]}"; then echo "node$i: exit 0"; else rc=$?; echo "node$i: exit $rc"; failed=1; fi
done
echo "---- node0 (rank 0) log ----"
grep -v '^\[W' "$LOGS/node0.log" | tail -n 25 || true
if [[ $failed -ne 0 ]]; then
  for ((i = 1; i < NODES; i++)); do echo "---- node$i log ----"; tail -n 15 "$LOGS/node$i.log"; done
fi
exit $failed
