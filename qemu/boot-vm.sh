#!/usr/bin/env bash
# Boots a VM under TCG the way the tests do, serial console on this terminal.
#   qemu/boot-vm.sh [--bios] [--no-rom] [--tap tap0] [--mac 52:54:00:12:34:56]
#                   [--disk FILE] [--nvme FILE] [-- extra qemu args]
# UEFI (OVMF, with a private copy of the VARS file) unless --bios. Run it
# inside a namespace from qemu/netns.sh: ip netns exec NAME qemu/boot-vm.sh
set -euo pipefail
fw=uefi rom=1 tap=tap0 mac=52:54:00:12:34:56 disks=() extra=()
while [ $# -gt 0 ]; do
  case $1 in
  --bios) fw=bios ;;
  --no-rom) rom=0 ;;
  --tap) tap=$2; shift ;;
  --mac) mac=$2; shift ;;
  --disk) disks+=(-drive "file=$2,if=none,id=d${#disks[@]},format=raw" -device "virtio-blk-pci,drive=d${#disks[@]},serial=DISK${#disks[@]}"); shift ;;
  --nvme) disks+=(-drive "file=$2,if=none,id=d${#disks[@]},format=raw" -device "nvme,drive=d${#disks[@]},serial=NVME${#disks[@]}"); shift ;;
  --) shift; extra=("$@"); break ;;
  *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fwargs=()
if [ $fw = uefi ]; then
  cp /usr/share/OVMF/OVMF_VARS_4M.fd "$work/vars.fd"
  fwargs=(-drive if=pflash,format=raw,unit=0,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd
          -drive "if=pflash,format=raw,unit=1,file=$work/vars.fd")
fi
nic="virtio-net-pci,netdev=n0,mac=$mac,bootindex=1"
[ $rom = 0 ] && nic="$nic,romfile="
exec qemu-system-x86_64 -machine q35,accel=tcg -cpu max -smp 2 -m 1024 -nographic \
  "${fwargs[@]}" -netdev "tap,id=n0,ifname=$tap,script=no,downscript=no" -device "$nic" \
  "${disks[@]}" "${extra[@]}"
