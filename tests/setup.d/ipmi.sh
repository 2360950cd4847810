# IPMI (issue 16): Debian's openipmi for `ipmi_sim`, the BMC simulator the
# IPMI driver's conformance test and lifecycle walk run against, and
# ipmitool, the reference client (golden vectors, bootparam cross-checks).
# python3 runs qemu/ipmi-sim/qmp-hook.py (the chassis control of a VM).
# Sourced by tests/setup.sh as root; a re-run on a ready machine is instant.
ipmi_pkgs=""
for p in openipmi ipmitool python3; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || ipmi_pkgs="$ipmi_pkgs $p"
done
if [ -n "$ipmi_pkgs" ]; then
  log "installing Debian packages:$ipmi_pkgs"
  # openipmi ships an init script for the host's IPMI driver: never start it
  # (the tests run their own ipmi_sim on loopback).
  ipmi_policy=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    ipmi_policy=1
  fi
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $ipmi_pkgs >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $ipmi_pkgs >/dev/null
  fi
  [ -n "$ipmi_policy" ] && rm -f /usr/sbin/policy-rc.d
fi
unset ipmi_pkgs ipmi_policy p
