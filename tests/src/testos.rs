//! The bootable test OS the deploy tests import and deploy: a raw GPT disk
//! built from Debian packages, reproducibly, and cached.
//!
//! - p1: the ESP (FAT32, 64 MiB) holding only `\EFI\anneal\linux.efi` (a
//!   vendor directory; no `\EFI\BOOT\`: installing the removable fallback is
//!   the deploy's job).
//! - p2: swap (64 MiB, `mkswap` with a fixed UUID).
//! - p3: the ext4 root (fixed UUID) with `/anneal-marker` and 208 MiB of
//!   pseudo-random data under `/data` (fixed seed).
//!
//! The OS loader is a UKI: systemd-boot-efi's `linuxx64.efi.stub` with
//! `.osrel`, `.cmdline`, `.linux` (the Debian kernel the agent initramfs
//! uses) and `.initrd` added by `objcopy`. Its initramfs (static busybox, the
//! modules to mount ext4 from virtio-blk, NVMe or AHCI, packed by
//! `anneal-initramfs`) finds the root by the UUID of the command line, mounts
//! it read-only and prints on the serial console:
//!
//! ```text
//! ANNEAL-MARKER <sha256 of /anneal-marker>
//! ANNEAL-DEPLOYED <DMI product serial>
//! ANNEAL-ROOT <root fs UUID> <device>
//! ANNEAL-DATA <KiB under /data>
//! ```
//!
//! then powers off. The DMI serial is what QEMU's `-smbios type=1,serial=NAME`
//! sets. See docs/testos.md.
//!
//! [`test_os_secure_boot`] is the same disk booting the way a Debian
//! install does under Secure Boot: its ESP holds Debian's signed shim and
//! signed GRUB in `\EFI\debian\` with a `grub.cfg` there, and Debian's
//! signed kernel with the same initramfs beside them; no UKI (systemd's
//! stub is not signed by anyone a firmware trusts).

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anneal_initramfs::{Compression, Inputs, Selection};
use anneal_testinfra::{DebianKernel, cache_dir, debian_kernel, debian_kernel_arm64, run};
use anyhow::Context;
use sha2::{Digest, Sha256};

/// Bump when the recipe changes in a way the hashed inputs do not show.
const RECIPE: &str = "anneal-testos-v1";

/// systemd-boot-efi's UKI stub.
pub const UKI_STUB: &str = "/usr/lib/systemd/boot/efi/linuxx64.efi.stub";
/// busybox-static.
pub const BUSYBOX: &str = "/bin/busybox";

/// The OS loader inside the ESP, as UEFI spells it.
pub const LOADER_PATH: &str = r"\EFI\anneal\linux.efi";
/// The OS loader inside the ESP, as mtools spells it.
pub const LOADER_MTOOLS: &str = "::/EFI/anneal/linux.efi";
/// The Secure Boot test OS's loader: Debian's signed shim.
pub const SHIM_LOADER_PATH: &str = r"\EFI\debian\shimx64.efi";

/// GPT disk GUID.
pub const DISK_GUID: &str = "a2b3c4d5-0000-4a11-9e00-7e570500d15c";
/// ext4 root filesystem UUID (the `root=UUID=` of the loader's command line).
pub const ROOT_FS_UUID: &str = "a22ea1ed-7e57-4057-8001-000000000003";
/// Swap UUID.
pub const SWAP_UUID: &str = "a22ea1ed-7e57-4057-8001-000000000002";
/// FAT volume id of the ESP.
pub const ESP_VOLUME_ID: &str = "A22E0001";

const SECTOR: u64 = 512;
const MIB: u64 = 1 << 20;
/// Partition sizes in MiB: ESP, swap, root; the first starts at 1 MiB.
const ESP_MIB: u64 = 64;
/// The arm64 ESP: Debian's arm64 kernel is an uncompressed 33 MB Image, so
/// its UKI (~36 MB) and the removable-media copy the deploy installs beside
/// it need more than 64 MiB.
const ESP_MIB_ARM64: u64 = 128;
const SWAP_MIB: u64 = 64;
const ROOT_MIB: u64 = 512;
/// Pseudo-random data on the root: this many files of `DATA_FILE_MIB`.
const DATA_FILES: usize = 13;
const DATA_FILE_MIB: usize = 16;
/// Timestamps of everything in the image (2026-01-01T00:00:00Z).
const EPOCH: u64 = 1_767_225_600;

/// One GPT partition of the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// 1-based partition number.
    pub number: u32,
    /// Unique partition GUID (lowercase).
    pub part_uuid: String,
    /// Partition type GUID (lowercase).
    pub type_guid: String,
    /// First LBA (512-byte sectors).
    pub start_lba: u64,
    /// Length in sectors.
    pub size_lba: u64,
}

