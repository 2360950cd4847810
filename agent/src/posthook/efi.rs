//! `efibootmgr`: a UEFI load option `HD(part, GPT, partUUID, start, size)/
//! File(\EFI\BOOT\BOOTX64.EFI)` for the target's ESP, written through
//! efivarfs as `Boot####`, first in `BootOrder`, replacing earlier entries of
//! this machine (recognised by their description `anneal <machine>`).
//!
//! The encoders are pure (UEFI 2.10 §3.1.3 EFI_LOAD_OPTION, §10.3.5.1 Hard
//! Drive and §10.3.5.4 File Path media device path nodes) and checked against
//! bytes written by Debian's `efibootmgr` (agent/tests/fixtures/efibootmgr).

use super::Context;
use anneal_image::layout::{self, Role, TableKind};
use std::fs::{File, OpenOptions};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

/// EFI_GLOBAL_VARIABLE, the vendor GUID of `Boot####` and `BootOrder`.
pub const EFI_GLOBAL_GUID: &str = "8be4df61-93ca-11d2-aa0d-00e098032b8c";
/// LOAD_OPTION_ACTIVE.
pub const LOAD_OPTION_ACTIVE: u32 = 0x1;
/// NON_VOLATILE | BOOTSERVICE_ACCESS | RUNTIME_ACCESS.
pub const VAR_ATTRS: u32 = 0x7;
/// statfs magic of efivarfs.
const EFIVARFS_MAGIC: u64 = 0xde5e_81e4;

/// Errors of the load option codec and the `efibootmgr` builtin.
#[derive(Debug, thiserror::Error)]
pub enum EfiError {
    /// A load option or device path that does not parse.
    #[error("malformed load option: {0}")]
    Malformed(&'static str),
    /// BootOrder with an odd length.
    #[error("malformed BootOrder ({0} bytes)")]
    BootOrder(usize),
    /// The efivarfs directory is missing.
    #[error(
        "no efivarfs at {0}: the machine did not boot in UEFI mode, or efivarfs is not mounted (mount -t efivarfs efivarfs {0})"
    )]
    NoEfivars(PathBuf),
    /// Reading, writing or removing a variable failed.
    #[error("efi variable {name}: cannot {op}")]
    Var {
        /// file name
        name: String,
        /// read, write, remove, clear the immutable flag of
        op: &'static str,
        /// cause
        #[source]
        source: io::Error,
    },
    /// The partition table of the target could not be read.
    #[error("cannot read the partition table of {disk}")]
    Table {
        /// target
        disk: PathBuf,
        /// cause
        #[source]
        source: layout::LayoutError,
    },
    /// Opening the target.
    #[error("cannot open {disk}")]
    Open {
        /// target
        disk: PathBuf,
        /// cause
        #[source]
        source: io::Error,
    },
    /// No ESP on the target.
    #[error(
        "no esp on {0} (a GPT partition of type C12A7328-F81F-11D2-BA4B-00A0C93EC93B or an MBR partition of type 0xEF)"
    )]
    NoEsp(PathBuf),
    /// The ESP has no partition GUID or the MBR has no signature.
    #[error("the esp on {0} has no partition GUID or disk signature to point a load option at")]
    NoSignature(PathBuf),
    /// Unknown architecture.
    #[error("architecture {0:?} has no removable-media loader name (x86_64 or aarch64)")]
    Architecture(String),
    /// All 65536 Boot#### numbers are taken.
    #[error("no free Boot#### number in {0}")]
    Full(PathBuf),
}

/// Signature of the partition an HD node names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartSignature {
    /// GPT unique partition GUID, in its on-disk (mixed-endian) bytes.
    Gpt([u8; 16]),
    /// MBR disk signature (the 4 bytes at offset 440, as a little-endian u32).
    Mbr(u32),
}

/// The HD media device path node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HardDrive {
    /// Partition number (1-based).
    pub partition_number: u32,
    /// First LBA of the partition (logical sectors).
    pub start_lba: u64,
    /// Size in logical sectors.
    pub size_lba: u64,
    /// Which partition.
    pub signature: PartSignature,
}

/// One EFI_LOAD_OPTION.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOption {
    /// LOAD_OPTION_* bits.
    pub attributes: u32,
    /// Description (UCS-2 on the wire).
    pub description: String,
    /// The device path list, raw (nodes up to and including the End node).
    pub file_path_list: Vec<u8>,
    /// Optional data after the path list.
    pub optional_data: Vec<u8>,
}

