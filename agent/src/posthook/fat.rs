//! `install-removable-fallback`: copies the OS loader found under
//! `\EFI\<vendor>\` on the ESP to the removable-media path
//! `\EFI\BOOT\BOOTX64.EFI` (`BOOTAA64.EFI` on aarch64), through the `fatfs`
//! crate over a byte window of the target.

use super::Context;
use anneal_image::layout::{Role, Slot};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt as _;
use std::path::PathBuf;

/// Errors of `install-removable-fallback`.
#[derive(Debug, thiserror::Error)]
pub enum FallbackError {
    /// The layout has no ESP slot.
    #[error("the layout of {disk} has no esp slot (an Image that boots needs one)")]
    NoEsp {
        /// target
        disk: PathBuf,
    },
    /// The machine's architecture has no removable-media path here.
    #[error("architecture {0:?} has no removable-media loader name (x86_64 or aarch64)")]
    Architecture(String),
    /// The target could not be opened.
    #[error("cannot open {disk}")]
    Open {
        /// target
        disk: PathBuf,
        /// cause
        #[source]
        source: io::Error,
    },
    /// The ESP is not a FAT file system fatfs can read.
    #[error("esp (slot {slot}) on {disk} is not a readable FAT file system")]
    Fat {
        /// slot
        slot: u32,
        /// target
        disk: PathBuf,
        /// cause
        #[source]
        source: io::Error,
    },
    /// No loader found.
    #[error(
        "no OS loader on the esp: looked for {looked}; found {found}; set the hook param `loader` to its path (e.g. \\EFI\\debian\\grubx64.efi)"
    )]
    NoLoader {
        /// what was looked for
        looked: String,
        /// what was there
        found: String,
    },
    /// Several vendor directories carry the same preferred loader.
    #[error("several OS loaders on the esp: {0}; set the hook param `loader` to the one to boot")]
    Ambiguous(String),
    /// Reading or writing a file on the ESP failed.
    #[error("cannot copy {from} to {to} on the esp")]
    Copy {
        /// source path
        from: String,
        /// destination path
        to: String,
        /// cause
        #[source]
        source: io::Error,
    },
}

/// A byte range of a file as a `Read + Write + Seek` stream (the ESP inside
/// the disk). Positioned I/O: the file's own offset is never used.
#[derive(Debug)]
pub struct Window<'a> {
    file: &'a File,
    start: u64,
    len: u64,
    pos: u64,
}

impl<'a> Window<'a> {
    /// `len` bytes of `file` from `start`.
    pub fn new(file: &'a File, start: u64, len: u64) -> Self {
        Window {
            file,
            start,
            len,
            pos: 0,
        }
    }
    fn room(&self, want: usize) -> usize {
        let left = self.len.saturating_sub(self.pos);
        usize::try_from(left).unwrap_or(usize::MAX).min(want)
    }
}

impl Read for Window<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.room(buf.len());
        if n == 0 {
            return Ok(0);
        }
        let got = self.file.read_at(&mut buf[..n], self.start + self.pos)?;
        self.pos += got as u64;
        Ok(got)
    }
}

impl Write for Window<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.room(buf.len());
        if n == 0 && !buf.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "write past the end of the partition",
            ));
        }
        let put = self.file.write_at(&buf[..n], self.start + self.pos)?;
        self.pos += put as u64;
        Ok(put)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Seek for Window<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let base = match to {
            SeekFrom::Start(o) => Some(o),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        match base {
            Some(p) => {
                self.pos = p;
                Ok(p)
            }
            None => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "seek before the start of the partition",
            )),
        }
    }
}

/// Loader names for an architecture: (suffix, removable-media file name).
pub fn arch_names(arch: &str) -> Option<(&'static str, &'static str)> {
    match arch {
        "x86_64" | "amd64" => Some(("x64", "BOOTX64.EFI")),
        "aarch64" | "arm64" => Some(("aa64", "BOOTAA64.EFI")),
        _ => None,
    }
}

/// The ESP slot of a layout (the first with role esp).
pub fn esp_slot(slots: &[Slot]) -> Option<&Slot> {
    slots.iter().find(|s| s.role == Role::Esp)
}

/// Files found directly under each `EFI/<vendor>/` (vendor `BOOT` excluded):
/// `(vendor, file name)` with the names as stored.
pub type Listing = Vec<(String, String)>;

