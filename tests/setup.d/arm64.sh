# The arm64 boot matrix (issue 16): the cross toolchain of the aarch64 agent,
# QEMU's arm64 system emulator with its UEFI firmware (AAVMF), and the arm64
# pieces of the boot, fetched with `apt-get download` and unpacked with
# `dpkg-deb -x` (never installed) into $ANNEAL_CACHE:
#   kernel-arm64/current/  Debian's arm64 kernel (qemu/fetch-kernel.sh arm64)
#   arm64/busybox          busybox-static:arm64
#   arm64/shimaa64.efi     shim-signed:arm64
#   arm64/grubaa64.efi     grub-efi-arm64-signed:arm64's network GRUB, under
#                          the name shim loads from its directory
#   arm64/linuxaa64.efi.stub  systemd-boot-efi:arm64's UKI stub (the arm64
#                          test OS's loader)
#   arm64/sysroot/         e2fsprogs:arm64 and its libraries (e2fsck and
#                          resize2fs for growLastPartition), packed into the
#                          arm64 initramfs with `anneal-initramfs --sysroot`
# Sourced by tests/setup.sh as root; a re-run on a ready machine is instant.
arm64_pkgs=""
for p in gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-system-arm qemu-efi-aarch64; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || arm64_pkgs="$arm64_pkgs $p"
done
if [ -n "$arm64_pkgs" ]; then
  log "arm64: installing$arm64_pkgs"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $arm64_pkgs >/dev/null
fi
# rust-toolchain.toml lists the target; an existing toolchain does not get
# targets added to the file later.
(cd "$repo" && rustup target list --installed | grep -qx aarch64-unknown-linux-musl ||
  rustup target add aarch64-unknown-linux-musl)
# apt lists arm64 packages once arm64 is a foreign architecture (nothing
# arm64 is installed on the host).
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  log "arm64: enabling arm64 as a dpkg foreign architecture"
  dpkg --add-architecture arm64
  apt-get update -qq
fi
"$repo/qemu/fetch-kernel.sh" arm64

arm64_dir="$ANNEAL_CACHE/arm64"
if [ ! -s "$arm64_dir/busybox" ] || [ ! -s "$arm64_dir/shimaa64.efi" ] ||
  [ ! -s "$arm64_dir/grubaa64.efi" ] || [ ! -s "$arm64_dir/linuxaa64.efi.stub" ] ||
  [ ! -e "$arm64_dir/sysroot/.complete" ]; then
  arm64_work=$(mktemp -d)
  chmod 755 "$arm64_work"
  (cd "$arm64_work" && apt-get download -qq busybox-static:arm64 shim-signed:arm64 \
    grub-efi-arm64-signed:arm64 systemd-boot-efi:arm64)
  mkdir -p "$arm64_work/sysroot-debs"
  # e2fsck's and resize2fs's DT_NEEDED closure (anneal-initramfs names
  # anything missing); libe2p is in libext2fs2 in bookworm.
  (cd "$arm64_work/sysroot-debs" && apt-get download -qq e2fsprogs:arm64 libext2fs2:arm64 \
    libcom-err2:arm64 libblkid1:arm64 libuuid1:arm64 libc6:arm64)
  for deb in "$arm64_work"/*.deb; do
    dpkg-deb -x "$deb" "$arm64_work/root"
  done
  for deb in "$arm64_work"/sysroot-debs/*.deb; do
    dpkg-deb -x "$deb" "$arm64_work/sysroot"
  done
  touch "$arm64_work/sysroot/.complete"
  mkdir -p "$arm64_dir"
  cp "$arm64_work/root/bin/busybox" "$arm64_dir/busybox.tmp"
  cp "$arm64_work/root/usr/lib/shim/shimaa64.efi.signed" "$arm64_dir/shimaa64.efi.tmp"
  cp "$arm64_work/root/usr/lib/grub/arm64-efi-signed/grubnetaa64.efi.signed" "$arm64_dir/grubaa64.efi.tmp"
  cp "$arm64_work/root/usr/lib/systemd/boot/efi/linuxaa64.efi.stub" "$arm64_dir/linuxaa64.efi.stub.tmp"
  mv "$arm64_dir/linuxaa64.efi.stub.tmp" "$arm64_dir/linuxaa64.efi.stub"
  mv "$arm64_dir/busybox.tmp" "$arm64_dir/busybox"
  mv "$arm64_dir/shimaa64.efi.tmp" "$arm64_dir/shimaa64.efi"
  mv "$arm64_dir/grubaa64.efi.tmp" "$arm64_dir/grubaa64.efi"
  rm -rf "$arm64_dir/sysroot"
  mv "$arm64_work/sysroot" "$arm64_dir/sysroot"
  rm -rf "$arm64_work"
  log "arm64: busybox, signed shim and network GRUB, UKI stub, e2fsprogs sysroot in $arm64_dir"
fi
unset arm64_pkgs arm64_dir arm64_work p deb
