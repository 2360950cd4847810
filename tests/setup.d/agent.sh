# Agent and initramfs: filesystem tools for the superblock-prober cross-check
# (blkid -p against real mkfs output) and the fixture regeneration script.
# Sourced by tests/setup.sh as root; a re-run on a ready machine is instant.
agent_pkgs=""
for p in xfsprogs btrfs-progs ntfs-3g dosfstools e2fsprogs busybox-static musl-tools; do
  dpkg -s "$p" >/dev/null 2>&1 || agent_pkgs="$agent_pkgs $p"
done
if [ -n "$agent_pkgs" ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $agent_pkgs >/dev/null
fi
unset agent_pkgs p