impl Partition {
    /// Byte offset of the partition in the image.
    pub fn offset(&self) -> u64 {
        self.start_lba * SECTOR
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.size_lba * SECTOR
    }

    /// Whether the partition is empty (never, for the test OS).
    pub fn is_empty(&self) -> bool {
        self.size_lba == 0
    }

    /// The `-i` argument of mtools for a FAT volume in this partition of `image`.
    pub fn mtools_image(&self, image: &Path) -> String {
        format!("{}@@{}", image.display(), self.offset())
    }
}

/// The built test OS.
#[derive(Debug, Clone)]
pub struct TestOs {
    /// The raw GPT disk image (sparse). Shared by every test: copy it before
    /// writing to it.
    pub image: PathBuf,
    /// Size of the image in bytes.
    pub image_bytes: u64,
    /// SHA-256 (hex) of `/anneal-marker` on the root: what the booted OS
    /// prints after `ANNEAL-MARKER `.
    pub marker_sha256: String,
    /// ext4 UUID of the root.
    pub root_fs_uuid: String,
    /// Swap UUID.
    pub swap_uuid: String,
    /// The ESP (p1).
    pub esp: Partition,
    /// The swap slot (p2).
    pub swap: Partition,
    /// The ext4 root (p3).
    pub root: Partition,
    /// The OS loader inside the ESP (`\EFI\anneal\linux.efi`).
    pub loader: String,
    /// Bytes of pseudo-random data on the root (besides the marker).
    pub data_bytes: u64,
    /// The kernel command line built into the UKI.
    pub cmdline: String,
}

/// The partitions of the layout (fixed).
pub fn partitions() -> [Partition; 3] {
    partitions_for(Arch::X86_64)
}

fn esp_mib(arch: Arch) -> u64 {
    match arch {
        Arch::X86_64 => ESP_MIB,
        Arch::Aarch64 => ESP_MIB_ARM64,
    }
}

/// The partitions of `arch`'s test OS: the same but for the ESP's size
/// (`ESP_MIB_ARM64` on arm64).
pub fn partitions_for(arch: Arch) -> [Partition; 3] {
    let esp_mib = esp_mib(arch);
    let lba = |mib: u64| mib * MIB / SECTOR;
    let part = |number, part_uuid: &str, type_guid: &str, start_mib, size_mib| Partition {
        number,
        part_uuid: part_uuid.to_string(),
        type_guid: type_guid.to_string(),
        start_lba: lba(start_mib),
        size_lba: lba(size_mib),
    };
    [
        part(
            1,
            "a2b3c4d5-0001-4e5f-8a00-7e5705000001",
            "c12a7328-f81f-11d2-ba4b-00a0c93ec93b",
            1,
            esp_mib,
        ),
        part(
            2,
            "a2b3c4d5-0002-4e5f-8a00-7e5705000002",
            "0657fd6d-a4ab-43c4-84e5-0933c84b4f4f",
            1 + esp_mib,
            SWAP_MIB,
        ),
        part(
            3,
            "a2b3c4d5-0003-4e5f-8a00-7e5705000003",
            "4f68bce3-e8cd-4db1-96e7-fbcaf984b709",
            1 + esp_mib + SWAP_MIB,
            ROOT_MIB,
        ),
    ]
}

/// Total image size: the partitions plus 1 MiB before and after (GPT and
/// its backup).
fn image_bytes(arch: Arch) -> u64 {
    (1 + esp_mib(arch) + SWAP_MIB + ROOT_MIB + 1) * MIB
}

/// The content of `/anneal-marker` (4 KiB of text, deterministic).
pub fn marker_bytes() -> Vec<u8> {
    let mut s =
        String::from("anneal test OS marker: deployed by anneal, read by the test OS /init\n");
    let mut i = 0u32;
    while s.len() < 4096 - 64 {
        s.push_str(&format!(
            "line {i:04}: the quick brown fox jumps over the lazy dog\n"
        ));
        i += 1;
    }
    s.into_bytes()
}

/// The kernel command line of the UKI.
pub fn cmdline() -> String {
    cmdline_for(Arch::X86_64)
}

/// The kernel command line of `arch`'s UKI (its serial console: the 16550
/// of a PC, the PL011 of an arm64 board).
pub fn cmdline_for(arch: Arch) -> String {
    let console = match arch {
        Arch::X86_64 => "ttyS0,115200",
        Arch::Aarch64 => "ttyAMA0",
    };
    format!("console={console} root=UUID={ROOT_FS_UUID} ro panic=-1 loglevel=4")
}

