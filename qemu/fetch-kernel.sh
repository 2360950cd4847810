#!/usr/bin/env bash
# Fetches the Debian guest kernel (linux-image-amd64's dependency) with
# `apt-get download`, unpacks it with `dpkg-deb -x` (never installs it) into
# $ANNEAL_CACHE/kernel/<version>/, and points $ANNEAL_CACHE/kernel/current at it.
set -euo pipefail
cache=${ANNEAL_CACHE:-/var/cache/anneal}/kernel
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
pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [ -z "$pkg" ]; then
  apt-get update -qq
  pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
version=${pkg#linux-image-}
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
