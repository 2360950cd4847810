//! The Debian guest kernel (fetched and unpacked by `qemu/fetch-kernel.sh`)
//! and a tiny busybox initramfs for smoke boots.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cache_dir, run};

/// An unpacked Debian linux-image package.
#[derive(Debug, Clone)]
pub struct DebianKernel {
    /// The kernel image (bzImage with EFI stub).
    pub vmlinuz: PathBuf,
    /// `lib/modules/<version>` with modules.dep and modules.alias.
    pub modules: PathBuf,
    /// The kernel release, e.g. `6.1.0-57-amd64`.
    pub version: String,
}

/// The cached Debian kernel, fetched first if it is missing.
pub fn debian_kernel() -> anyhow::Result<DebianKernel> {
    let dir = cache_dir().join("kernel").join("current");
    if !dir.join("vmlinuz").is_file() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../qemu/fetch-kernel.sh");
        run(Command::new("bash").arg(script))?;
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

/// A newc initramfs with busybox (from `busybox-static`) whose `/init` runs
/// `script` (a busybox `sh` script body) after mounting proc, sys and dev.
pub fn smoke_initramfs(script: &str) -> anyhow::Result<Vec<u8>> {
    let busybox = std::fs::read("/bin/busybox")
        .map_err(|e| anyhow::anyhow!("/bin/busybox (package busybox-static): {e}"))?;
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