/// The machine architecture a test OS boots on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// x86_64: Debian's amd64 kernel, systemd-boot-efi's `linuxx64.efi.stub`.
    X86_64,
    /// aarch64: Debian's arm64 kernel, busybox and `linuxaa64.efi.stub`
    /// (tests/setup.d/arm64.sh), the UKI made by the cross binutils.
    Aarch64,
}

/// What a test OS of one architecture is made of.
struct Recipe {
    arch: Arch,
    kernel: DebianKernel,
    stub: PathBuf,
    busybox: PathBuf,
    /// binutils that read and write the stub's PE format
    objcopy: &'static str,
    objdump: &'static str,
}

impl Recipe {
    fn of(arch: Arch) -> anyhow::Result<Recipe> {
        let r = match arch {
            Arch::X86_64 => {
                for (path, pkg) in [(UKI_STUB, "systemd-boot-efi"), (BUSYBOX, "busybox-static")] {
                    if !Path::new(path).is_file() {
                        anyhow::bail!(
                            "{path} is missing: install the Debian package {pkg} (tests/setup.sh does)"
                        );
                    }
                }
                Recipe {
                    arch,
                    kernel: debian_kernel()?,
                    stub: UKI_STUB.into(),
                    busybox: BUSYBOX.into(),
                    objcopy: "objcopy",
                    objdump: "objdump",
                }
            }
            Arch::Aarch64 => {
                let pieces = anneal_testinfra::arm64_pieces()?;
                Recipe {
                    arch,
                    kernel: debian_kernel_arm64()?,
                    stub: pieces.uki_stub,
                    busybox: pieces.busybox,
                    objcopy: "aarch64-linux-gnu-objcopy",
                    objdump: "aarch64-linux-gnu-objdump",
                }
            }
        };
        Ok(r)
    }
}

/// The initramfs `/init` (busybox sh).
fn init_script() -> String {
    r#"#!/bin/busybox sh
# anneal test OS /init: mount the root by UUID, print the marker, power off.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
fail() {
  echo "ANNEAL-TESTOS-ERROR $*"
  echo "block devices:"; ls /sys/class/block 2>&1
  poweroff -f
}
echo "ANNEAL-TESTOS init $(uname -r)"
while read -r m; do
  case "$m" in ''|'#'*) continue ;; esac
  insmod "/lib/modules/$(uname -r)/$m" 2>/dev/null
done < /etc/testos/modules
uuid=
for arg in $(cat /proc/cmdline); do
  case "$arg" in root=UUID=*) uuid=${arg#root=UUID=} ;; esac
done
[ -n "$uuid" ] || fail "no root=UUID= on the kernel command line: $(cat /proc/cmdline)"
dev=
i=0
while [ $i -lt 300 ]; do
  dev=$(findfs "UUID=$uuid" 2>/dev/null) && [ -n "$dev" ] && break
  dev=
  i=$((i + 1))
  sleep 0.1
done
[ -n "$dev" ] || fail "root UUID=$uuid not found after 30 s"
mkdir -p /newroot
mount -t ext4 -o ro "$dev" /newroot || fail "cannot mount $dev (UUID=$uuid) as ext4"
[ -f /newroot/anneal-marker ] || fail "$dev (UUID=$uuid) has no /anneal-marker"
sum=$(sha256sum /newroot/anneal-marker) || fail "cannot read /anneal-marker"
serial=$(cat /sys/class/dmi/id/product_serial 2>/dev/null)
echo "ANNEAL-MARKER ${sum%% *}"
echo "ANNEAL-DEPLOYED ${serial:-unknown}"
echo "ANNEAL-ROOT $uuid $dev"
echo "ANNEAL-DATA $(du -sk /newroot/data | cut -f1)KiB"
umount /newroot
poweroff -f
"#
    .to_string()
}

/// The modules the test OS initramfs loads: ext4 (and crc32c, which it
/// needs at mount time without declaring it) and the disk controllers QEMU
/// and servers present.
const MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_blk",
    "nvme",
    "ahci",
    "sd_mod",
    "crc32c_generic",
    "ext4",
];

fn sha256_file(path: &Path) -> anyhow::Result<Vec<u8>> {
    let mut f = fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().to_vec())
}

/// The test OS, built on first use and cached under
/// `$ANNEAL_CACHE/testos/<hash of the inputs>/` (the build happens in a
/// temporary directory beside it and is renamed into place, so concurrent
/// callers each get a complete image; the loser's copy is discarded).
pub fn test_os() -> anyhow::Result<TestOs> {
    test_os_for(Arch::X86_64)
}

/// [`test_os`] for `arch`: the same disk (layout, UUIDs, root and its
/// marker), its UKI built from that architecture's kernel, stub and
/// initramfs, its console on that architecture's serial port.
pub fn test_os_for(arch: Arch) -> anyhow::Result<TestOs> {
    cached_build(Recipe::of(arch)?, Loader::Uki)
}

