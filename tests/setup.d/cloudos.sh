# The Day-1 cloud OS (issue 45): a plain Debian 12 (bookworm, amd64) cloud
# image built with debootstrap from Debian's packages, with cloud-init and
# openssh-server and nothing anneal-specific, as a raw GPT disk:
#   p1  ESP, FAT32, 64 MiB, holding a UKI at \EFI\debian\linuxx64.efi
#       (systemd-boot-efi's stub + the image's own kernel and initramfs);
#       no \EFI\BOOT\BOOTX64.EFI (the deploy's install-removable-fallback
#       copies the vendor loader there)
#   p2  ext4 root with a fixed filesystem UUID, sized to its content + slack
#   the rest of the 2 GiB disk is unallocated (room for a NoCloud CIDATA
#   partition at the end, or for growpart)
# Networking as in Debian 12's own genericcloud image: netplan.io rendering
# for systemd-networkd (cloud-init 22.4 picks its netplan renderer; no
# ifupdown, so its eni renderer is unavailable), systemd-resolved.
# The root password is locked (no password at all: `*`), the SSH host keys
# and the machine-id are removed (cloud-init and systemd make them on the
# first boot), cloud-init's configuration is Debian's default (its datasource
# list has NoCloud).
# Output: $ANNEAL_CACHE/cloudos/<hash of this file>/disk.raw and info.json
# (tests/src/cloudos.rs reads them). Built without loop devices: the root is
# made with `mkfs.ext4 -d`, the ESP with mkfs.vfat + mtools, the table with
# sgdisk, the partitions placed with dd. Only /proc, /sys, /dev and /dev/pts
# are bind-mounted into the chroot while apt runs; a trap unmounts them.
# Sourced by tests/setup.sh as root; a re-run on a ready machine is instant.
cloudos_hash=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
cloudos_dir="${ANNEAL_CACHE:-/var/cache/anneal}/cloudos/$cloudos_hash"
if [ ! -s "$cloudos_dir/disk.raw" ] || [ ! -s "$cloudos_dir/info.json" ]; then
  for p in debootstrap gdisk dosfstools mtools e2fsprogs binutils systemd-boot-efi; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$p" >/dev/null
  done
  (
    set -euo pipefail
    say() { printf '[setup %s] cloudos: %s\n' "$(date +%H:%M:%S)" "$*"; }
    started=$(date +%s)
    mirror=http://deb.debian.org/debian
    # Fixed identities: the same recipe gives the same UUIDs.
    root_uuid=6a1f3c2e-45d0-4b7a-9c1e-0d2b45e1c0a5
    esp_volid=45CA0001
    disk_guid=45C10D00-0000-4000-8000-000000000045
    esp_guid=45C10D00-0001-4000-8000-000000000045
    root_guid=45C10D00-0002-4000-8000-000000000045
    disk_mib=2048
    esp_mib=64
    kernel_pkg=linux-image-cloud-amd64
    pkgs=(
      systemd-sysv udev dbus libpam-systemd "$kernel_pkg" initramfs-tools zstd
      cloud-init openssh-server sudo
      netplan.io systemd-resolved iproute2
      e2fsprogs cloud-guest-utils
    )
    stub=/usr/lib/systemd/boot/efi/linuxx64.efi.stub
    parent="${ANNEAL_CACHE:-/var/cache/anneal}/cloudos"
    mkdir -p "$parent"
    work=$(mktemp -d "$parent/.build.XXXXXX")
    root="$work/root"
    mounts=()
    cleanup() {
      local i
      for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        umount -l "${mounts[$i]}" 2>/dev/null || true
      done
      mounts=()
      # Never remove a tree something is still mounted under.
      if grep -q " $work" /proc/mounts; then
        echo "cloudos: mounts left under $work, not removing it" >&2
      else
        rm -rf "$work"
      fi
    }
    trap cleanup EXIT
    say "debootstrap bookworm (minbase) into $root"
    debootstrap --variant=minbase --arch=amd64 bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 ||
      { tail -30 "$work/debootstrap.log" >&2; exit 1; }
    for m in proc sys dev dev/pts; do
      mount --bind "/$m" "$root/$m"
      mounts+=("$root/$m")
    done
    # No daemon of the image starts inside the chroot.
    printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
    chmod +x "$root/usr/sbin/policy-rc.d"
    printf 'deb %s bookworm main\n' "$mirror" >"$root/etc/apt/sources.list"
    # The initramfs must find a virtio (or any) disk: every storage driver.
    mkdir -p "$root/etc/initramfs-tools/conf.d"
    printf 'MODULES=most\nRESUME=none\nCOMPRESS=zstd\n' >"$root/etc/initramfs-tools/conf.d/cloudos.conf"
    say "apt-get install --no-install-recommends ${pkgs[*]}"
    chroot "$root" /usr/bin/env DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 \
      sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends ${pkgs[*]}" \
      >"$work/apt.log" 2>&1 || { tail -40 "$work/apt.log" >&2; exit 1; }
    if chroot "$root" dpkg-query -W -f='${Status}' ifupdown 2>/dev/null | grep -q "install ok installed"; then
      echo "cloudos: ifupdown got installed; cloud-init would render eni instead of netplan:" >&2
      chroot "$root" apt-cache rdepends --installed ifupdown >&2 || true
      exit 1
    fi
    kver=$(cd "$root/boot" && ls vmlinuz-* | sed 's/^vmlinuz-//' | sort -V | tail -1)
    [ -s "$root/boot/vmlinuz-$kver" ] && [ -s "$root/boot/initrd.img-$kver" ] ||
      { echo "cloudos: no kernel/initramfs in $root/boot" >&2; exit 1; }
    # Configuration: what Debian's genericcloud image sets, nothing more.
    echo localhost >"$root/etc/hostname"
    printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\nff02::1\t\tip6-allnodes\nff02::2\t\tip6-allrouters\n' \
      >"$root/etc/hosts"
    printf 'UUID=%s / ext4 rw,discard,errors=remount-ro,x-systemd.growfs 0 1\nUUID=%s-%s /boot/efi vfat umask=0077,nofail 0 2\n' \
      "$root_uuid" "${esp_volid:0:4}" "${esp_volid:4:4}" >"$root/etc/fstab"
    mkdir -p "$root/boot/efi"
    # cloud-init's locale module sets its default, en_US.UTF-8 (cloud-init
    # depends on locales): generated here, as the system's locale.
    sed -i 's/^# *\(en_US.UTF-8 UTF-8\)/\1/' "$root/etc/locale.gen"
    chroot "$root" locale-gen >/dev/null
    echo 'LANG=en_US.UTF-8' >"$root/etc/default/locale"
    chroot "$root" systemctl enable systemd-networkd.service systemd-resolved.service >/dev/null 2>&1
    ln -sf /run/systemd/resolve/resolv.conf "$root/etc/resolv.conf"
    # Locked root: no password hash at all.
    chroot "$root" usermod -p '*' root
    # Per-instance identities are made on the first boot.
    rm -f "$root"/etc/ssh/ssh_host_*
    : >"$root/etc/machine-id"
    rm -f "$root/var/lib/dbus/machine-id"
    rm -f "$root/usr/sbin/policy-rc.d"
    chroot "$root" apt-get clean
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/debconf/*-old "$root"/tmp/* "$root"/var/tmp/*
    find "$root/var/log" -type f -exec truncate -s 0 {} +
    # Versions for info.json, read before the chroot is left.
    ver() { chroot "$root" dpkg-query -W -f='${Version}' "$1"; }
    v_ci=$(ver cloud-init)
    v_ssh=$(ver openssh-server)
    v_kpkg=$(ver "$kernel_pkg")
    v_netplan=$(ver netplan.io)
    v_systemd=$(ver systemd)
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[$i]}"; done
    mounts=()
    if grep -q " $root" /proc/mounts; then
      echo "cloudos: something is still mounted under $root" >&2
      exit 1
    fi

    say "UKI from the image's kernel $kver"
    cmdline="root=UUID=$root_uuid ro console=tty0 console=ttyS0,115200"
    printf '%s' "$cmdline" >"$work/cmdline"
    cp "$root/etc/os-release" "$work/os-release"
    end=0
    while read -r _ _ size vma _; do
      e=$((0x$vma + 0x$size))
      [ "$e" -gt "$end" ] && end=$e
    done < <(objdump -h "$stub" | awk 'NF == 7 && $1 ~ /^[0-9]+$/')
    align=$((0x$(objdump -p "$stub" | awk '$1 == "SectionAlignment" { print $2 }')))
    up() { echo $((($1 + align - 1) / align * align)); }
    vma=$(up "$end")
    args=()
    for s in .osrel:"$work/os-release" .cmdline:"$work/cmdline" \
      .linux:"$root/boot/vmlinuz-$kver" .initrd:"$root/boot/initrd.img-$kver"; do
      name=${s%%:*} file=${s#*:}
      args+=(--add-section "$name=$file" --change-section-vma "$name=$(printf '0x%x' "$vma")")
      vma=$(up $((vma + $(stat -c %s "$file"))))
    done
    objcopy "${args[@]}" "$stub" "$work/linuxx64.efi"

    say "ESP (FAT32, ${esp_mib} MiB)"
    mkfs.vfat -F 32 -n ESP -i "$esp_volid" -C "$work/esp.img" $((esp_mib * 1024)) >/dev/null
    export MTOOLS_SKIP_CHECK=1
    mmd -i "$work/esp.img" ::/EFI ::/EFI/debian
    mcopy -i "$work/esp.img" "$work/linuxx64.efi" ::/EFI/debian/linuxx64.efi

    used_mib=$(du -sm --apparent-size "$root" | cut -f1)
    # Content + 25 % + 256 MiB: room for the first boot's writes; growpart
    # and resize2fs enlarge it on a bigger disk.
    root_mib=$((used_mib * 5 / 4 + 256))
    say "root ext4: ${used_mib} MiB of content in a ${root_mib} MiB filesystem"
    mkfs.ext4 -q -F -L cloudroot -U "$root_uuid" -E lazy_itable_init=1,lazy_journal_init=1 \
      -d "$root" "$work/root.img" "${root_mib}M"
    rm -rf "$root"

    say "GPT disk (${disk_mib} MiB, sparse)"
    disk="$work/disk.raw"
    truncate -s "${disk_mib}M" "$disk"
    esp_start=2048
    root_start=$((esp_start + esp_mib * 2048))
    sgdisk -U "$disk_guid" \
      -n "1:$esp_start:+${esp_mib}M" -t 1:ef00 -c 1:ESP -u "1:$esp_guid" \
      -n "2:$root_start:+${root_mib}M" -t 2:8300 -c 2:root -u "2:$root_guid" "$disk" >/dev/null
    dd if="$work/esp.img" of="$disk" bs=1M seek="$((esp_start / 2048))" conv=notrunc,sparse status=none
    dd if="$work/root.img" of="$disk" bs=1M seek="$((root_start / 2048))" conv=notrunc,sparse status=none
    sgdisk -v "$disk" >/dev/null
    sgdisk -i 2 "$disk" | grep -qi "unique GUID: $root_guid" ||
      { echo "cloudos: no partition table written on $disk" >&2; exit 1; }
    alloc_kib=$(du -sk "$disk" | cut -f1)
    built=$(($(date +%s) - started))
    cat >"$work/info.json" <<EOF
{
  "recipe": "$cloudos_hash",
  "disk": "disk.raw",
  "disk_bytes": $((disk_mib * 1024 * 1024)),
  "allocated_bytes": $((alloc_kib * 1024)),
  "root_content_mib": $used_mib,
  "esp": { "partition": 1, "start_sector": $esp_start, "bytes": $((esp_mib * 1024 * 1024)), "fs": "vfat", "volume_id": "${esp_volid:0:4}-${esp_volid:4:4}", "partuuid": "$esp_guid" },
  "root": { "partition": 2, "start_sector": $root_start, "bytes": $((root_mib * 1024 * 1024)), "fs": "ext4", "uuid": "$root_uuid", "partuuid": "$root_guid" },
  "loader": "EFI/debian/linuxx64.efi",
  "cmdline": "$cmdline",
  "kernel": "$kver",
  "packages": { "cloud-init": "$v_ci", "openssh-server": "$v_ssh", "$kernel_pkg": "$v_kpkg", "netplan.io": "$v_netplan", "systemd": "$v_systemd" },
  "network": "netplan.io rendering for systemd-networkd (Debian 12 genericcloud)",
  "build_seconds": $built
}
EOF
    rm -rf "$cloudos_dir"
    mkdir -p "$cloudos_dir"
    mv "$disk" "$work/info.json" "$cloudos_dir/"
    # Images of earlier recipes are of no use to this checkout.
    for old in "$parent"/????????????????; do
      [ "$old" = "$cloudos_dir" ] || [ ! -d "$old" ] || rm -rf "$old"
    done
    say "ready in ${built}s: $cloudos_dir/disk.raw ($((alloc_kib / 1024)) MiB allocated), cloud-init $v_ci, openssh-server $v_ssh, kernel $kver"
  )
fi
unset cloudos_hash cloudos_dir p