fn ucs2(s: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 * s.len() + 2);
    for u in s.encode_utf16().chain(std::iter::once(0)) {
        out.extend_from_slice(&u.to_le_bytes());
    }
    out
}

/// Encodes the HD node of `hd`.
pub fn hd_node(hd: &HardDrive) -> Vec<u8> {
    let mut n = Vec::with_capacity(42);
    n.extend_from_slice(&[0x04, 0x01]);
    n.extend_from_slice(&42u16.to_le_bytes());
    n.extend_from_slice(&hd.partition_number.to_le_bytes());
    n.extend_from_slice(&hd.start_lba.to_le_bytes());
    n.extend_from_slice(&hd.size_lba.to_le_bytes());
    let (sig, fmt, sig_type) = match hd.signature {
        PartSignature::Gpt(g) => (g, 0x02u8, 0x02u8),
        PartSignature::Mbr(m) => {
            let mut s = [0u8; 16];
            s[..4].copy_from_slice(&m.to_le_bytes());
            (s, 0x01, 0x01)
        }
    };
    n.extend_from_slice(&sig);
    n.push(fmt);
    n.push(sig_type);
    n
}

/// Encodes a File Path node for `path` (`\EFI\BOOT\BOOTX64.EFI`).
pub fn file_node(path: &str) -> Vec<u8> {
    let name = ucs2(path);
    let len = u16::try_from(4 + name.len()).unwrap_or(u16::MAX);
    let mut n = vec![0x04, 0x04];
    n.extend_from_slice(&len.to_le_bytes());
    n.extend_from_slice(&name);
    n
}

/// The End Entire Device Path node.
pub const END_NODE: [u8; 4] = [0x7f, 0xff, 0x04, 0x00];

/// `HD(...)/File(path)/End`.
pub fn hd_file_path(hd: &HardDrive, path: &str) -> Vec<u8> {
    let mut v = hd_node(hd);
    v.extend_from_slice(&file_node(path));
    v.extend_from_slice(&END_NODE);
    v
}

/// Encodes a load option.
pub fn encode(o: &LoadOption) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&o.attributes.to_le_bytes());
    let fpl = u16::try_from(o.file_path_list.len()).unwrap_or(u16::MAX);
    v.extend_from_slice(&fpl.to_le_bytes());
    v.extend_from_slice(&ucs2(&o.description));
    v.extend_from_slice(&o.file_path_list);
    v.extend_from_slice(&o.optional_data);
    v
}

/// Decodes a load option (the variable's data, without the attribute prefix).
pub fn decode(b: &[u8]) -> Result<LoadOption, EfiError> {
    if b.len() < 6 {
        return Err(EfiError::Malformed("shorter than its header"));
    }
    let attributes = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let fpl = usize::from(u16::from_le_bytes([b[4], b[5]]));
    let mut i = 6;
    let mut units = Vec::new();
    loop {
        let u = b
            .get(i..i + 2)
            .ok_or(EfiError::Malformed("unterminated description"))?;
        i += 2;
        let u = u16::from_le_bytes([u[0], u[1]]);
        if u == 0 {
            break;
        }
        units.push(u);
    }
    let description = String::from_utf16_lossy(&units);
    let file_path_list = b
        .get(i..i + fpl)
        .ok_or(EfiError::Malformed("file path list past the end"))?
        .to_vec();
    let optional_data = b[i + fpl..].to_vec();
    Ok(LoadOption {
        attributes,
        description,
        file_path_list,
        optional_data,
    })
}

fn guid_text(g: &[u8; 16]) -> String {
    layout::guid_to_string(g).to_ascii_lowercase()
}

