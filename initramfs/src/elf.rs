//! The few ELF facts the builder needs about an extra program or library
//! taken from a foreign root (`--sysroot`): its machine, its interpreter
//! (`PT_INTERP`) and the libraries it names (`DT_NEEDED`). A pure parser
//! over the file's bytes; 32- and 64-bit, either byte order. Offsets in the
//! file are checked, never trusted.

/// Why a file's headers could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElfError {
    /// No ELF magic, or an unknown class or byte order.
    #[error("not an ELF file")]
    NotElf,
    /// A header, table or string lies (partly) outside the file.
    #[error("malformed ELF: {0} out of bounds")]
    Bounds(&'static str),
    /// `DT_NEEDED` names without a `DT_STRTAB` inside a loaded segment.
    #[error("malformed ELF: no string table for the dynamic section")]
    NoStrtab,
}

/// `e_machine` of AArch64.
pub const EM_AARCH64: u16 = 183;
/// `e_machine` of x86-64.
pub const EM_X86_64: u16 = 62;

/// What a program or library needs to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dynamic {
    /// `e_machine` (`EM_AARCH64`, `EM_X86_64`, …).
    pub machine: u16,
    /// The program interpreter (`/lib/ld-linux-aarch64.so.1`); none for a
    /// static program or a library.
    pub interpreter: Option<String>,
    /// `DT_NEEDED` names, in the file's order.
    pub needed: Vec<String>,
}

/// The Debian multiarch triplet of a machine (`lib/<triplet>` holds its
/// libraries in a Debian root), when it is one we know.
pub fn multiarch_triplet(machine: u16) -> Option<&'static str> {
    match machine {
        EM_AARCH64 => Some("aarch64-linux-gnu"),
        EM_X86_64 => Some("x86_64-linux-gnu"),
        _ => None,
    }
}

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const PT_INTERP: u32 = 3;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;
const DT_STRTAB: u64 = 5;

struct Reader<'a> {
    data: &'a [u8],
    big: bool,
    wide: bool,
}

impl Reader<'_> {
    fn bytes<const N: usize>(&self, at: u64, what: &'static str) -> Result<[u8; N], ElfError> {
        let start = usize::try_from(at).map_err(|_| ElfError::Bounds(what))?;
        let end = start.checked_add(N).ok_or(ElfError::Bounds(what))?;
        let mut out = [0u8; N];
        out.copy_from_slice(self.data.get(start..end).ok_or(ElfError::Bounds(what))?);
        Ok(out)
    }

    fn u16(&self, at: u64, what: &'static str) -> Result<u16, ElfError> {
        let b = self.bytes::<2>(at, what)?;
        Ok(if self.big {
            u16::from_be_bytes(b)
        } else {
            u16::from_le_bytes(b)
        })
    }

    fn u32(&self, at: u64, what: &'static str) -> Result<u32, ElfError> {
        let b = self.bytes::<4>(at, what)?;
        Ok(if self.big {
            u32::from_be_bytes(b)
        } else {
            u32::from_le_bytes(b)
        })
    }

    fn u64(&self, at: u64, what: &'static str) -> Result<u64, ElfError> {
        let b = self.bytes::<8>(at, what)?;
        Ok(if self.big {
            u64::from_be_bytes(b)
        } else {
            u64::from_le_bytes(b)
        })
    }

    /// An address-sized word (`ElfN_Addr`, `ElfN_Off`, `ElfN_Xword`).
    fn word(&self, at: u64, what: &'static str) -> Result<u64, ElfError> {
        if self.wide {
            self.u64(at, what)
        } else {
            self.u32(at, what).map(u64::from)
        }
    }

    /// A NUL-terminated string starting at `at`, ending before `limit`.
    fn cstr(&self, at: u64, limit: u64, what: &'static str) -> Result<String, ElfError> {
        let start = usize::try_from(at).map_err(|_| ElfError::Bounds(what))?;
        let end = usize::try_from(limit)
            .unwrap_or(usize::MAX)
            .min(self.data.len());
        let s = self.data.get(start..end).ok_or(ElfError::Bounds(what))?;
        let len = s
            .iter()
            .position(|&b| b == 0)
            .ok_or(ElfError::Bounds(what))?;
        Ok(String::from_utf8_lossy(&s[..len]).into_owned())
    }
}

