#!/bin/bash
# The kernel operations of the agent's SoftRoCE apply pass (bench/agent_guest_bench.py),
# done by a plain shell script: the baseline the agent's apply pass is measured against.
# usage: agent_apply_script.sh apply|undo NETDEV DSCP PRIORITY [NETWORK]
set -e
action=${1:-apply} dev=${2:-eth0} dscp=${3:-26} prio=${4:-3}
rxe=rxe_$dev
cm=/sys/kernel/config/rdma_cm/$rxe
if [[ $action == undo ]]; then
  rdma link delete "$rxe" 2>/dev/null || true
  tc qdisc del dev "$dev" clsact 2>/dev/null || true
  rmdir "$cm" 2>/dev/null || true
  rm -rf "/run/metaroce/agent/${5:-rdma-e2e}"
  exit 0
fi
tos=$((dscp << 2))
modprobe rdma_rxe
modprobe ib_uverbs
modprobe rdma_ucm
rdma link add "$rxe" type rxe netdev "$dev"
tc qdisc add dev "$dev" clsact
tc filter replace dev "$dev" egress protocol ip pref 4791 handle 0x4d52 flower \
  ip_proto udp dst_port 4791 \
  action pedit ex munge ip dsfield set "$(printf '0x%02x' $tos)" retain 0xfc pipe \
  action csum ip pipe action skbedit priority "$prio"
modprobe rdma_cm
mkdir -p "$cm"
echo "RoCE v2" >"$cm/ports/1/default_roce_mode"
echo "$tos" >"$cm/ports/1/default_roce_tos"