/// Renders a device path list the way `efibootmgr -v` does for the nodes
/// anneal writes (`HD(1,GPT,<guid>,0x800,0x10000)/File(\EFI\BOOT\BOOTX64.EFI)`);
/// other nodes as `Path(type,subtype,hex)`.
pub fn device_path_text(mut dp: &[u8]) -> Result<String, EfiError> {
    let mut parts = Vec::new();
    loop {
        if dp.len() < 4 {
            return Err(EfiError::Malformed("device path without an end node"));
        }
        let (t, s) = (dp[0], dp[1]);
        let len = usize::from(u16::from_le_bytes([dp[2], dp[3]]));
        if len < 4 || len > dp.len() {
            return Err(EfiError::Malformed("device path node length"));
        }
        let body = &dp[4..len];
        match (t, s) {
            (0x7f, 0xff) => break,
            (0x04, 0x01) if body.len() == 38 => {
                let num = u32::from_le_bytes([body[0], body[1], body[2], body[3]]);
                let start = u64::from_le_bytes(body[4..12].try_into().unwrap_or_default());
                let size = u64::from_le_bytes(body[12..20].try_into().unwrap_or_default());
                let sig: [u8; 16] = body[20..36].try_into().unwrap_or_default();
                let sig_text = match body[37] {
                    0x02 => format!("GPT,{}", guid_text(&sig)),
                    0x01 => format!(
                        "MBR,0x{:x}",
                        u32::from_le_bytes([sig[0], sig[1], sig[2], sig[3]])
                    ),
                    other => format!("{other},0"),
                };
                parts.push(format!("HD({num},{sig_text},0x{start:x},0x{size:x})"));
            }
            (0x04, 0x04) => {
                let units: Vec<u16> = body
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .take_while(|u| *u != 0)
                    .collect();
                parts.push(format!("File({})", String::from_utf16_lossy(&units)));
            }
            _ => parts.push(format!("Path({t},{s},{})", hex::encode(body))),
        }
        dp = &dp[len..];
    }
    Ok(parts.join("/"))
}

/// Encodes BootOrder.
pub fn encode_boot_order(order: &[u16]) -> Vec<u8> {
    order.iter().flat_map(|n| n.to_le_bytes()).collect()
}

/// Decodes BootOrder.
pub fn decode_boot_order(b: &[u8]) -> Result<Vec<u16>, EfiError> {
    if !b.len().is_multiple_of(2) {
        return Err(EfiError::BootOrder(b.len()));
    }
    Ok(b.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect())
}

/// `Boot0004-8be4df61-…`.
pub fn boot_var_name(n: u16) -> String {
    format!("Boot{n:04X}-{EFI_GLOBAL_GUID}")
}

/// The variable file name of BootOrder.
pub fn boot_order_name() -> String {
    format!("BootOrder-{EFI_GLOBAL_GUID}")
}

/// Parses `Boot####-<global guid>` into its number.
pub fn parse_boot_var_name(name: &str) -> Option<u16> {
    let rest = name.strip_prefix("Boot")?;
    let (num, guid) = rest.split_once('-')?;
    if num.len() != 4 || !guid.eq_ignore_ascii_case(EFI_GLOBAL_GUID) {
        return None;
    }
    u16::from_str_radix(num, 16).ok()
}

/// An efivarfs directory (or a plain directory standing in for it in tests:
/// same file format, a 4-byte attribute prefix before the data).
#[derive(Debug)]
pub struct VarStore {
    dir: PathBuf,
    efivarfs: bool,
}

impl VarStore {
    /// Opens `dir`.
    pub fn open(dir: &Path) -> Result<Self, EfiError> {
        if !dir.is_dir() {
            return Err(EfiError::NoEfivars(dir.to_path_buf()));
        }
        let efivarfs = rustix::fs::statfs(dir)
            .map(|s| s.f_type as u64 == EFIVARFS_MAGIC)
            .unwrap_or(false);
        Ok(VarStore {
            dir: dir.to_path_buf(),
            efivarfs,
        })
    }

    fn var_err(name: &str, op: &'static str) -> impl FnOnce(io::Error) -> EfiError {
        let name = name.to_string();
        move |source| EfiError::Var { name, op, source }
    }

