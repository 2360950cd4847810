//! The initramfs builder: the agent as `/init`, the selected kernel modules
//! with their dependencies (and the index files the agent's coldplug reads),
//! optional firmware and busybox, written as a reproducible newc cpio and
//! compressed with zstd or gzip. The same inputs give the same bytes.
#![cfg_attr(test, allow(clippy::too_many_lines))]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use anneal_cpio::Archive;
use anneal_kmod::{ModuleIndex, module_name};
use serde::Serialize;
use sha2::{Digest, Sha256};

pub mod elf;

/// A failed build.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// An input file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The module index could not be read.
    #[error("module index")]
    Index(#[from] anneal_kmod::Error),
    /// An explicitly named module does not exist in the tree.
    #[error("module {0} is neither in modules.dep nor built in")]
    UnknownModule(String),
    /// The kernel release could not be worked out.
    #[error("cannot tell the kernel release of {0}: pass it explicitly")]
    Release(PathBuf),
    /// The archive refused an entry.
    #[error("archive")]
    Archive(#[from] anneal_cpio::Error),
    /// Compression failed.
    #[error("{0} compression")]
    Compress(&'static str, #[source] io::Error),
    /// The shared libraries of an extra binary could not be listed.
    #[error(
        "cannot list the shared libraries of {path} with ldd ({detail}): pass a binary of the build host's architecture, a static one, or a foreign root with --sysroot"
    )]
    Ldd {
        /// The binary.
        path: PathBuf,
        /// What ldd said.
        detail: String,
    },
    /// A program or library from the sysroot has unreadable ELF headers.
    #[error("cannot read the ELF headers of {path}")]
    Elf {
        /// The file (inside the sysroot).
        path: PathBuf,
        /// The cause.
        #[source]
        source: elf::ElfError,
    },
    /// A library an extra binary needs is not in the sysroot.
    #[error("{name} (needed by {by}) is in none of {searched} under {sysroot}")]
    MissingLibrary {
        /// The `DT_NEEDED` name.
        name: String,
        /// The program or library that needs it.
        by: PathBuf,
        /// The sysroot.
        sysroot: PathBuf,
        /// The directories searched, relative to the sysroot.
        searched: String,
    },
    /// A library resolved in the sysroot is for another machine than the
    /// program needing it.
    #[error("{path} is for ELF machine {found}, the program {by} for {expected}")]
    Machine {
        /// The library.
        path: PathBuf,
        /// Its `e_machine`.
        found: u16,
        /// The program.
        by: PathBuf,
        /// The program's `e_machine`.
        expected: u16,
    },
}

fn read(path: &Path) -> Result<Vec<u8>, BuildError> {
    fs::read(path).map_err(|source| BuildError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// A named group of drivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    /// virtio transport, block, net, SCSI (VMs).
    Virtio,
    /// NVMe.
    Nvme,
    /// AHCI/SATA and legacy IDE-mode controllers.
    Sata,
    /// SAS HBAs and RAID controllers.
    Sas,
    /// Common server NICs.
    Nics,
    /// efivarfs and the filesystems post-install steps touch.
    Fs,
    /// USB host controllers and USB storage (off by default).
    UsbStorage,
}

impl Class {
    /// Every class.
    pub const ALL: [Class; 7] = [
        Class::Virtio,
        Class::Nvme,
        Class::Sata,
        Class::Sas,
        Class::Nics,
        Class::Fs,
        Class::UsbStorage,
    ];

    /// The default selection: everything but USB storage.
    pub const DEFAULT: [Class; 6] = [
        Class::Virtio,
        Class::Nvme,
        Class::Sata,
        Class::Sas,
        Class::Nics,
        Class::Fs,
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Class::Virtio => "virtio",
            Class::Nvme => "nvme",
            Class::Sata => "sata",
            Class::Sas => "sas",
            Class::Nics => "nics",
            Class::Fs => "fs",
            Class::UsbStorage => "usb-storage",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.name() == s)
    }

    /// The modules of the class (missing ones are skipped: kernels differ).
    pub fn modules(self) -> &'static [&'static str] {
        match self {
            Class::Virtio => &[
                "virtio_pci",
                "virtio_blk",
                "virtio_net",
                "virtio_scsi",
                "virtio_rng",
            ],
            Class::Nvme => &["nvme"],
            Class::Sata => &["ahci", "ata_piix", "ata_generic", "sd_mod"],
            Class::Sas => &[
                "mpt3sas",
                "megaraid_sas",
                "mpi3mr",
                "smartpqi",
                "hpsa",
                "aacraid",
                "isci",
                "pm80xx",
                "sd_mod",
            ],
            Class::Nics => &[
                "e1000",
                "e1000e",
                "igb",
                "igc",
                "ixgbe",
                "i40e",
                "ice",
                "mlx5_core",
                "bnxt_en",
                "tg3",
                "r8169",
                "vmxnet3",
            ],
            Class::Fs => &[
                "efivarfs",
                "ext4",
                "vfat",
                "nls_cp437",
                "nls_ascii",
                "nls_iso8859_1",
                "nls_utf8",
                "crc32c_generic",
                "crc32c_intel",
            ],
            Class::UsbStorage => &[
                "xhci_pci",
                "ehci_pci",
                "ohci_pci",
                "uhci_hcd",
                "usb_storage",
                "uas",
                "sd_mod",
            ],
        }
    }
}

