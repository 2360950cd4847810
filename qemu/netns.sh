#!/usr/bin/env bash
# A test network for humans: `qemu/netns.sh up NAME [TAPS]` creates namespace
# NAME with bridge br0 (10.77.0.1/24, fd77::1/64), radvd sending router
# advertisements, and TAPS taps (tap0, tap1, ...; default 1) on the bridge.
# `qemu/netns.sh down NAME` stops radvd (by its PID file) and deletes the
# namespace with everything in it. The tests do the same through
# tests/testinfra (Netns).
set -euo pipefail
cmd=${1:?usage: netns.sh up|down NAME [TAPS]}
ns=${2:?usage: netns.sh up|down NAME [TAPS]}
state=/run/anneal-netns/$ns
case $cmd in
up)
  taps=${3:-1}
  mkdir -p "$state"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip -n "$ns" link add br0 type bridge forward_delay 0
  ip -n "$ns" addr add 10.77.0.1/24 dev br0
  ip -n "$ns" -6 addr add fd77::1/64 dev br0 nodad
  ip -n "$ns" link set br0 up
  for i in $(seq 0 $((taps - 1))); do
    ip -n "$ns" tuntap add dev "tap$i" mode tap
    ip -n "$ns" link set "tap$i" master br0 up
  done
  cat > "$state/radvd.conf" <<CONF
interface br0 { AdvSendAdvert on; MinRtrAdvInterval 3; MaxRtrAdvInterval 10;
  prefix fd77::/64 { AdvOnLink on; AdvAutonomous on; }; };
CONF
  ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.forwarding=1
  ip netns exec "$ns" radvd --config="$state/radvd.conf" --pidfile="$state/radvd.pid"
  echo "namespace $ns: br0 10.77.0.1/24 with $taps tap(s); run QEMU with: ip netns exec $ns qemu/boot-vm.sh ..."
  ;;
down)
  if [ -f "$state/radvd.pid" ]; then kill "$(cat "$state/radvd.pid")" 2>/dev/null || true; fi
  ip netns delete "$ns" 2>/dev/null || true
  rm -rf "$state"
  ;;
*) echo "usage: netns.sh up|down NAME [TAPS]" >&2; exit 2 ;;
esac