    /// Reads a variable: attributes and data; `None` when absent.
    pub fn read(&self, name: &str) -> Result<Option<(u32, Vec<u8>)>, EfiError> {
        let b = match std::fs::read(self.dir.join(name)) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Self::var_err(name, "read")(e)),
        };
        if b.len() < 4 {
            return Err(EfiError::Var {
                name: name.to_string(),
                op: "read",
                source: io::Error::new(io::ErrorKind::InvalidData, "shorter than 4 bytes"),
            });
        }
        Ok(Some((
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            b[4..].to_vec(),
        )))
    }

    /// efivarfs marks variable files immutable; clear that before a write or
    /// a removal. File systems without the flag answer ENOTTY/EOPNOTSUPP:
    /// nothing to clear there.
    fn clear_immutable(&self, name: &str) -> Result<(), EfiError> {
        let f = match File::open(self.dir.join(name)) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Self::var_err(name, "open")(e)),
        };
        let Ok(flags) = rustix::fs::ioctl_getflags(&f) else {
            return Ok(());
        };
        if flags.contains(rustix::fs::IFlags::IMMUTABLE) {
            rustix::fs::ioctl_setflags(&f, flags - rustix::fs::IFlags::IMMUTABLE)
                .map_err(|e| Self::var_err(name, "clear the immutable flag of")(e.into()))?;
        }
        Ok(())
    }

    /// Writes a variable in one `write(2)` (efivarfs needs the attributes and
    /// the data together).
    pub fn write(&self, name: &str, attrs: u32, data: &[u8]) -> Result<(), EfiError> {
        self.clear_immutable(name)?;
        let mut buf = attrs.to_le_bytes().to_vec();
        buf.extend_from_slice(data);
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(!self.efivarfs)
            .open(self.dir.join(name))
            .map_err(Self::var_err(name, "write"))?;
        let n = f.write(&buf).map_err(Self::var_err(name, "write"))?;
        if n != buf.len() {
            return Err(EfiError::Var {
                name: name.to_string(),
                op: "write",
                source: io::Error::new(io::ErrorKind::WriteZero, "short write"),
            });
        }
        Ok(())
    }

    /// Removes a variable (absent is fine).
    pub fn remove(&self, name: &str) -> Result<(), EfiError> {
        self.clear_immutable(name)?;
        match std::fs::remove_file(self.dir.join(name)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Self::var_err(name, "remove")(e)),
        }
    }

    /// Numbers of the `Boot####` variables present.
    pub fn boot_entries(&self) -> Result<Vec<u16>, EfiError> {
        let rd = std::fs::read_dir(&self.dir)
            .map_err(|e| Self::var_err(&self.dir.to_string_lossy(), "list")(e))?;
        let mut v = Vec::new();
        for e in rd {
            let e = e.map_err(|e| Self::var_err(&self.dir.to_string_lossy(), "list")(e))?;
            if let Some(n) = e.file_name().to_str().and_then(parse_boot_var_name) {
                v.push(n);
            }
        }
        v.sort_unstable();
        Ok(v)
    }
}

/// The description that marks this machine's entries.
pub fn description(machine: &str) -> String {
    format!("anneal {machine}")
}

/// The new BootOrder: `new` first, then the old order without `new` and
/// without the replaced entries.
pub fn new_boot_order(old: &[u16], new: u16, replaced: &[u16]) -> Vec<u16> {
    std::iter::once(new)
        .chain(
            old.iter()
                .copied()
                .filter(|n| *n != new && !replaced.contains(n)),
        )
        .collect()
}

/// The HD node for the ESP of the target as its partition table says now.
pub fn esp_hard_drive(disk: &Path) -> Result<HardDrive, EfiError> {
    let mut f = File::open(disk).map_err(|source| EfiError::Open {
        disk: disk.to_path_buf(),
        source,
    })?;
    let l = layout::read_layout(&mut f).map_err(|source| EfiError::Table {
        disk: disk.to_path_buf(),
        source,
    })?;
    let esp = l
        .slots
        .iter()
        .find(|s| s.role == Role::Esp)
        .ok_or_else(|| EfiError::NoEsp(disk.to_path_buf()))?;
    let signature = match l.partition_table {
        TableKind::Gpt => esp
            .part_uuid
            .as_deref()
            .and_then(layout::guid_from_string)
            .map(PartSignature::Gpt),
        TableKind::Mbr => l
            .disk_signature
            .as_deref()
            .and_then(|h| hex::decode(h).ok())
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(|b| PartSignature::Mbr(u32::from_le_bytes(b))),
    }
    .ok_or_else(|| EfiError::NoSignature(disk.to_path_buf()))?;
    Ok(HardDrive {
        partition_number: esp.number,
        start_lba: esp.start_bytes / l.sector_size,
        size_lba: esp.size_bytes / l.sector_size,
        signature,
    })
}