/// The x86_64 test OS booting through Debian's signed shim and GRUB and
/// Debian's signed kernel (a Secure Boot firmware with the Microsoft keys
/// runs it): the same layout, root and marker as [`test_os`]; its ESP
/// holds `\EFI\debian\{shimx64.efi, grubx64.efi, mmx64.efi?, grub.cfg}`,
/// `\vmlinuz` and `\initrd.img`. Debian's monolithic signed GRUB reads
/// `grub.cfg` from its prefix, `/EFI/debian`, also when shim runs it from
/// `\EFI\BOOT\` (the removable path the deploy installs).
pub fn test_os_secure_boot() -> anyhow::Result<TestOs> {
    let sb = cache_dir().join("secureboot");
    let shim = sb.join("shimx64.efi");
    let grub = sb.join("grubx64-disk.efi");
    for p in [&shim, &grub] {
        anyhow::ensure!(
            p.is_file(),
            "{} is missing: tests/setup.d/secureboot.sh fetches Debian's signed shim and GRUB",
            p.display()
        );
    }
    cached_build(Recipe::of(Arch::X86_64)?, Loader::Shim { shim, grub })
}

/// How the test OS boots from its ESP.
#[derive(Debug, Clone)]
enum Loader {
    /// `\EFI\anneal\linux.efi`, a UKI.
    Uki,
    /// `\EFI\debian\shimx64.efi` → `grubx64.efi` → `\vmlinuz`.
    Shim { shim: PathBuf, grub: PathBuf },
}

fn cached_build(recipe: Recipe, loader: Loader) -> anyhow::Result<TestOs> {
    let arch = recipe.arch;
    let kernel = &recipe.kernel;
    let mut h = Sha256::new();
    h.update(RECIPE);
    h.update(kernel.version.as_bytes());
    for p in [
        kernel.vmlinuz.as_path(),
        recipe.stub.as_path(),
        recipe.busybox.as_path(),
    ] {
        h.update(sha256_file(p)?);
    }
    h.update(init_script());
    h.update(cmdline_for(arch));
    h.update(esp_mib(arch).to_le_bytes());
    h.update(MODULES.join(","));
    if let Loader::Shim { shim, grub } = &loader {
        h.update(b"shim");
        h.update(sha256_file(shim)?);
        h.update(sha256_file(grub)?);
        h.update(shim_grub_cfg(arch));
    }
    let key = hex::encode(&h.finalize()[..8]);
    let base = cache_dir().join("testos");
    let dir = base.join(&key);
    let mut os = describe(&dir, arch);
    if matches!(loader, Loader::Shim { .. }) {
        os.loader = SHIM_LOADER_PATH.to_string();
    }
    if dir.join("testos.json").is_file() {
        return Ok(os);
    }
    fs::create_dir_all(&base).with_context(|| format!("create {}", base.display()))?;
    remove_stale_builds(&base);
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".build-{key}-"))
        .tempdir_in(&base)?;
    let started = Instant::now();
    build(tmp.path(), &recipe, &loader)
        .with_context(|| format!("building the test OS in {}", tmp.path().display()))?;
    let manifest = serde_json::json!({
        "image": "disk.img",
        "image_bytes": os.image_bytes,
        "marker_sha256": os.marker_sha256,
        "root_fs_uuid": os.root_fs_uuid,
        "swap_uuid": os.swap_uuid,
        "loader": os.loader,
        "cmdline": os.cmdline,
        "kernel": kernel.version,
        "partitions": partitions_for(arch).iter().map(|p| serde_json::json!({
            "number": p.number, "part_uuid": p.part_uuid, "type": p.type_guid,
            "start_lba": p.start_lba, "size_lba": p.size_lba,
        })).collect::<Vec<_>>(),
        "build_seconds": started.elapsed().as_secs_f64(),
    });
    fs::write(
        tmp.path().join("testos.json"),
        serde_json::to_vec_pretty(&manifest)?,
    )?;
    match fs::rename(tmp.path(), &dir) {
        Ok(()) => {
            // Renamed: nothing left for the TempDir to delete.
            let _ = tmp.keep();
        }
        // Another caller won the race: its image is the same.
        Err(_) if dir.join("testos.json").is_file() => {}
        Err(e) => {
            return Err(e)
                .with_context(|| format!("rename {} to {}", tmp.path().display(), dir.display()));
        }
    }
    Ok(os)
}