struct Segment {
    kind: u32,
    offset: u64,
    vaddr: u64,
    filesz: u64,
}

/// Reads the machine, interpreter and needed libraries of an ELF file.
pub fn parse(data: &[u8]) -> Result<Dynamic, ElfError> {
    if data.get(..4) != Some(b"\x7fELF") {
        return Err(ElfError::NotElf);
    }
    let wide = match data.get(4) {
        Some(1) => false,
        Some(2) => true,
        _ => return Err(ElfError::NotElf),
    };
    let big = match data.get(5) {
        Some(1) => false,
        Some(2) => true,
        _ => return Err(ElfError::NotElf),
    };
    let r = Reader { data, big, wide };
    let machine = r.u16(18, "ELF header")?;
    let (phoff, phentsize, phnum) = if wide {
        (
            r.u64(32, "ELF header")?,
            r.u16(54, "ELF header")?,
            r.u16(56, "ELF header")?,
        )
    } else {
        (
            u64::from(r.u32(28, "ELF header")?),
            r.u16(42, "ELF header")?,
            r.u16(44, "ELF header")?,
        )
    };
    let mut segments = Vec::with_capacity(usize::from(phnum));
    for i in 0..u64::from(phnum) {
        let at = i
            .checked_mul(u64::from(phentsize))
            .and_then(|o| o.checked_add(phoff))
            .ok_or(ElfError::Bounds("program header"))?;
        let what = "program header";
        let kind = r.u32(at, what)?;
        let (offset, vaddr, filesz) = if wide {
            (
                r.u64(at + 8, what)?,
                r.u64(at + 16, what)?,
                r.u64(at + 32, what)?,
            )
        } else {
            (
                u64::from(r.u32(at + 4, what)?),
                u64::from(r.u32(at + 8, what)?),
                u64::from(r.u32(at + 16, what)?),
            )
        };
        segments.push(Segment {
            kind,
            offset,
            vaddr,
            filesz,
        });
    }
    let end = |s: &Segment| s.offset.saturating_add(s.filesz);
    let interpreter = match segments.iter().find(|s| s.kind == PT_INTERP) {
        Some(s) => Some(r.cstr(s.offset, end(s), "PT_INTERP")?),
        None => None,
    };
    let mut needed = Vec::new();
    if let Some(dynamic) = segments.iter().find(|s| s.kind == PT_DYNAMIC) {
        let entry = if wide { 16 } else { 8 };
        let mut names = Vec::new();
        let mut strtab = None;
        let mut at = dynamic.offset;
        while at.saturating_add(entry) <= end(dynamic) {
            let what = "dynamic section";
            let tag = r.word(at, what)?;
            let val = r.word(at + entry / 2, what)?;
            match tag {
                DT_NULL => break,
                DT_NEEDED => names.push(val),
                DT_STRTAB => strtab = Some(val),
                _ => {}
            }
            at += entry;
        }
        if !names.is_empty() {
            // DT_STRTAB is an address: the loaded segment holding it gives
            // its place in the file.
            let (table, limit) = strtab
                .and_then(|addr| {
                    segments.iter().find_map(|s| {
                        let off = addr.checked_sub(s.vaddr)?;
                        (s.kind == PT_LOAD && off < s.filesz)
                            .then(|| (s.offset.saturating_add(off), end(s)))
                    })
                })
                .ok_or(ElfError::NoStrtab)?;
            for n in names {
                let at = table.checked_add(n).ok_or(ElfError::Bounds("DT_NEEDED"))?;
                needed.push(r.cstr(at, limit, "DT_NEEDED")?);
            }
        }
    }
    Ok(Dynamic {
        machine,
        interpreter,
        needed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal little-endian ELF64 program: one PT_LOAD covering the
    /// file, a PT_INTERP, a PT_DYNAMIC with two DT_NEEDED and DT_STRTAB.
    /// The load segment sits at vaddr 0x400000 so that DT_STRTAB must be
    /// translated to a file offset.
    fn elf64(machine: u16) -> Vec<u8> {
        let mut f = vec![0u8; 0x200];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2;
        f[5] = 1;
        f[18..20].copy_from_slice(&machine.to_le_bytes());
        f[32..40].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        f[54..56].copy_from_slice(&56u16.to_le_bytes()); // e_phentsize
        f[56..58].copy_from_slice(&3u16.to_le_bytes()); // e_phnum
        let ph = |f: &mut Vec<u8>, i: usize, kind: u32, off: u64, vaddr: u64, size: u64| {
            let at = 64 + i * 56;
            f[at..at + 4].copy_from_slice(&kind.to_le_bytes());
            f[at + 8..at + 16].copy_from_slice(&off.to_le_bytes());
            f[at + 16..at + 24].copy_from_slice(&vaddr.to_le_bytes());
            f[at + 32..at + 40].copy_from_slice(&size.to_le_bytes());
        };
        ph(&mut f, 0, PT_LOAD, 0, 0x400000, 0x200);
        ph(&mut f, 1, PT_INTERP, 0x100, 0x400100, 27);
        ph(&mut f, 2, PT_DYNAMIC, 0x180, 0x400180, 64);
        f[0x100..0x11b].copy_from_slice(b"/lib/ld-linux-aarch64.so.1\0");
        // strings at 0x140: "\0libext2fs.so.2\0libc.so.6\0"
        let strings = b"\0libext2fs.so.2\0libc.so.6\0";
        f[0x140..0x140 + strings.len()].copy_from_slice(strings);
        let dynent = |f: &mut Vec<u8>, i: usize, tag: u64, val: u64| {
            let at = 0x180 + i * 16;
            f[at..at + 8].copy_from_slice(&tag.to_le_bytes());
            f[at + 8..at + 16].copy_from_slice(&val.to_le_bytes());
        };
        dynent(&mut f, 0, DT_NEEDED, 1);
        dynent(&mut f, 1, DT_NEEDED, 16);
        dynent(&mut f, 2, DT_STRTAB, 0x400140);
        dynent(&mut f, 3, DT_NULL, 0);
        f
    }

    #[test]
    fn reads_interpreter_and_needed() {
        let d = parse(&elf64(EM_AARCH64)).unwrap();
        assert_eq!(d.machine, EM_AARCH64);
        assert_eq!(d.interpreter.as_deref(), Some("/lib/ld-linux-aarch64.so.1"));
        assert_eq!(d.needed, ["libext2fs.so.2", "libc.so.6"]);
        assert_eq!(multiarch_triplet(d.machine), Some("aarch64-linux-gnu"));
    }

    #[test]
    fn reads_the_host_programs() {
        // Whatever the host is, its own e2fsck names libc and an interpreter.
        let d = parse(&std::fs::read("/usr/sbin/e2fsck").unwrap()).unwrap();
        assert!(d.interpreter.is_some(), "{d:?}");
        assert!(d.needed.iter().any(|n| n.starts_with("libc.so")), "{d:?}");
        assert!(d.needed.iter().any(|n| n.starts_with("libext2fs")), "{d:?}");
    }

    #[test]
    fn hostile_files_are_errors_not_panics() {
        assert_eq!(parse(b""), Err(ElfError::NotElf));
        assert_eq!(parse(b"#!/bin/sh\n"), Err(ElfError::NotElf));
        let good = elf64(EM_AARCH64);
        // Every truncation is an error or a (shorter) answer, never a panic.
        for n in 0..good.len() {
            let _ = parse(&good[..n]);
        }
        // Program headers far outside the file.
        let mut f = good.clone();
        f[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse(&f), Err(ElfError::Bounds(_))));
        // A DT_NEEDED offset past the string table.
        let mut f = good.clone();
        f[0x188..0x190].copy_from_slice(&0xffff_ffffu64.to_le_bytes());
        assert!(matches!(parse(&f), Err(ElfError::Bounds(_))));
        // DT_STRTAB outside every loaded segment.
        let mut f = good.clone();
        f[0x1a8..0x1b0].copy_from_slice(&0x10u64.to_le_bytes());
        assert_eq!(parse(&f), Err(ElfError::NoStrtab));
        // An unterminated interpreter.
        let mut f = good;
        f[0x11a] = b'x';
        assert!(matches!(parse(&f), Err(ElfError::Bounds(_))));
    }
}
