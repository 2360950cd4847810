# Secure Boot first stage: Debian's signed shim and signed network GRUB,
# fetched with `apt-get download` and unpacked with `dpkg-deb -x` (never
# installed: the host's boot is not touched) into $ANNEAL_CACHE/secureboot/
# as shimx64.efi and grubx64.efi (the name shim loads from its directory),
# and Debian's monolithic signed GRUB for disks as grubx64-disk.efi (the
# Secure Boot test OS, tests/src/testos.rs `test_os_secure_boot`).
# sbsigntool signs iPXE and the kernel with a site key (the snakeoil case).
# Sourced by tests/setup.sh as root; a re-run on a ready machine is instant.
sb_dir="${ANNEAL_CACHE:-/var/cache/anneal}/secureboot"
if ! command -v sbsign >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends sbsigntool >/dev/null
fi
if [ ! -s "$sb_dir/shimx64.efi" ] || [ ! -s "$sb_dir/grubx64.efi" ] ||
  [ ! -s "$sb_dir/grubx64-disk.efi" ]; then
  sb_work=$(mktemp -d)
  chmod 755 "$sb_work"
  (cd "$sb_work" && apt-get download -qq shim-signed grub-efi-amd64-signed)
  for deb in "$sb_work"/*.deb; do
    dpkg-deb -x "$deb" "$sb_work/root"
  done
  mkdir -p "$sb_dir"
  cp "$sb_work/root/usr/lib/shim/shimx64.efi.signed" "$sb_dir/shimx64.efi.tmp"
  cp "$sb_work/root/usr/lib/grub/x86_64-efi-signed/grubnetx64.efi.signed" "$sb_dir/grubx64.efi.tmp"
  cp "$sb_work/root/usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed" "$sb_dir/grubx64-disk.efi.tmp"
  mv "$sb_dir/shimx64.efi.tmp" "$sb_dir/shimx64.efi"
  mv "$sb_dir/grubx64.efi.tmp" "$sb_dir/grubx64.efi"
  mv "$sb_dir/grubx64-disk.efi.tmp" "$sb_dir/grubx64-disk.efi"
  rm -rf "$sb_work"
  log "secure boot: signed shim, network GRUB and disk GRUB in $sb_dir"
fi