/// Removes build directories a killed test left behind (older than an hour:
/// a live build takes well under a minute).
fn remove_stale_builds(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let stale = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age.as_secs() > 3600);
        if stale && e.file_name().to_string_lossy().starts_with(".build-") {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

fn describe(dir: &Path, arch: Arch) -> TestOs {
    let [esp, swap, root] = partitions_for(arch);
    TestOs {
        image: dir.join("disk.img"),
        image_bytes: image_bytes(arch),
        marker_sha256: hex::encode(Sha256::digest(marker_bytes())),
        root_fs_uuid: ROOT_FS_UUID.to_string(),
        swap_uuid: SWAP_UUID.to_string(),
        esp,
        swap,
        root,
        loader: LOADER_PATH.to_string(),
        data_bytes: (DATA_FILES * DATA_FILE_MIB) as u64 * MIB,
        cmdline: cmdline_for(arch),
    }
}

/// Builds everything into `dir` (ends with `dir/disk.img`).
fn build(dir: &Path, recipe: &Recipe, loader: &Loader) -> anyhow::Result<()> {
    let initrd = dir.join("initrd.img");
    write_initramfs(dir, &recipe.kernel, &recipe.busybox, &initrd)?;
    let [esp, swap, root] = partitions_for(recipe.arch);
    let esp_img = dir.join("esp.img");
    match loader {
        Loader::Uki => {
            let uki = dir.join("linux.efi");
            build_uki(dir, recipe, &initrd, &uki)?;
            build_esp(&esp_img, esp.len(), &uki)?;
        }
        Loader::Shim { shim, grub } => {
            build_esp_shim(dir, &esp_img, esp.len(), recipe, shim, grub, &initrd)?;
        }
    }
    let swap_img = dir.join("swap.img");
    fs::File::create(&swap_img)?.set_len(swap.len())?;
    run(Command::new("mkswap")
        .args(["-U", SWAP_UUID, "-L", "anneal-swap"])
        .arg(&swap_img))?;
    let root_img = dir.join("root.img");
    build_root(dir, &root_img, root.len())?;

    let image = dir.join("disk.img");
    fs::File::create(&image)?.set_len(image_bytes(recipe.arch))?;
    let mut script = format!("label: gpt\nlabel-id: {DISK_GUID}\nunit: sectors\nfirst-lba: 2048\n");
    for (p, name) in [(&esp, "ESP"), (&swap, "swap"), (&root, "root")] {
        script.push_str(&format!(
            "start={}, size={}, type={}, uuid={}, name=\"{name}\"\n",
            p.start_lba, p.size_lba, p.type_guid, p.part_uuid
        ));
    }
    sfdisk(&image, &script)?;
    for (p, img) in [(&esp, &esp_img), (&swap, &swap_img), (&root, &root_img)] {
        copy_sparse(img, &image, p.offset(), p.len())?;
        fs::remove_file(img)?;
    }
    fs::remove_file(&initrd)?;
    Ok(())
}

fn sfdisk(image: &Path, script: &str) -> anyhow::Result<()> {
    let mut child = Command::new("sfdisk")
        .args([
            "--quiet",
            "--no-reread",
            "--no-tell-kernel",
            "--wipe",
            "never",
        ])
        .arg(image)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("run sfdisk (package fdisk)")?;
    child
        .stdin
        .take()
        .context("sfdisk stdin")?
        .write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        anyhow::bail!(
            "sfdisk {} failed: {}\nscript:\n{script}",
            image.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Copies `src` (at most `max` bytes) into `dst` at `offset`, skipping
/// zero MiB blocks so the image stays sparse.
fn copy_sparse(src: &Path, dst: &Path, offset: u64, max: u64) -> anyhow::Result<()> {
    let len = fs::metadata(src)?.len();
    anyhow::ensure!(
        len <= max,
        "{} is {len} bytes, more than its partition ({max})",
        src.display()
    );
    let mut r = fs::File::open(src)?;
    let mut w = fs::OpenOptions::new().write(true).open(dst)?;
    let mut buf = vec![0u8; MIB as usize];
    let mut pos = 0u64;
    while pos < len {
        let n = usize::try_from((len - pos).min(MIB))?;
        r.read_exact(&mut buf[..n])?;
        if buf[..n].iter().any(|&b| b != 0) {
            w.seek(SeekFrom::Start(offset + pos))?;
            w.write_all(&buf[..n])?;
        }
        pos += n as u64;
    }
    w.sync_all()?;
    Ok(())
}

fn write_initramfs(
    dir: &Path,
    kernel: &DebianKernel,
    busybox: &Path,
    out: &Path,
) -> anyhow::Result<()> {
    let init = dir.join("init");
    fs::write(&init, init_script())?;
    let inputs = Inputs {
        agent: init.clone(),
        modules_dir: Some(kernel.modules.clone()),
        kernel_release: Some(kernel.version.clone()),
        selection: Selection {
            classes: Vec::new(),
            names: MODULES.iter().map(|m| m.to_string()).collect(),
            exclude: Vec::new(),
        },
        firmware_dir: None,
        firmware: Vec::new(),
        busybox: Some(busybox.to_path_buf()),
        binaries: Vec::new(),
        sysroot: None,
        compression: Compression::Zstd,
        level: 9,
    };
    let (mut archive, report) = anneal_initramfs::build_archive(&inputs).with_context(|| {
        format!(
            "packing the test OS initramfs from {}",
            kernel.modules.display()
        )
    })?;
    // The module files in load order, for the init's insmod loop.
    let index = anneal_kmod::ModuleIndex::load(&kernel.modules)?;
    let mut list = String::from("# insmod order (relative to /lib/modules/<release>)\n");
    for m in &report.modules {
        let rel = index
            .path_of(m)
            .with_context(|| format!("module {m} has no path in {}", kernel.modules.display()))?;
        list.push_str(rel);
        list.push('\n');
    }
    for m in ["ext4", "virtio_blk", "nvme"] {
        anyhow::ensure!(
            report.modules.iter().any(|r| r == m),
            "the test OS initramfs lacks {m} (modules of {}: {:?})",
            kernel.version,
            report.modules
        );
    }
    archive.dir("etc/testos", 0o755)?;
    archive.file("etc/testos/modules", 0o644, list.into_bytes())?;
    archive.dir("newroot", 0o755)?;
    let bytes = anneal_initramfs::compress(&archive.to_bytes(), inputs.compression, inputs.level)?;
    fs::write(out, bytes)?;
    fs::remove_file(&init)?;
    Ok(())
}

/// Section layout of the stub: (end of the last section's VMA, section
/// alignment), from `objdump -h` and `objdump -p`.
fn stub_layout(objdump: &str, stub: &Path) -> anyhow::Result<(u64, u64)> {
    let hdr = run(Command::new(objdump).arg("-h").arg(stub))?;
    let mut end = 0u64;
    for line in hdr.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() == 7 && f[0].parse::<u32>().is_ok() {
            let size = u64::from_str_radix(f[2], 16)?;
            let vma = u64::from_str_radix(f[3], 16)?;
            end = end.max(vma + size);
        }
    }
    let p = run(Command::new(objdump).arg("-p").arg(stub))?;
    let align = p
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some("SectionAlignment"))
                .then(|| f.next().and_then(|v| u64::from_str_radix(v, 16).ok()))
                .flatten()
        })
        .with_context(|| format!("no SectionAlignment in `objdump -p {}`", stub.display()))?;
    anyhow::ensure!(
        end > 0 && align > 0,
        "cannot read the sections of {}",
        stub.display()
    );
    Ok((end, align))
}

