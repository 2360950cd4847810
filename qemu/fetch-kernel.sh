#!/usr/bin/env bash
# Fetches the Debian guest kernel (linux-image-amd64's dependency) with
# `apt-get download`, unpacks it with `dpkg-deb -x` (never installs it) into
# $ANNEAL_CACHE/kernel/<version>/, and points $ANNEAL_CACHE/kernel/current at it.
#
# `fetch-kernel.sh arm64` does the same for linux-image-arm64:arm64 (the arm64
# boot matrix, issue 16) into $ANNEAL_CACHE/kernel-arm64/<version>/ and its
# `current` (same layout: vmlinuz, an uncompressed EFI-stub Image there;
# modules with depmod's index, which depmod builds for a foreign
# architecture's modules too; version). It enables arm64 as a dpkg foreign
# architecture first when it is not one yet (apt then lists arm64 packages;
# nothing arm64 is installed).
set -euo pipefail
arch=${1:-amd64}
case "$arch" in
  amd64) cache=${ANNEAL_CACHE:-/var/cache/anneal}/kernel meta=linux-image-amd64 ;;
  arm64) cache=${ANNEAL_CACHE:-/var/cache/anneal}/kernel-arm64 meta=linux-image-arm64:arm64 ;;
  *) echo "usage: $0 [amd64|arm64]" >&2; exit 2 ;;
esac
mkdir -p "$cache"
if [ -L "$cache/current" ] && [ -e "$cache/current/vmlinuz" ]; then
  exit 0
fi
# Test binaries run concurrently (tests/run.sh's lanes) and each fetches the
# kernel on first use: one fetch at a time, the others find it done.
exec 9>"$cache/.fetch.lock"
flock 9
if [ -L "$cache/current" ] && [ -e "$cache/current/vmlinuz" ]; then
  exit 0
fi
if [ "$arch" != amd64 ] && [ "$(dpkg --print-architecture)" != "$arch" ] &&
  ! dpkg --print-foreign-architectures | grep -qx "$arch"; then
  echo "[fetch-kernel] enabling $arch as a dpkg foreign architecture"
  dpkg --add-architecture "$arch"
  apt-get update -qq
fi
pkg=$(apt-cache depends "$meta" | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [ -z "$pkg" ]; then
  apt-get update -qq
  pkg=$(apt-cache depends "$meta" | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
# linux-image-6.1.0-57-arm64:arm64 -> 6.1.0-57-arm64
version=${pkg#linux-image-}
version=${version%:"$arch"}
work=$(mktemp -d)
chmod 755 "$work"
trap 'rm -rf "$work"' EXIT
echo "[fetch-kernel] downloading $pkg"
(cd "$work" && apt-get download -qq "$pkg")
dpkg-deb -x "$work"/*.deb "$work/root"
dest="$cache/$version"
rm -rf "$dest"
mkdir -p "$dest"
cp "$work/root/boot/vmlinuz-$version" "$dest/vmlinuz"
moddir="$work/root/lib/modules/$version"
[ -d "$moddir" ] || moddir="$work/root/usr/lib/modules/$version"
# The package ships no modules.dep/modules.alias (its postinst runs depmod).
depmod -b "$work/root" "$version" 2>/dev/null || depmod -b "$work/root/usr" "$version"
mv "$moddir" "$dest/modules"
echo "$version" > "$dest/version"
ln -sfn "$version" "$cache/current"
echo "[fetch-kernel] $version unpacked in $dest"