/// Picks the loader to copy: the explicit `loader` (a path on the ESP),
/// else `shim<arch>.efi`, `grub<arch>.efi`, `systemd-boot<arch>.efi` in that
/// order (one vendor directory must carry it), else the only `.efi` file under
/// one vendor directory. Returns the path without a leading separator, with
/// `/` separators (`EFI/debian/shimx64.efi`).
pub fn choose_loader(
    listing: &Listing,
    suffix: &str,
    explicit: Option<&str>,
) -> Result<String, FallbackError> {
    if let Some(p) = explicit {
        return Ok(normalize(p));
    }
    let prefs = [
        format!("shim{suffix}.efi"),
        format!("grub{suffix}.efi"),
        format!("systemd-boot{suffix}.efi"),
    ];
    for want in &prefs {
        let hits: Vec<_> = listing
            .iter()
            .filter(|(_, f)| f.eq_ignore_ascii_case(want))
            .collect();
        match hits.as_slice() {
            [] => {}
            [(v, f)] => return Ok(format!("EFI/{v}/{f}")),
            many => {
                return Err(FallbackError::Ambiguous(
                    many.iter()
                        .map(|(v, f)| format!("\\EFI\\{v}\\{f}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                ));
            }
        }
    }
    let efis: Vec<_> = listing
        .iter()
        .filter(|(_, f)| f.to_ascii_lowercase().ends_with(".efi"))
        .collect();
    if let [(v, f)] = efis.as_slice() {
        return Ok(format!("EFI/{v}/{f}"));
    }
    let found = if efis.is_empty() {
        "no .efi file under \\EFI\\<vendor>\\".to_string()
    } else {
        efis.iter()
            .map(|(v, f)| format!("\\EFI\\{v}\\{f}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Err(FallbackError::NoLoader {
        looked: format!(
            "\\EFI\\<vendor>\\{} then the only .efi file under one vendor directory (\\EFI\\BOOT excluded)",
            prefs.join(", ")
        ),
        found,
    })
}

fn normalize(p: &str) -> String {
    p.replace('\\', "/").trim_start_matches('/').to_string()
}

type Fs<'a> = fatfs::FileSystem<Window<'a>>;

fn list_vendors(fs: &Fs<'_>) -> io::Result<Listing> {
    let mut out = Vec::new();
    let efi = match fs.root_dir().open_dir("EFI") {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for v in efi.iter() {
        let v = v?;
        let vn = v.file_name();
        if !v.is_dir() || vn == "." || vn == ".." || vn.eq_ignore_ascii_case("BOOT") {
            continue;
        }
        for f in v.to_dir().iter() {
            let f = f?;
            if f.is_file() {
                out.push((vn.clone(), f.file_name()));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn copy(fs: &Fs<'_>, from: &str, to: &str) -> io::Result<u64> {
    let mut src = fs.root_dir().open_file(from)?;
    let mut dst = fs.root_dir().create_file(to)?;
    dst.truncate()?;
    let n = io::copy(&mut src, &mut dst)?;
    dst.flush()?;
    Ok(n)
}

/// Copies the loader (and shim's siblings) to `\EFI\BOOT\`.
pub fn run(
    ctx: &Context,
    params: &BTreeMap<String, String>,
    log: &mut dyn FnMut(&str),
) -> Result<(), FallbackError> {
    let (suffix, boot_name) = arch_names(&ctx.architecture)
        .ok_or_else(|| FallbackError::Architecture(ctx.architecture.clone()))?;
    let esp = esp_slot(&ctx.layout.slots).ok_or_else(|| FallbackError::NoEsp {
        disk: ctx.os_disk.clone(),
    })?;
    let disk = super::open_rw(&ctx.os_disk).map_err(|source| FallbackError::Open {
        disk: ctx.os_disk.clone(),
        source,
    })?;
    let fat_err = |source| FallbackError::Fat {
        slot: esp.number,
        disk: ctx.os_disk.clone(),
        source,
    };
    let window = Window::new(&disk, esp.start_bytes, esp.size_bytes);
    let fs = fatfs::FileSystem::new(window, fatfs::FsOptions::new().update_accessed_date(false))
        .map_err(fat_err)?;
    let listing = list_vendors(&fs).map_err(fat_err)?;
    let loader = choose_loader(
        &listing,
        suffix,
        params
            .get("loader")
            .map(String::as_str)
            .filter(|s| !s.is_empty()),
    )?;
    let target = format!("EFI/BOOT/{boot_name}");
    if loader.eq_ignore_ascii_case(&target) {
        log(&format!(
            "install-removable-fallback: the loader already is \\EFI\\BOOT\\{boot_name}"
        ));
        return Ok(());
    }
    let copy_err = |from: &str, to: &str, source| FallbackError::Copy {
        from: format!("\\{}", from.replace('/', "\\")),
        to: format!("\\{}", to.replace('/', "\\")),
        source,
    };
    fs.root_dir()
        .create_dir("EFI")
        .and_then(|_| fs.root_dir().create_dir("EFI/BOOT"))
        .map_err(|e| copy_err(&loader, "EFI/BOOT", e))?;
    let n = copy(&fs, &loader, &target).map_err(|e| copy_err(&loader, &target, e))?;
    log(&format!(
        "install-removable-fallback: \\{} -> \\EFI\\BOOT\\{boot_name} ({n} bytes)",
        loader.replace('/', "\\")
    ));
    // Shim as the removable loader starts grub<arch>.efi (and MokManager) from
    // its own directory: bring them along.
    let (dir, file) = loader.rsplit_once('/').unwrap_or(("", loader.as_str()));
    if file.eq_ignore_ascii_case(&format!("shim{suffix}.efi")) {
        for sib in [format!("grub{suffix}.efi"), format!("mm{suffix}.efi")] {
            let from = format!("{dir}/{sib}");
            let present = listing.iter().any(|(v, f)| {
                format!("EFI/{v}").eq_ignore_ascii_case(dir) && f.eq_ignore_ascii_case(&sib)
            });
            if !present {
                continue;
            }
            let to = format!("EFI/BOOT/{sib}");
            let n = copy(&fs, &from, &to).map_err(|e| copy_err(&from, &to, e))?;
            log(&format!(
                "install-removable-fallback: \\{} -> \\EFI\\BOOT\\{sib} ({n} bytes)",
                from.replace('/', "\\")
            ));
        }
    }
    fs.unmount().map_err(fat_err)?;
    disk.sync_all().map_err(fat_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(v: &[(&str, &str)]) -> Listing {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn loader_preference_order() {
        let x = l(&[
            ("debian", "grubx64.efi"),
            ("debian", "mmx64.efi"),
            ("debian", "shimx64.efi"),
        ]);
        assert_eq!(
            choose_loader(&x, "x64", None).unwrap(),
            "EFI/debian/shimx64.efi"
        );
        let x = l(&[("debian", "grubx64.efi"), ("debian", "fbx64.efi")]);
        assert_eq!(
            choose_loader(&x, "x64", None).unwrap(),
            "EFI/debian/grubx64.efi"
        );
        let x = l(&[("Linux", "linux-6.1.efi")]);
        assert_eq!(
            choose_loader(&x, "x64", None).unwrap(),
            "EFI/Linux/linux-6.1.efi"
        );
        let x = l(&[("debian", "GRUBAA64.EFI")]);
        assert_eq!(
            choose_loader(&x, "aa64", None).unwrap(),
            "EFI/debian/GRUBAA64.EFI"
        );
        assert_eq!(
            choose_loader(&x, "x64", Some("\\EFI\\debian\\grubx64.efi")).unwrap(),
            "EFI/debian/grubx64.efi"
        );
    }

    #[test]
    fn no_or_ambiguous_loader_is_a_clear_error() {
        let e = choose_loader(&l(&[]), "x64", None).unwrap_err().to_string();
        assert!(e.contains("shimx64.efi") && e.contains("`loader`"), "{e}");
        let x = l(&[("a", "one.efi"), ("b", "two.efi")]);
        let e = choose_loader(&x, "x64", None).unwrap_err().to_string();
        assert!(
            e.contains("\\EFI\\a\\one.efi") && e.contains("\\EFI\\b\\two.efi"),
            "{e}"
        );
        let x = l(&[("debian", "shimx64.efi"), ("ubuntu", "shimx64.efi")]);
        assert!(matches!(
            choose_loader(&x, "x64", None),
            Err(FallbackError::Ambiguous(_))
        ));
    }

    #[test]
    fn window_bounds() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(100).unwrap();
        let mut w = Window::new(&f, 10, 20);
        w.write_all(&[1u8; 20]).unwrap();
        assert!(w.write_all(&[1]).is_err());
        w.seek(SeekFrom::Start(0)).unwrap();
        let mut b = Vec::new();
        w.read_to_end(&mut b).unwrap();
        assert_eq!(b, vec![1u8; 20]);
        let mut all = vec![0u8; 100];
        f.read_exact_at(&mut all, 0).unwrap();
        assert_eq!(&all[..10], &[0u8; 10]);
        assert_eq!(&all[30..], &[0u8; 70][..]);
    }
}