/// Which modules to pack.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Driver classes.
    pub classes: Vec<Class>,
    /// Extra modules by name (an unknown name is an error).
    pub names: Vec<String>,
    /// Modules to leave out (and not pull in as dependencies).
    pub exclude: Vec<String>,
}

/// Compression of the archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// zstd (the kernel's `RD_ZSTD`).
    Zstd,
    /// gzip (every kernel).
    Gzip,
    /// Plain cpio.
    None,
}

/// Everything a build reads.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// The static agent; becomes `/init`.
    pub agent: PathBuf,
    /// `lib/modules/<release>` of the kernel (modules.dep and `kernel/`).
    pub modules_dir: Option<PathBuf>,
    /// The kernel release; worked out from the tree when absent.
    pub kernel_release: Option<String>,
    /// The module selection.
    pub selection: Selection,
    /// A firmware tree (`/lib/firmware` layout): the files the packed modules
    /// declare (`firmware=` in their modinfo) are taken from it when present.
    pub firmware_dir: Option<PathBuf>,
    /// Extra firmware files, relative to `firmware_dir`.
    pub firmware: Vec<String>,
    /// A static busybox for the debug shell and script steps.
    pub busybox: Option<PathBuf>,
    /// Extra dynamically linked programs (e2fsprogs' `e2fsck` and `resize2fs`
    /// for the growLastPartition step): each is packed at its own absolute
    /// path with the ELF interpreter and libraries `ldd` lists for it.
    pub binaries: Vec<PathBuf>,
    /// A foreign root the `binaries` come from (Debian arm64 packages
    /// unpacked with `dpkg-deb -x`, for an arm64 initramfs built on an x86
    /// host, where ldd cannot run the program): each binary path is read
    /// inside it and packed at that path, and its interpreter and libraries
    /// are found there from the ELF headers (`PT_INTERP`, `DT_NEEDED`,
    /// transitively) in the multiarch library directories, symbolic links
    /// followed inside the sysroot.
    pub sysroot: Option<PathBuf>,
    /// Compression.
    pub compression: Compression,
    /// Compression level (zstd 1..=19, gzip 1..=9).
    pub level: i32,
}

/// One row of the size table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SizeRow {
    /// Category (`agent`, `modules/virtio`, `modules/deps`, `firmware`, …).
    pub category: String,
    /// Files.
    pub files: usize,
    /// Uncompressed bytes.
    pub bytes: u64,
}

/// What a build produced.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The kernel release the modules are for.
    pub kernel_release: Option<String>,
    /// Packed modules in load-safe order.
    pub modules: Vec<String>,
    /// Selected names the tree does not have (skipped class members).
    pub missing: Vec<String>,
    /// Sizes by category.
    pub sizes: Vec<SizeRow>,
    /// Size of the uncompressed cpio.
    pub cpio_bytes: u64,
    /// Size of the output.
    pub output_bytes: u64,
    /// Compression used.
    pub compression: Compression,
    /// SHA-256 of the output, hex.
    pub sha256: String,
}

impl Report {
    /// The size table as text.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{:<22} {:>6} {:>12}", "category", "files", "bytes");
        for r in &self.sizes {
            let _ = writeln!(s, "{:<22} {:>6} {:>12}", r.category, r.files, r.bytes);
        }
        let files: usize = self.sizes.iter().map(|r| r.files).sum();
        let _ = writeln!(
            s,
            "{:<22} {:>6} {:>12}",
            "total (cpio)", files, self.cpio_bytes
        );
        let _ = writeln!(
            s,
            "{:<22} {:>6} {:>12}  ({:.1} MiB, sha256 {})",
            format!("output ({:?})", self.compression).to_lowercase(),
            "",
            self.output_bytes,
            self.output_bytes as f64 / (1024.0 * 1024.0),
            self.sha256
        );
        s
    }
}

/// The release of a modules tree: an explicit value, the `version` file
/// beside it (testinfra's cache layout), or its directory name.
pub fn kernel_release(modules_dir: &Path, explicit: Option<&str>) -> Result<String, BuildError> {
    if let Some(r) = explicit {
        return Ok(r.to_string());
    }
    if let Some(parent) = modules_dir.parent()
        && let Ok(v) = fs::read_to_string(parent.join("version"))
        && !v.trim().is_empty()
    {
        return Ok(v.trim().to_string());
    }
    let name = modules_dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().to_string()))
        .unwrap_or_default();
    if name.contains('.') && name.chars().next().is_some_and(|c| c.is_ascii_digit()) {
        return Ok(name);
    }
    Err(BuildError::Release(modules_dir.to_path_buf()))
}

/// Modules with their size-table category, and selected names the tree lacks.
pub type Resolved = (Vec<(String, String)>, Vec<String>);