/// Builds the UKI with objcopy as the systemd documentation describes: each
/// added section at the next aligned VMA after the previous one.
fn build_uki(dir: &Path, recipe: &Recipe, initrd: &Path, out: &Path) -> anyhow::Result<()> {
    let vmlinuz = recipe.kernel.vmlinuz.as_path();
    let osrel = dir.join("os-release");
    fs::write(
        &osrel,
        "NAME=\"anneal test OS\"\nID=anneal-testos\nVERSION_ID=1\nPRETTY_NAME=\"anneal test OS 1\"\n",
    )?;
    let cmdline_file = dir.join("cmdline");
    fs::write(&cmdline_file, cmdline_for(recipe.arch))?;
    let (end, align) = stub_layout(recipe.objdump, &recipe.stub)?;
    let up = |v: u64| v.div_ceil(align) * align;
    let mut vma = up(end);
    let mut cmd = Command::new(recipe.objcopy);
    for (name, file) in [
        (".osrel", osrel.as_path()),
        (".cmdline", cmdline_file.as_path()),
        (".linux", vmlinuz),
        (".initrd", initrd),
    ] {
        cmd.arg("--add-section")
            .arg(format!("{name}={}", file.display()))
            .arg("--change-section-vma")
            .arg(format!("{name}=0x{vma:x}"));
        vma = up(vma + fs::metadata(file)?.len());
    }
    cmd.arg(&recipe.stub).arg(out);
    run(&mut cmd).with_context(|| format!("{} (binutils) building the UKI", recipe.objcopy))?;
    let mut pe = fs::read(out)?;
    pe_set_timestamp(&mut pe, u32::try_from(EPOCH)?)
        .with_context(|| format!("{} is not a PE image", out.display()))?;
    fs::write(out, pe)?;
    fs::remove_file(&osrel)?;
    fs::remove_file(&cmdline_file)?;
    Ok(())
}

