//! The Debian guest kernels (fetched and unpacked by `qemu/fetch-kernel.sh`,
//! amd64 and arm64), the arm64 boot pieces `tests/setup.d/arm64.sh` fetches,
//! and a tiny busybox initramfs for smoke boots.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cache_dir, run};

/// An unpacked Debian linux-image package.
#[derive(Debug, Clone)]
pub struct DebianKernel {
    /// The kernel image: a bzImage with EFI stub (amd64), an uncompressed
    /// Image with EFI stub (arm64).
    pub vmlinuz: PathBuf,
    /// `lib/modules/<version>` with modules.dep and modules.alias.
    pub modules: PathBuf,
    /// The kernel release, e.g. `6.1.0-57-amd64`.
    pub version: String,
}

/// The cached Debian kernel (amd64), fetched first if it is missing.
pub fn debian_kernel() -> anyhow::Result<DebianKernel> {
    cached_kernel("kernel", "amd64")
}

/// The cached Debian arm64 kernel (`linux-image-arm64:arm64`, in
/// `$ANNEAL_CACHE/kernel-arm64`), fetched first if it is missing.
pub fn debian_kernel_arm64() -> anyhow::Result<DebianKernel> {
    cached_kernel("kernel-arm64", "arm64")
}

fn cached_kernel(cache: &str, arch: &str) -> anyhow::Result<DebianKernel> {
    let dir = cache_dir().join(cache).join("current");
    if !dir.join("vmlinuz").is_file() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../qemu/fetch-kernel.sh");
        run(Command::new("bash").arg(script).arg(arch))?;
    }
    let version = std::fs::read_to_string(dir.join("version"))?
        .trim()
        .to_string();
    Ok(DebianKernel {
        vmlinuz: dir.join("vmlinuz"),
        modules: dir.join("modules"),
        version,
    })
}

/// The arm64 pieces of the boot matrix, from Debian's arm64 packages
/// (`tests/setup.d/arm64.sh` fetches them into `$ANNEAL_CACHE/arm64`).
#[derive(Debug, Clone)]
pub struct Arm64Pieces {
    /// busybox-static:arm64's `/bin/busybox`.
    pub busybox: PathBuf,
    /// Debian's signed shim (`shimaa64.efi`).
    pub shim: PathBuf,
    /// Debian's signed network GRUB, named `grubaa64.efi` (what shim loads
    /// from its own directory).
    pub grub: PathBuf,
    /// systemd-boot-efi:arm64's UKI stub (`linuxaa64.efi.stub`): the
    /// arm64 test OS's loader.
    pub uki_stub: PathBuf,
    /// e2fsprogs:arm64 and its libraries unpacked (`sbin/e2fsck`,
    /// `sbin/resize2fs`): `anneal-initramfs --sysroot`.
    pub sysroot: PathBuf,
}

/// The cached arm64 pieces; an error naming the set-up when one is missing.
pub fn arm64_pieces() -> anyhow::Result<Arm64Pieces> {
    let dir = cache_dir().join("arm64");
    let p = Arm64Pieces {
        busybox: dir.join("busybox"),
        shim: dir.join("shimaa64.efi"),
        grub: dir.join("grubaa64.efi"),
        uki_stub: dir.join("linuxaa64.efi.stub"),
        sysroot: dir.join("sysroot"),
    };
    for f in [
        &p.busybox,
        &p.shim,
        &p.grub,
        &p.uki_stub,
        &p.sysroot.join(".complete"),
    ] {
        if !f.is_file() {
            anyhow::bail!(
                "{} is missing: run `bash tests/setup.sh` (tests/setup.d/arm64.sh fetches the arm64 pieces)",
                f.display()
            );
        }
    }
    Ok(p)
}

/// A newc initramfs with busybox (from `busybox-static`) whose `/init` runs
/// `script` (a busybox `sh` script body) after mounting proc, sys and dev.
pub fn smoke_initramfs(script: &str) -> anyhow::Result<Vec<u8>> {
    smoke_initramfs_with(Path::new("/bin/busybox"), script)
}

/// `smoke_initramfs` with another static busybox: the arm64 one of
/// `arm64_pieces()` for an arm64 guest.
pub fn smoke_initramfs_with(busybox: &Path, script: &str) -> anyhow::Result<Vec<u8>> {
    let busybox = std::fs::read(busybox)
        .map_err(|e| anyhow::anyhow!("{} (package busybox-static): {e}", busybox.display()))?;
    let mut a = anneal_cpio::Archive::new();
    a.file("bin/busybox", 0o755, busybox)?;
    a.symlink("bin/sh", "busybox")?;
    for d in ["proc", "sys", "dev", "run", "tmp"] {
        a.dir(d, 0o755)?;
    }
    a.char_device("dev/console", 0o600, 5, 1)?;
    let init = format!(
        "#!/bin/busybox sh\n/bin/busybox --install -s /bin\nmount -t proc proc /proc\nmount -t sysfs sys /sys\nmount -t devtmpfs dev /dev\n{script}\n"
    );
    a.file("init", 0o755, init.into_bytes())?;
    Ok(a.to_bytes())
}