/// The modules to pack: the selection's names, their hard and `pre:` soft
/// dependencies, in load order, with the class each came from (`deps` for
/// dependencies). Returns (modules with categories, missing names).
pub fn resolve_modules(index: &ModuleIndex, sel: &Selection) -> Result<Resolved, BuildError> {
    let exclude: BTreeSet<String> = sel.exclude.iter().map(|e| module_name(e)).collect();
    let mut wanted: Vec<(String, String)> = Vec::new();
    let mut missing = Vec::new();
    let mut classes = sel.classes.clone();
    classes.sort();
    classes.dedup();
    for c in &classes {
        for m in c.modules() {
            let m = module_name(m);
            if exclude.contains(&m) || index.is_builtin(&m) {
                continue;
            }
            if !index.has(&m) {
                missing.push(m);
                continue;
            }
            if !wanted.iter().any(|(w, _)| *w == m) {
                wanted.push((m, format!("modules/{}", c.name())));
            }
        }
    }
    for n in &sel.names {
        let m = module_name(n);
        if index.is_builtin(&m) || exclude.contains(&m) {
            continue;
        }
        if !index.has(&m) {
            return Err(BuildError::UnknownModule(n.clone()));
        }
        if !wanted.iter().any(|(w, _)| *w == m) {
            wanted.push((m, "modules/extra".to_string()));
        }
    }
    let names: Vec<String> = wanted.iter().map(|(m, _)| m.clone()).collect();
    let (order, _unknown) = index.load_order(&names);
    let category: BTreeMap<&str, &str> = wanted
        .iter()
        .map(|(m, c)| (m.as_str(), c.as_str()))
        .collect();
    let out = order
        .into_iter()
        .filter(|m| !exclude.contains(m))
        .map(|m| {
            let c = category
                .get(m.as_str())
                .copied()
                .unwrap_or("modules/deps")
                .to_string();
            (m, c)
        })
        .collect();
    missing.sort();
    missing.dedup();
    Ok((out, missing))
}

/// The `firmware=` entries of a module's modinfo.
pub fn module_firmware(ko: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    for s in ko.split(|&b| b == 0) {
        if let Some(rest) = s.strip_prefix(b"firmware=")
            && let Ok(name) = std::str::from_utf8(rest)
            && !name.is_empty()
            && !name.contains("..")
            && !name.starts_with('/')
        {
            out.push(name.to_string());
        }
    }
    out.sort();
    out.dedup();
    out
}

fn add_row(rows: &mut BTreeMap<String, SizeRow>, cat: &str, bytes: usize) {
    let r = rows.entry(cat.to_string()).or_insert_with(|| SizeRow {
        category: cat.to_string(),
        ..SizeRow::default()
    });
    r.files += 1;
    r.bytes += bytes as u64;
}

/// Busybox applets linked into `/bin` when busybox is packed.
pub const BUSYBOX_APPLETS: &[&str] = &[
    "sh", "ash", "cat", "chmod", "cp", "dd", "df", "dmesg", "echo", "env", "false", "fdisk",
    "find", "free", "grep", "gzip", "head", "hexdump", "ip", "kill", "less", "ln", "ls", "lsmod",
    "mkdir", "mknod", "mount", "mv", "ping", "ps", "readlink", "rm", "sed", "setsid", "sleep",
    "stat", "sync", "tail", "tar", "test", "top", "touch", "true", "umount", "uname", "vi", "wc",
    "wget", "xxd", "awk", "blkid", "blockdev", "cut", "sort", "tr", "uniq", "wipefs",
];

/// The archive path of a host file: its absolute path without the leading `/`.
fn archive_path(p: &Path) -> String {
    p.to_string_lossy().trim_start_matches('/').to_string()
}

/// The files `ldd` output names: the interpreter and each resolved library
/// (`libx.so.1 => /lib/.../libx.so.1 (0x…)`, `/lib64/ld-linux-x86-64.so.2
/// (0x…)`); `linux-vdso` has no file. A library ldd could not find is an
/// error naming it.
pub fn parse_ldd(out: &str) -> Result<Vec<PathBuf>, String> {
    let mut v = Vec::new();
    for line in out.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("statically linked") {
            continue;
        }
        let target = match line.split_once("=>") {
            Some((name, rest)) => {
                let rest = rest.trim();
                if rest.starts_with("not found") {
                    return Err(format!("{} not found", name.trim()));
                }
                rest
            }
            None => line,
        };
        let path = target.split_whitespace().next().unwrap_or("");
        if path.starts_with('/') {
            v.push(PathBuf::from(path));
        }
    }
    Ok(v)
}

fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>, BuildError> {
    let ldd_err = |detail: String| BuildError::Ldd {
        path: bin.to_path_buf(),
        detail,
    };
    let out = std::process::Command::new("ldd")
        .arg(bin)
        .output()
        .map_err(|e| ldd_err(e.to_string()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // ldd exits 1 for a static binary ("not a dynamic executable").
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("not a dynamic executable") || text.contains("statically linked") {
            // ldd says this of a dynamically linked program of another
            // architecture too: packing it without its libraries would
            // give a program that cannot start.
            if let Ok(data) = fs::read(bin)
                && let Ok(d) = elf::parse(&data)
                && d.interpreter.is_some()
            {
                return Err(ldd_err(format!(
                    "a dynamically linked program for ELF machine {}, another architecture",
                    d.machine
                )));
            }
            return Ok(Vec::new());
        }
        return Err(ldd_err(format!("{} {}", out.status, err.trim())));
    }
    parse_ldd(&text).map_err(ldd_err)
}

/// The file `path` (absolute, as the target system sees it) names inside
/// `root`: every symbolic link on the way is followed inside `root` (an
/// absolute target restarts at `root`, `..` stops at it), so nothing of the
/// build host is read in its place.
pub fn resolve_in(root: &Path, path: &Path) -> io::Result<PathBuf> {
    use std::ffi::OsString;
    use std::path::Component;
    fn push_rev(todo: &mut Vec<OsString>, p: &Path) {
        for c in p.components().rev() {
            match c {
                Component::Normal(s) => todo.push(s.to_os_string()),
                Component::ParentDir => todo.push("..".into()),
                _ => {}
            }
        }
    }
    let mut todo = Vec::new();
    push_rev(&mut todo, path);
    let mut done = PathBuf::new();
    let mut hops = 0;
    while let Some(c) = todo.pop() {
        if c == ".." {
            done.pop();
            continue;
        }
        let here = root.join(&done).join(&c);
        if fs::symlink_metadata(&here)?.file_type().is_symlink() {
            hops += 1;
            if hops > 40 {
                return Err(io::Error::other(format!(
                    "too many levels of symbolic links at {}",
                    here.display()
                )));
            }
            let target = fs::read_link(&here)?;
            if target.is_absolute() {
                done = PathBuf::new();
            }
            push_rev(&mut todo, &target);
        } else {
            done.push(c);
        }
    }
    Ok(root.join(done))
}

/// The interpreter and the libraries (transitively) of `bin`, a program
/// inside `sysroot`, as paths the target system sees: `PT_INTERP`, and each
/// `DT_NEEDED` name in the first of `lib/<triplet>`, `usr/lib/<triplet>`,
/// `lib`, `usr/lib` that has it (glibc's default directories; no
/// `ld.so.cache` is packed). A name equal to the interpreter's file name is
/// the interpreter (the loader knows itself by that soname).
pub fn sysroot_libraries(sysroot: &Path, bin: &Path) -> Result<Vec<PathBuf>, BuildError> {
    let headers = |path: &Path| -> Result<elf::Dynamic, BuildError> {
        let host = resolve_in(sysroot, path).map_err(|source| BuildError::Read {
            path: sysroot.join(archive_path(path)),
            source,
        })?;
        elf::parse(&read(&host)?).map_err(|source| BuildError::Elf { path: host, source })
    };
    let program = headers(bin)?;
    let mut dirs: Vec<String> = Vec::new();
    if let Some(t) = elf::multiarch_triplet(program.machine) {
        dirs.push(format!("/lib/{t}"));
        dirs.push(format!("/usr/lib/{t}"));
    }
    dirs.extend(["/lib".to_string(), "/usr/lib".to_string()]);
    let mut out: BTreeSet<PathBuf> = BTreeSet::new();
    let interp_name = program.interpreter.as_ref().and_then(|i| {
        Path::new(i)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
    });
    if let Some(i) = &program.interpreter {
        // Resolvable, or the build fails here rather than at boot.
        headers(Path::new(i))?;
        out.insert(PathBuf::from(i));
    }
    let mut queue: Vec<(PathBuf, Vec<String>)> = vec![(bin.to_path_buf(), program.needed)];
    while let Some((by, needed)) = queue.pop() {
        for name in needed {
            if interp_name.as_deref() == Some(name.as_str()) {
                continue;
            }
            let found = if name.contains('/') {
                Some(PathBuf::from(&name))
            } else {
                dirs.iter()
                    .map(|d| Path::new(d).join(&name))
                    .find(|p| resolve_in(sysroot, p).is_ok_and(|h| h.is_file()))
            };
            let Some(lib) = found else {
                return Err(BuildError::MissingLibrary {
                    name,
                    by,
                    sysroot: sysroot.to_path_buf(),
                    searched: dirs.join(", "),
                });
            };
            if out.contains(&lib) {
                continue;
            }
            let d = headers(&lib)?;
            if d.machine != program.machine {
                return Err(BuildError::Machine {
                    path: lib,
                    found: d.machine,
                    by: bin.to_path_buf(),
                    expected: program.machine,
                });
            }
            out.insert(lib.clone());
            queue.push((lib, d.needed));
        }
    }
    Ok(out.into_iter().collect())
}

/// Builds the archive (uncompressed) and the report's sizes.
pub fn build_archive(inputs: &Inputs) -> Result<(Archive, Report), BuildError> {
    let mut a = Archive::new();
    let mut rows: BTreeMap<String, SizeRow> = BTreeMap::new();
    for d in [
        "proc", "sys", "dev", "run", "tmp", "etc", "root", "mnt", "bin", "sbin",
    ] {
        a.dir(d, 0o755)?;
    }
    a.dir("tmp", 0o1777)?;
    a.char_device("dev/console", 0o600, 5, 1)?;
    a.char_device("dev/null", 0o666, 1, 3)?;
    a.char_device("dev/kmsg", 0o644, 1, 11)?;

    let agent = read(&inputs.agent)?;
    add_row(&mut rows, "agent", agent.len());
    a.file("init", 0o755, agent)?;

    if let Some(bb) = &inputs.busybox {
        let data = read(bb)?;
        add_row(&mut rows, "busybox", data.len());
        a.file("bin/busybox", 0o755, data)?;
        for applet in BUSYBOX_APPLETS {
            a.symlink(&format!("bin/{applet}"), "busybox")?;
        }
    }

    // Host paths are read as they are; sysroot paths inside the sysroot.
    let host_file = |p: &Path| -> Result<PathBuf, BuildError> {
        match &inputs.sysroot {
            None => Ok(p.to_path_buf()),
            Some(root) => resolve_in(root, p).map_err(|source| BuildError::Read {
                path: root.join(archive_path(p)),
                source,
            }),
        }
    };
    let mut libs: BTreeSet<PathBuf> = BTreeSet::new();
    for b in &inputs.binaries {
        let data = read(&host_file(b)?)?;
        add_row(&mut rows, "binaries", data.len());
        a.file(&archive_path(b), 0o755, data)?;
        match &inputs.sysroot {
            None => libs.extend(shared_libraries(b)?),
            Some(root) => libs.extend(sysroot_libraries(root, b)?),
        }
    }
    for l in &libs {
        let data = read(&host_file(l)?)?;
        add_row(&mut rows, "binaries/libs", data.len());
        a.file(&archive_path(l), 0o755, data)?;
    }

    let mut report = Report {
        kernel_release: None,
        modules: Vec::new(),
        missing: Vec::new(),
        sizes: Vec::new(),
        cpio_bytes: 0,
        output_bytes: 0,
        compression: inputs.compression,
        sha256: String::new(),
    };
    let mut firmware: BTreeSet<String> = inputs.firmware.iter().cloned().collect();
    if let Some(dir) = &inputs.modules_dir {
        let release = kernel_release(dir, inputs.kernel_release.as_deref())?;
        let index = ModuleIndex::load(dir)?;
        let (mods, missing) = resolve_modules(&index, &inputs.selection)?;
        let base = format!("lib/modules/{release}");
        let packed: BTreeSet<&str> = mods.iter().map(|(m, _)| m.as_str()).collect();
        let mut dep = String::new();
        for (m, cat) in &mods {
            let Some(rel) = index.path_of(m) else {
                continue;
            };
            let data = read(&dir.join(rel))?;
            if inputs.firmware_dir.is_some() {
                firmware.extend(module_firmware(&data));
            }
            add_row(&mut rows, cat, data.len());
            a.file(&format!("{base}/{rel}"), 0o644, data)?;
        }
        // Index files restricted to what is packed, in the tree's own order.
        let mut all: Vec<(&str, &str)> = index.modules().collect();
        all.sort_by(|x, y| x.1.cmp(y.1));
        for (m, rel) in all {
            if !packed.contains(m) {
                continue;
            }
            let deps: Vec<String> = index
                .deps_of(m)
                .iter()
                .filter_map(|d| index.path_of(d).map(str::to_string))
                .collect();
            let _ = writeln!(dep, "{rel}: {}", deps.join(" "));
        }
        let dep = dep.replace(": \n", ":\n");
        let mut alias = String::new();
        for (pat, m) in index.aliases() {
            if packed.contains(m.as_str()) {
                let _ = writeln!(alias, "alias {pat} {m}");
            }
        }
        let mut softdep = String::new();
        for m in &packed {
            let pre = index.softdeps_of(m);
            if !pre.is_empty() {
                let _ = writeln!(softdep, "softdep {m} pre: {}", pre.join(" "));
            }
        }
        let builtin = fs::read(dir.join("modules.builtin")).unwrap_or_default();
        let mut meta = 0usize;
        for (name, data) in [
            ("modules.dep", dep.into_bytes()),
            ("modules.alias", alias.into_bytes()),
            ("modules.softdep", softdep.into_bytes()),
            ("modules.builtin", builtin),
        ] {
            meta += data.len();
            a.file(&format!("{base}/{name}"), 0o644, data)?;
        }
        let mut load = String::from("# loaded after coldplug, in order\n");
        for (m, cat) in &mods {
            if cat == "modules/fs" {
                let _ = writeln!(load, "{m}");
            }
        }
        meta += load.len();
        a.file("etc/anneal/modules.load", 0o644, load.into_bytes())?;
        rows.insert(
            "module index".into(),
            SizeRow {
                category: "module index".into(),
                files: 5,
                bytes: meta as u64,
            },
        );
        report.kernel_release = Some(release);
        report.modules = mods.into_iter().map(|(m, _)| m).collect();
        report.missing = missing;
    }
    if let Some(fw_dir) = &inputs.firmware_dir {
        for f in &firmware {
            let path = fw_dir.join(f);
            if !path.is_file() {
                continue; // declared but not shipped: drivers run without it
            }
            let data = read(&path)?;
            add_row(&mut rows, "firmware", data.len());
            a.file(&format!("lib/firmware/{f}"), 0o644, data)?;
        }
    }
    report.sizes = rows.into_values().collect();
    Ok((a, report))
}

/// Builds, compresses and writes the initramfs; returns the report.
pub fn build(inputs: &Inputs) -> Result<(Vec<u8>, Report), BuildError> {
    let (archive, mut report) = build_archive(inputs)?;
    let cpio = archive.to_bytes();
    report.cpio_bytes = cpio.len() as u64;
    let out = compress(&cpio, inputs.compression, inputs.level)?;
    report.output_bytes = out.len() as u64;
    report.sha256 = hex::encode(Sha256::digest(&out));
    Ok((out, report))
}

/// Compresses deterministically (single-threaded zstd; gzip with mtime 0).
pub fn compress(data: &[u8], c: Compression, level: i32) -> Result<Vec<u8>, BuildError> {
    match c {
        Compression::None => Ok(data.to_vec()),
        Compression::Zstd => {
            let mut enc = zstd::stream::Encoder::new(Vec::new(), level.clamp(1, 19))
                .map_err(|e| BuildError::Compress("zstd", e))?;
            enc.include_checksum(true)
                .map_err(|e| BuildError::Compress("zstd", e))?;
            enc.set_pledged_src_size(Some(data.len() as u64))
                .map_err(|e| BuildError::Compress("zstd", e))?;
            enc.write_all(data)
                .map_err(|e| BuildError::Compress("zstd", e))?;
            enc.finish().map_err(|e| BuildError::Compress("zstd", e))
        }
        Compression::Gzip => {
            let lvl = u32::try_from(level.clamp(1, 9)).unwrap_or(9);
            let mut enc = flate2::GzBuilder::new()
                .mtime(0)
                .operating_system(3)
                .write(Vec::new(), flate2::Compression::new(lvl));
            enc.write_all(data)
                .map_err(|e| BuildError::Compress("gzip", e))?;
            enc.finish().map_err(|e| BuildError::Compress("gzip", e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index() -> ModuleIndex {
        ModuleIndex::parse(
            "kernel/drivers/nvme/host/nvme.ko: kernel/drivers/nvme/host/nvme-core.ko\n\
             kernel/drivers/nvme/host/nvme-core.ko:\n\
             kernel/fs/ext4/ext4.ko: kernel/fs/jbd2/jbd2.ko\n\
             kernel/fs/jbd2/jbd2.ko:\n\
             kernel/crypto/crc32c_generic.ko:\n\
             kernel/fs/efivarfs/efivarfs.ko:\n",
            "alias crypto-crc32c crc32c_generic\n",
            "softdep ext4 pre: crypto-crc32c\n",
            "kernel/fs/vfat.ko\n",
        )
    }

    #[test]
    fn selection_resolves_deps_and_reports_missing() {
        let sel = Selection {
            classes: vec![Class::Nvme, Class::Fs],
            names: vec![],
            exclude: vec![],
        };
        let (mods, missing) = resolve_modules(&index(), &sel).unwrap();
        let names: Vec<&str> = mods.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(
            names,
            [
                "nvme_core",
                "nvme",
                "efivarfs",
                "crc32c_generic",
                "jbd2",
                "ext4"
            ]
        );
        assert_eq!(mods[0].1, "modules/deps");
        assert_eq!(mods[1].1, "modules/nvme");
        assert!(missing.contains(&"nls_cp437".to_string()));
        assert!(
            !missing.contains(&"vfat".to_string()),
            "builtin is not missing"
        );
        let bad = Selection {
            names: vec!["no_such_driver".into()],
            ..Selection::default()
        };
        assert!(matches!(
            resolve_modules(&index(), &bad),
            Err(BuildError::UnknownModule(_))
        ));
    }

    #[test]
    fn firmware_names_from_modinfo() {
        let ko = b"\0license=GPL\0firmware=intel/ice/ddp/ice.pkg\0firmware=../../etc/shadow\0firmware=rtl_nic/rtl8168h-2.fw\0";
        assert_eq!(
            module_firmware(ko),
            ["intel/ice/ddp/ice.pkg", "rtl_nic/rtl8168h-2.fw"]
        );
    }

    fn tree() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let m = d.path().join("lib/modules/6.1.0-test");
        for (rel, body) in [
            (
                "kernel/drivers/nvme/host/nvme.ko",
                &b"\0firmware=acme/nvme.bin\0x"[..],
            ),
            ("kernel/drivers/nvme/host/nvme-core.ko", b"core"),
            ("kernel/fs/efivarfs/efivarfs.ko", b"efi"),
            ("kernel/drivers/net/unused.ko", b"unused"),
        ] {
            std::fs::create_dir_all(m.join(rel).parent().unwrap()).unwrap();
            std::fs::write(m.join(rel), body).unwrap();
        }
        std::fs::write(
            m.join("modules.dep"),
            "kernel/drivers/nvme/host/nvme.ko: kernel/drivers/nvme/host/nvme-core.ko\n\
             kernel/drivers/nvme/host/nvme-core.ko:\n\
             kernel/fs/efivarfs/efivarfs.ko:\n\
             kernel/drivers/net/unused.ko:\n",
        )
        .unwrap();
        std::fs::write(
            m.join("modules.alias"),
            "alias pci:v*d*sv*sd*bc01sc08i02* nvme\nalias pci:v1234* unused\n",
        )
        .unwrap();
        std::fs::create_dir_all(d.path().join("fw/acme")).unwrap();
        std::fs::write(d.path().join("fw/acme/nvme.bin"), b"blob").unwrap();
        std::fs::write(d.path().join("agent"), b"\x7fELF agent").unwrap();
        d
    }

    fn inputs(d: &Path, c: Compression) -> Inputs {
        Inputs {
            agent: d.join("agent"),
            modules_dir: Some(d.join("lib/modules/6.1.0-test")),
            kernel_release: None,
            selection: Selection {
                classes: vec![Class::Nvme, Class::Fs],
                ..Selection::default()
            },
            firmware_dir: Some(d.join("fw")),
            firmware: vec![],
            busybox: None,
            binaries: vec![],
            sysroot: None,
            compression: c,
            level: 3,
        }
    }

    #[test]
    fn ldd_output_is_parsed() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd0b5f5000)\n\
                   \tlibext2fs.so.2 => /lib/x86_64-linux-gnu/libext2fs.so.2 (0x00007f1)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f3)\n";
        assert_eq!(
            parse_ldd(out).unwrap(),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libext2fs.so.2"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
        let e = parse_ldd("\tlibfoo.so.1 => not found\n").unwrap_err();
        assert!(e.contains("libfoo.so.1"), "{e}");
        assert!(parse_ldd("\tstatically linked\n").unwrap().is_empty());
    }

    #[test]
    fn extra_binaries_come_with_their_libraries() {
        let d = tree();
        let mut i = inputs(d.path(), Compression::None);
        let resize2fs = PathBuf::from("/usr/sbin/resize2fs");
        i.binaries = vec![resize2fs.clone()];
        let (a, _) = build_archive(&i).unwrap();
        let listing = String::from_utf8_lossy(&a.to_bytes()).into_owned();
        assert!(listing.contains("usr/sbin/resize2fs"));
        let libs = shared_libraries(&resize2fs).unwrap();
        assert!(
            libs.iter()
                .any(|l| l.to_string_lossy().contains("libext2fs")),
            "{libs:?}"
        );
        for l in &libs {
            assert!(
                listing.contains(&archive_path(l)),
                "{} not packed",
                l.display()
            );
        }
        // The packed program runs from the unpacked archive alone.
        let root = tempfile::tempdir().unwrap();
        let cpio = root.path().join("a.cpio");
        std::fs::write(&cpio, a.to_bytes()).unwrap();
        let tree = root.path().join("tree");
        std::fs::create_dir(&tree).unwrap();
        let st = std::process::Command::new("cpio")
            .args(["-id", "--quiet", "-F"])
            .arg(&cpio)
            .current_dir(&tree)
            .status()
            .unwrap();
        assert!(st.success());
        let out = std::process::Command::new("chroot")
            .arg(&tree)
            .arg("/usr/sbin/resize2fs")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("resize2fs 1."), "{err}");
        assert!(
            !err.contains("error while loading shared libraries"),
            "{err}"
        );
    }

    #[test]
    fn sysroot_resolution_agrees_with_ldd_on_the_host() {
        // The host's own root as the sysroot: the ELF walk must find what
        // ldd (the dynamic loader itself) lists.
        for bin in ["/usr/sbin/resize2fs", "/usr/sbin/e2fsck"] {
            let mut by_ldd = shared_libraries(Path::new(bin)).unwrap();
            by_ldd.sort();
            let by_elf = sysroot_libraries(Path::new("/"), Path::new(bin)).unwrap();
            assert_eq!(by_elf, by_ldd, "{bin}");
        }
    }

    #[test]
    fn sysroot_links_stay_inside_the_root() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::fs::create_dir_all(root.join("lib/real")).unwrap();
        std::fs::write(root.join("lib/real/ld.so"), b"inside").unwrap();
        // An absolute link restarts at the root, not at the host's /.
        std::os::unix::fs::symlink("/lib/real/ld.so", root.join("lib/ld.so")).unwrap();
        // `..` stops at the root.
        std::os::unix::fs::symlink("../../../../lib/real", root.join("lib/up")).unwrap();
        // A merged-/usr style directory link.
        std::fs::create_dir_all(root.join("usr")).unwrap();
        std::os::unix::fs::symlink("../lib", root.join("usr/lib")).unwrap();
        for p in [
            "/lib/ld.so",
            "/lib/up/ld.so",
            "/usr/lib/ld.so",
            "/usr/lib/up/ld.so",
        ] {
            let h = resolve_in(root, Path::new(p)).unwrap();
            assert_eq!(h, root.join("lib/real/ld.so"), "{p}");
        }
        std::os::unix::fs::symlink("loop", root.join("loop")).unwrap();
        assert!(resolve_in(root, Path::new("/loop")).is_err());
        assert!(resolve_in(root, Path::new("/lib/none")).is_err());
    }

    #[test]
    fn sysroot_build_packs_the_closure_and_names_what_is_missing() {
        // A foreign-looking root made of the host's e2fsck closure, placed
        // at the paths the target sees: the build reads it there, packs it
        // and the program starts from the unpacked archive alone.
        let d = tree();
        let root = tempfile::tempdir().unwrap();
        let bin = PathBuf::from("/usr/sbin/e2fsck");
        let mut files = shared_libraries(&bin).unwrap();
        files.push(bin.clone());
        for f in &files {
            let dst = root.path().join(archive_path(f));
            std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
            std::fs::copy(f, &dst).unwrap();
        }
        let mut i = inputs(d.path(), Compression::None);
        i.binaries = vec![bin.clone()];
        i.sysroot = Some(root.path().to_path_buf());
        let (a, report) = build_archive(&i).unwrap();
        assert!(report.sizes.iter().any(|r| r.category == "binaries/libs"));
        let tmp = tempfile::tempdir().unwrap();
        let cpio = tmp.path().join("a.cpio");
        std::fs::write(&cpio, a.to_bytes()).unwrap();
        let unpacked = tmp.path().join("tree");
        std::fs::create_dir(&unpacked).unwrap();
        let st = std::process::Command::new("cpio")
            .args(["-id", "--quiet", "-F"])
            .arg(&cpio)
            .current_dir(&unpacked)
            .status()
            .unwrap();
        assert!(st.success());
        let out = std::process::Command::new("chroot")
            .arg(&unpacked)
            .arg(&bin)
            .arg("-V")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("e2fsck 1."), "{err}");
        // Without libext2fs the build fails naming it and who needs it.
        let gone = files
            .iter()
            .find(|f| f.to_string_lossy().contains("libext2fs"))
            .unwrap();
        std::fs::remove_file(root.path().join(archive_path(gone))).unwrap();
        let e = build_archive(&i).unwrap_err();
        assert!(matches!(e, BuildError::MissingLibrary { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("libext2fs.so.2") && msg.contains("e2fsck"),
            "{msg}"
        );
    }

    #[test]
    fn build_packs_selection_index_and_firmware_reproducibly() {
        let d = tree();
        let (a, report) = build(&inputs(d.path(), Compression::Zstd)).unwrap();
        let (b, _) = build(&inputs(d.path(), Compression::Zstd)).unwrap();
        assert_eq!(a, b, "same inputs, same bytes");
        assert_eq!(report.kernel_release.as_deref(), Some("6.1.0-test"));
        assert_eq!(report.modules, ["nvme_core", "nvme", "efivarfs"]);
        assert_eq!(report.sha256, hex::encode(Sha256::digest(&a)));
        let cats: Vec<&str> = report.sizes.iter().map(|r| r.category.as_str()).collect();
        assert_eq!(
            cats,
            [
                "agent",
                "firmware",
                "module index",
                "modules/deps",
                "modules/fs",
                "modules/nvme"
            ]
        );
        assert!(report.table().contains("output (zstd)"));
        let cpio = zstd::stream::decode_all(a.as_slice()).unwrap();
        let text = String::from_utf8_lossy(&cpio);
        for want in [
            "lib/modules/6.1.0-test/kernel/drivers/nvme/host/nvme.ko",
            "lib/firmware/acme/nvme.bin",
            "etc/anneal/modules.load",
            "dev/console",
        ] {
            assert!(text.contains(want), "{want} missing");
        }
        assert!(!text.contains("unused.ko"), "unselected module packed");
        // The packed index only knows packed modules.
        assert!(text.contains("alias pci:v*d*sv*sd*bc01sc08i02* nvme"));
        assert!(!text.contains("alias pci:v1234* unused"));
        // gzip works too and is also deterministic.
        let (g1, _) = build(&inputs(d.path(), Compression::Gzip)).unwrap();
        let (g2, _) = build(&inputs(d.path(), Compression::Gzip)).unwrap();
        assert_eq!(g1, g2);
        assert_eq!(&g1[..2], &[0x1f, 0x8b]);
    }

    #[test]
    fn compression_is_deterministic() {
        let data: Vec<u8> = (0..100_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        for c in [Compression::Zstd, Compression::Gzip] {
            let a = compress(&data, c, 3).unwrap();
            let b = compress(&data, c, 3).unwrap();
            assert_eq!(a, b);
            assert!(a.len() < data.len());
        }
        let z = compress(&data, Compression::Zstd, 3).unwrap();
        assert_eq!(zstd::stream::decode_all(z.as_slice()).unwrap(), data);
    }
}