/// Sets the COFF TimeDateStamp of a PE image (objcopy writes the build
/// time there) and recomputes the optional header's CheckSum, so the UKI is
/// reproducible.
fn pe_set_timestamp(pe: &mut [u8], stamp: u32) -> anyhow::Result<()> {
    let u32_at = |b: &[u8], o: usize| -> anyhow::Result<u32> {
        let w = b.get(o..o + 4).context("truncated PE header")?;
        Ok(u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
    };
    let lfanew = usize::try_from(u32_at(pe, 0x3c)?)?;
    anyhow::ensure!(
        pe.get(lfanew..lfanew + 4) == Some(b"PE\0\0".as_slice()),
        "no PE signature"
    );
    let stamp_at = lfanew + 8;
    let sum_at = lfanew + 4 + 20 + 64;
    anyhow::ensure!(pe.len() > sum_at + 4, "truncated PE optional header");
    pe[stamp_at..stamp_at + 4].copy_from_slice(&stamp.to_le_bytes());
    pe[sum_at..sum_at + 4].fill(0);
    let mut sum: u64 = 0;
    for (i, w) in pe.chunks(2).enumerate() {
        if (sum_at..sum_at + 4).contains(&(i * 2)) {
            continue;
        }
        sum += u64::from(w[0]) | (w.get(1).map_or(0, |&b| u64::from(b)) << 8);
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum = (sum & 0xffff) + (sum >> 16);
    let total = u32::try_from(sum + pe.len() as u64)?;
    pe[sum_at..sum_at + 4].copy_from_slice(&total.to_le_bytes());
    Ok(())
}

fn mtools(args: &[&str], image: &str) -> anyhow::Result<String> {
    run(Command::new(args[0])
        .env("MTOOLS_SKIP_CHECK", "1")
        .env("SOURCE_DATE_EPOCH", EPOCH.to_string())
        .arg("-i")
        .arg(image)
        .args(&args[1..]))
    .with_context(|| format!("{} (package mtools)", args[0]))
}

fn build_esp(esp: &Path, len: u64, uki: &Path) -> anyhow::Result<()> {
    mkfs_esp(esp, len)?;
    let img = esp.display().to_string();
    mtools(&["mmd", "::/EFI", "::/EFI/anneal"], &img)?;
    set_mtime(uki)?;
    let uki_s = uki.display().to_string();
    mtools(&["mcopy", "-m", &uki_s, LOADER_MTOOLS], &img)?;
    fs::remove_file(uki)?;
    Ok(())
}

/// The `grub.cfg` of the Secure Boot test OS: the kernel and initramfs
/// from the ESP GRUB was started from, the test OS's command line with
/// `loglevel=6` last, so the kernel's Secure Boot and lockdown messages
/// reach the console.
fn shim_grub_cfg(arch: Arch) -> String {
    format!(
        "set timeout=0\necho 'anneal test OS: GRUB under shim'\nlinux /vmlinuz {} loglevel=6\ninitrd /initrd.img\nboot\n",
        cmdline_for(arch)
    )
}

fn mkfs_esp(esp: &Path, len: u64) -> anyhow::Result<()> {
    run(Command::new("mkfs.vfat")
        .args([
            "-F",
            "32",
            "-n",
            "ANNEAL-ESP",
            "-i",
            ESP_VOLUME_ID,
            "--invariant",
            "-C",
        ])
        .arg(esp)
        .arg((len / 1024).to_string()))
    .context("mkfs.vfat (package dosfstools)")?;
    Ok(())
}

/// The ESP of [`test_os_secure_boot`]: shim, GRUB and `grub.cfg` under
/// `\EFI\debian\`, the signed kernel and the initramfs at the root.
fn build_esp_shim(
    dir: &Path,
    esp: &Path,
    len: u64,
    recipe: &Recipe,
    shim: &Path,
    grub: &Path,
    initrd: &Path,
) -> anyhow::Result<()> {
    mkfs_esp(esp, len)?;
    let img = esp.display().to_string();
    mtools(&["mmd", "::/EFI", "::/EFI/debian"], &img)?;
    let cfg = dir.join("grub.cfg");
    fs::write(&cfg, shim_grub_cfg(recipe.arch))?;
    let staged: Vec<(PathBuf, &str)> = vec![
        (shim.to_path_buf(), "::/EFI/debian/shimx64.efi"),
        (grub.to_path_buf(), "::/EFI/debian/grubx64.efi"),
        (cfg.clone(), "::/EFI/debian/grub.cfg"),
        (recipe.kernel.vmlinuz.clone(), "::/vmlinuz"),
        (initrd.to_path_buf(), "::/initrd.img"),
    ];
    for (src, dest) in &staged {
        // mcopy -m keeps the source's mtime: copy to the build dir first so
        // the epoch can be set without touching the cache's files
        let tmp = dir.join("esp-file");
        fs::copy(src, &tmp)?;
        set_mtime(&tmp)?;
        let tmp_s = tmp.display().to_string();
        mtools(&["mcopy", "-m", &tmp_s, dest], &img)?;
        fs::remove_file(&tmp)?;
    }
    fs::remove_file(&cfg)?;
    Ok(())
}

/// splitmix64: the deterministic data of the root.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn set_mtime(path: &Path) -> anyhow::Result<()> {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(EPOCH);
    fs::File::open(path)?.set_modified(t)?;
    Ok(())
}

fn build_root(dir: &Path, img: &Path, len: u64) -> anyhow::Result<()> {
    let staging = dir.join("rootfs");
    let data = staging.join("data");
    fs::create_dir_all(&data)?;
    fs::write(staging.join("anneal-marker"), marker_bytes())?;
    set_mtime(&staging.join("anneal-marker"))?;
    let mut rng = SplitMix(0x616e_6e65_616c_0001);
    let mut buf = vec![0u8; DATA_FILE_MIB * MIB as usize];
    for i in 0..DATA_FILES {
        for chunk in buf.chunks_exact_mut(8) {
            chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
        }
        let f = data.join(format!("blob-{i:02}.bin"));
        fs::write(&f, &buf)?;
        set_mtime(&f)?;
    }
    set_mtime(&data)?;
    set_mtime(&staging)?;
    fs::File::create(img)?.set_len(len)?;
    run(Command::new("mke2fs")
        .env("E2FSPROGS_FAKE_TIME", EPOCH.to_string())
        .args(["-q", "-F", "-t", "ext4", "-b", "4096", "-L", "anneal-root"])
        .args(["-U", ROOT_FS_UUID])
        .arg("-E")
        .arg(format!("hash_seed={ROOT_FS_UUID},root_owner=0:0"))
        .arg("-d")
        .arg(&staging)
        .arg(img))
    .context("mke2fs (package e2fsprogs)")?;
    // `mke2fs -d` (1.47.0) copies the staging files' atime and ctime, which
    // are the build's: set every inode's times to the epoch.
    let mut script = String::new();
    let mut paths = vec![
        "/".to_string(),
        "/lost+found".to_string(),
        "/anneal-marker".to_string(),
        "/data".to_string(),
    ];
    paths.extend((0..DATA_FILES).map(|i| format!("/data/blob-{i:02}.bin")));
    for p in &paths {
        for field in ["atime", "ctime", "mtime", "crtime"] {
            script.push_str(&format!("set_inode_field {p} {field} @{EPOCH}\n"));
        }
    }
    let script_file = dir.join("debugfs.cmds");
    fs::write(&script_file, script)?;
    run(Command::new("debugfs")
        .env("E2FSPROGS_FAKE_TIME", EPOCH.to_string())
        .arg("-w")
        .arg("-f")
        .arg(&script_file)
        .arg(img))
    .context("debugfs (package e2fsprogs)")?;
    fs::remove_file(&script_file)?;
    fs::remove_dir_all(&staging)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pe_checksum_matches_the_one_the_stub_ships_with() {
        // systemd-boot-efi's stub carries TimeDateStamp 0 and a valid
        // CheckSum: rewriting the same stamp must give back the same bytes.
        let stub = fs::read(UKI_STUB)
            .unwrap_or_else(|e| panic!("{UKI_STUB} (install systemd-boot-efi): {e}"));
        let mut copy = stub.clone();
        pe_set_timestamp(&mut copy, 0).unwrap();
        assert_eq!(copy, stub);
        pe_set_timestamp(&mut copy, 1).unwrap();
        assert_ne!(copy, stub);
        assert!(pe_set_timestamp(&mut [0u8; 64], 0).is_err());
    }

    #[test]
    fn layout_is_aligned_and_within_the_image() {
        let [esp, swap, root] = partitions();
        let [arm_esp, _, arm_root] = partitions_for(Arch::Aarch64);
        assert_eq!(arm_esp.len(), 128 * MIB);
        assert_eq!(
            arm_root.offset() + arm_root.len() + MIB,
            image_bytes(Arch::Aarch64)
        );
        assert_eq!(esp.offset(), MIB);
        assert_eq!(swap.offset(), esp.offset() + esp.len());
        assert_eq!(root.offset(), swap.offset() + swap.len());
        assert!(root.offset() + root.len() + MIB <= image_bytes(Arch::X86_64));
        for p in [&esp, &swap, &root] {
            assert_eq!(p.offset() % MIB, 0);
            assert!(!p.is_empty());
        }
        assert!(marker_bytes().len() >= 2048);
        assert!(cmdline().contains(&format!("root=UUID={ROOT_FS_UUID}")));
    }
}