/// Writes this machine's boot entry and puts it first.
pub fn run(ctx: &Context, log: &mut dyn FnMut(&str)) -> Result<(), EfiError> {
    let (_, boot_name) = super::fat::arch_names(&ctx.architecture)
        .ok_or_else(|| EfiError::Architecture(ctx.architecture.clone()))?;
    let store = VarStore::open(&ctx.efivars)?;
    let hd = esp_hard_drive(&ctx.os_disk)?;
    let path = format!("\\EFI\\BOOT\\{boot_name}");
    let desc = description(&ctx.machine);
    let opt = LoadOption {
        attributes: LOAD_OPTION_ACTIVE,
        description: desc.clone(),
        file_path_list: hd_file_path(&hd, &path),
        optional_data: Vec::new(),
    };
    let present = store.boot_entries()?;
    let mut ours = Vec::new();
    for n in &present {
        if let Some((_, data)) = store.read(&boot_var_name(*n))?
            && decode(&data).is_ok_and(|o| o.description == desc)
        {
            ours.push(*n);
        }
    }
    let num = (0..=u16::MAX)
        .find(|n| !present.contains(n))
        .ok_or_else(|| EfiError::Full(ctx.efivars.clone()))?;
    store.write(&boot_var_name(num), VAR_ATTRS, &encode(&opt))?;
    let old_order = match store.read(&boot_order_name())? {
        Some((_, d)) => decode_boot_order(&d)?,
        None => Vec::new(),
    };
    let order = new_boot_order(&old_order, num, &ours);
    store.write(&boot_order_name(), VAR_ATTRS, &encode_boot_order(&order))?;
    for n in &ours {
        store.remove(&boot_var_name(*n))?;
    }
    log(&format!(
        "efibootmgr: Boot{num:04X} \"{desc}\" {} first in BootOrder{}",
        device_path_text(&opt.file_path_list)?,
        if ours.is_empty() {
            String::new()
        } else {
            format!(
                ", replaced {}",
                ours.iter()
                    .map(|n| format!("Boot{n:04X}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LoadOption {
        let hd = HardDrive {
            partition_number: 1,
            start_lba: 0x800,
            size_lba: 0x10000,
            signature: PartSignature::Gpt(
                layout::guid_from_string("AAAAAAAA-BBBB-CCCC-DDDD-EEEEEEEEEEEE").unwrap(),
            ),
        };
        LoadOption {
            attributes: LOAD_OPTION_ACTIVE,
            description: "anneal m1".into(),
            file_path_list: hd_file_path(&hd, "\\EFI\\BOOT\\BOOTX64.EFI"),
            optional_data: vec![],
        }
    }

    #[test]
    fn load_option_round_trip_and_text() {
        let o = sample();
        let b = encode(&o);
        assert_eq!(decode(&b).unwrap(), o);
        assert_eq!(
            device_path_text(&o.file_path_list).unwrap(),
            "HD(1,GPT,aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee,0x800,0x10000)/File(\\EFI\\BOOT\\BOOTX64.EFI)"
        );
        // header: attributes, FilePathListLength (42 + 4 + 44 + 4 = 94)
        assert_eq!(&b[..6], &[1, 0, 0, 0, 0x5e, 0]);
    }

    #[test]
    fn mbr_hd_node() {
        let hd = HardDrive {
            partition_number: 2,
            start_lba: 2048,
            size_lba: 4096,
            signature: PartSignature::Mbr(0x1234_abcd),
        };
        let n = hd_node(&hd);
        assert_eq!(n.len(), 42);
        assert_eq!(&n[24..28], &[0xcd, 0xab, 0x34, 0x12]);
        assert_eq!(&n[40..], &[1, 1]);
        let mut dp = n.clone();
        dp.extend_from_slice(&END_NODE);
        assert_eq!(
            device_path_text(&dp).unwrap(),
            "HD(2,MBR,0x1234abcd,0x800,0x1000)"
        );
    }

    #[test]
    fn hostile_load_options_are_refused() {
        assert!(decode(&[]).is_err());
        assert!(decode(&[1, 0, 0, 0, 0xff, 0xff, b'a', 0, 0, 0]).is_err());
        assert!(decode(&[1, 0, 0, 0, 0, 0, b'a', 0]).is_err()); // no NUL
        assert!(device_path_text(&[4, 4, 2, 0]).is_err());
        assert!(device_path_text(&[4, 4, 0xff, 0]).is_err());
        assert!(device_path_text(&[]).is_err());
        assert!(decode_boot_order(&[1, 0, 2]).is_err());
    }

    #[test]
    fn boot_order_and_names() {
        assert_eq!(
            decode_boot_order(&encode_boot_order(&[3, 0, 0x1a])).unwrap(),
            vec![3, 0, 0x1a]
        );
        assert_eq!(new_boot_order(&[2, 0, 1, 5], 7, &[1, 5]), vec![7, 2, 0]);
        assert_eq!(new_boot_order(&[2, 7], 7, &[]), vec![7, 2]);
        assert_eq!(
            boot_var_name(0x1a),
            "Boot001A-8be4df61-93ca-11d2-aa0d-00e098032b8c"
        );
        assert_eq!(parse_boot_var_name(&boot_var_name(0x1a)), Some(0x1a));
        assert_eq!(parse_boot_var_name(&boot_order_name()), None);
        assert_eq!(
            parse_boot_var_name("Boot0001-00000000-0000-0000-0000-000000000000"),
            None
        );
    }
}
