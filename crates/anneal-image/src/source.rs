//! Capture sources: split and compressed partclone images (as Clonezilla
//! writes them), Clonezilla image directories, qcow2 (read by
//! [`crate::qcow2`], no subprocess).

use crate::layout::{Layout, Role, Slot, TableKind, role_for_guid, role_for_mbr};
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};

/// Errors of opening a source.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// I/O.
    #[error("{what} {path}")]
    Io {
        /// what was done
        what: &'static str,
        /// file
        path: PathBuf,
        /// cause
        #[source]
        source: io::Error,
    },
    /// Compression we do not read.
    #[error("unsupported compression of {0} (gzip, zstd or none)")]
    Compression(PathBuf),
    /// A malformed Clonezilla directory.
    #[error("clonezilla image {path}: {detail}")]
    Clonezilla {
        /// directory
        path: PathBuf,
        /// what is wrong
        detail: String,
    },
    /// A qcow2 image that is refused or unreadable.
    #[error("converting qcow2 image {path} to raw")]
    Qcow2 {
        /// the qcow2 file
        path: PathBuf,
        /// cause
        #[source]
        source: crate::qcow2::Qcow2Error,
    },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SourceError {
    let path = path.to_owned();
    move |source| SourceError::Io { what, path, source }
}

/// Reads a list of files as one stream.
#[derive(Debug)]
pub struct MultiFile {
    files: Vec<PathBuf>,
    next: usize,
    cur: Option<File>,
}

impl MultiFile {
    /// Files in order.
    pub fn new(files: Vec<PathBuf>) -> Self {
        MultiFile {
            files,
            next: 0,
            cur: None,
        }
    }
}

impl Read for MultiFile {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.cur.is_none() {
                let Some(p) = self.files.get(self.next) else {
                    return Ok(0);
                };
                self.cur = Some(File::open(p)?);
                self.next += 1;
            }
            if let Some(f) = &mut self.cur {
                let n = f.read(buf)?;
                if n > 0 || buf.is_empty() {
                    return Ok(n);
                }
            }
            self.cur = None;
        }
    }
}

/// The split parts of `path` if it ends in `.aa` (`.aa`, `.ab`, ... while
/// they exist), else just `path`.
pub fn split_parts(path: &Path) -> Vec<PathBuf> {
    let s = path.to_string_lossy();
    let Some(stem) = s.strip_suffix(".aa") else {
        return vec![path.to_owned()];
    };
    let mut out = Vec::new();
    'outer: for a in b'a'..=b'z' {
        for b in b'a'..=b'z' {
            let p = PathBuf::from(format!("{stem}.{}{}", a as char, b as char));
            if !p.exists() {
                break 'outer;
            }
            out.push(p);
        }
    }
    out
}

/// What a Clonezilla partition image holds once decompressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// A partclone image (header, bitmap, blocks).
    Partclone,
    /// Raw partition bytes, as `partclone.dd` writes them.
    Raw,
}

/// Opens a partition image: joins split parts, undoes gzip or zstd
/// compression (detected by magic bytes) and tells a partclone image from
/// raw `partclone.dd` output.
pub fn open_partclone(path: &Path) -> Result<(Box<dyn Read + Send>, ImageKind), SourceError> {
    let parts = split_parts(path);
    let mut magic = [0u8; 4];
    let mut first = File::open(&parts[0]).map_err(io_err("opening", &parts[0]))?;
    let n = first
        .read(&mut magic)
        .map_err(io_err("reading", &parts[0]))?;
    drop(first);
    let raw = BufReader::with_capacity(1 << 20, MultiFile::new(parts));
    let mut inner: Box<dyn Read + Send> = if n >= 2 && magic[..2] == [0x1f, 0x8b] {
        Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::read::MultiGzDecoder::new(raw),
        ))
    } else if n == 4 && magic == [0x28, 0xb5, 0x2f, 0xfd] {
        let d = zstd::stream::read::Decoder::with_buffer(raw)
            .map_err(io_err("starting zstd on", path))?;
        Box::new(BufReader::with_capacity(1 << 20, d))
    } else if n >= 3 && (magic[..3] == [0x42, 0x5a, 0x68] || magic == [0xfd, 0x37, 0x7a, 0x58]) {
        // bzip2, xz
        return Err(SourceError::Compression(path.to_owned()));
    } else {
        Box::new(raw)
    };
    let mut head = Vec::with_capacity(16);
    (&mut inner)
        .take(16)
        .read_to_end(&mut head)
        .map_err(io_err("reading", path))?;
    let kind = if head.starts_with(crate::partclone::MAGIC) {
        ImageKind::Partclone
    } else {
        ImageKind::Raw
    };
    Ok((Box::new(io::Cursor::new(head).chain(inner)), kind))
}

/// Like [`open_partclone`] for a stream (one part, not split): undoes gzip
/// or zstd compression (detected by magic bytes) and tells a partclone
/// image from raw `partclone.dd` output, reading only forward.
pub fn open_partclone_stream<'a, R: Read + Send + 'a>(
    mut input: R,
) -> io::Result<(Box<dyn Read + Send + 'a>, ImageKind)> {
    let mut magic = Vec::with_capacity(4);
    (&mut input).take(4).read_to_end(&mut magic)?;
    let raw = io::Cursor::new(magic.clone()).chain(input);
    let mut inner: Box<dyn Read + Send + 'a> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::read::MultiGzDecoder::new(raw),
        ))
    } else if magic == [0x28, 0xb5, 0x2f, 0xfd] {
        let d = zstd::stream::read::Decoder::new(raw)?;
        Box::new(BufReader::with_capacity(1 << 20, d))
    } else if magic.starts_with(&[0x42, 0x5a, 0x68]) || magic == [0xfd, 0x37, 0x7a, 0x58] {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "unsupported compression (gzip, zstd or none)",
        ));
    } else {
        Box::new(raw)
    };
    let mut head = Vec::with_capacity(16);
    (&mut inner).take(16).read_to_end(&mut head)?;
    let kind = if head.starts_with(crate::partclone::MAGIC) {
        ImageKind::Partclone
    } else {
        ImageKind::Raw
    };
    Ok((Box::new(io::Cursor::new(head).chain(inner)), kind))
}

/// One partclone image of a Clonezilla directory.
#[derive(Debug, Clone)]
pub struct CzImage {
    /// Partition number.
    pub number: u32,
    /// First file (the `.aa` part when split).
    pub path: PathBuf,
}

/// A swap partition recorded by Clonezilla.
#[derive(Debug, Clone)]
pub struct CzSwap {
    /// Partition number.
    pub number: u32,
    /// UUID.
    pub uuid: Option<String>,
    /// Label.
    pub label: Option<String>,
}

/// What a Clonezilla directory holds.
#[derive(Debug, Clone)]
pub struct Clonezilla {
    /// The table from `<disk>-pt.sf`.
    pub layout: Layout,
    /// partclone images per partition.
    pub images: Vec<CzImage>,
    /// swap partitions.
    pub swaps: Vec<CzSwap>,
}

fn part_number(dev: &str) -> Option<u32> {
    let digits: String = dev
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    digits.parse().ok()
}

/// Parses an `sfdisk --dump` text into a layout.
pub fn parse_sfdisk(text: &str) -> Result<Layout, String> {
    let mut kind = None;
    let mut label_id = None;
    let mut ss = 512u64;
    let mut slots = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some(v) = line.strip_prefix("label:") {
            kind = match v.trim() {
                "gpt" => Some(TableKind::Gpt),
                "dos" => Some(TableKind::Mbr),
                other => return Err(format!("table type {other}")),
            };
        } else if let Some(v) = line.strip_prefix("label-id:") {
            label_id = Some(v.trim().to_string());
        } else if let Some(v) = line.strip_prefix("sector-size:") {
            ss = v.trim().parse().map_err(|_| "sector size".to_string())?;
        } else if line.starts_with("/dev/") {
            let (dev, rest) = line.split_once(':').ok_or("partition line")?;
            let number = part_number(dev.trim()).ok_or("partition number")?;
            let mut start = None;
            let mut size = None;
            let mut ty = None;
            let mut uuid = None;
            let mut name = String::new();
            let mut bootable = false;
            let mut attrs = 0u64;
            for field in split_fields(rest) {
                let field = field.trim();
                let (k, v) = field.split_once('=').unwrap_or((field, ""));
                let v = v.trim();
                match k.trim() {
                    "start" => start = v.parse::<u64>().ok(),
                    "size" => size = v.parse::<u64>().ok(),
                    "type" => ty = Some(v.to_string()),
                    "uuid" => uuid = Some(v.to_ascii_uppercase()),
                    "name" => name = v.trim_matches('"').to_string(),
                    "bootable" => bootable = true,
                    "attrs" => attrs = parse_attrs(v.trim_matches('"')),
                    _ => {}
                }
            }
            let (Some(start), Some(size), Some(ty)) = (start, size, ty) else {
                return Err(format!("partition {number} lacks start, size or type"));
            };
            let k = kind.ok_or("partition before the label line")?;
            let (type_guid, mbr_type, role) = match k {
                TableKind::Gpt => {
                    let g = ty.to_ascii_uppercase();
                    let r = role_for_guid(&g);
                    (Some(g), None, r)
                }
                TableKind::Mbr => {
                    let t = u8::from_str_radix(ty.trim_start_matches("0x"), 16)
                        .map_err(|_| format!("mbr type {ty}"))?;
                    (None, Some(t), role_for_mbr(t))
                }
            };
            slots.push(Slot {
                number,
                role,
                start_bytes: start * ss,
                size_bytes: size * ss,
                grow: false,
                type_guid,
                part_uuid: uuid,
                mbr_type,
                bootable,
                name,
                attributes: attrs,
                fs_type: None,
                uuid: None,
                label: None,
                content_ref: None,
            });
        }
    }
    let kind = kind.ok_or("no label line")?;
    slots.sort_by_key(|s| s.number);
    let disk_size = slots
        .iter()
        .map(|s| s.start_bytes + s.size_bytes)
        .max()
        .unwrap_or(0)
        + if kind == TableKind::Gpt { 33 * ss } else { 0 };
    let (disk_guid, disk_signature) = match (kind, label_id) {
        (TableKind::Gpt, id) => (id.map(|s| s.to_ascii_uppercase()), None),
        (TableKind::Mbr, Some(id)) => {
            let v = u32::from_str_radix(id.trim_start_matches("0x"), 16)
                .map_err(|_| format!("label-id {id}"))?;
            (None, Some(hex::encode(v.to_le_bytes())))
        }
        (TableKind::Mbr, None) => (None, None),
    };
    Ok(Layout {
        partition_table: kind,
        sector_size: ss,
        disk_size,
        disk_guid,
        disk_signature,
        slots,
    })
}

fn split_fields(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in s.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                cur.push(c);
            }
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    if !cur.trim().is_empty() {
        out.push(cur);
    }
    out
}

fn parse_attrs(s: &str) -> u64 {
    let mut bits = 0u64;
    for a in s.split_whitespace() {
        if a == "RequiredPartition" {
            bits |= 1;
        } else if a == "NoBlockIOProtocol" {
            bits |= 2;
        } else if a == "LegacyBIOSBootable" {
            bits |= 4;
        } else if let Some(list) = a.strip_prefix("GUID:") {
            for n in list.split(',') {
                if let Ok(b) = n.parse::<u32>()
                    && b < 64
                {
                    bits |= 1 << b;
                }
            }
        }
    }
    bits
}

fn info_value(text: &str, key: &str) -> Option<String> {
    let pat = format!("{key}=\"");
    let i = text.find(&pat)? + pat.len();
    let rest = &text[i..];
    let j = rest.find('"')?;
    let v = rest[..j].to_string();
    if v.is_empty() { None } else { Some(v) }
}

/// Reads a Clonezilla image directory.
pub fn read_clonezilla(dir: &Path) -> Result<Clonezilla, SourceError> {
    let cz = |detail: String| SourceError::Clonezilla {
        path: dir.to_owned(),
        detail,
    };
    let mut pt = None;
    let mut images = Vec::new();
    let mut swaps = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(io_err("listing", dir))?;
    for e in entries {
        let e = e.map_err(io_err("listing", dir))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with("-pt.sf") {
            if pt.is_some() {
                return Err(cz("more than one disk (-pt.sf) is not supported".into()));
            }
            pt = Some(e.path());
        } else if let Some((part, rest)) = name.split_once('.')
            && let Some((_, suffix)) = rest.split_once("-ptcl-img")
        {
            // `<part>.<fs>-ptcl-img.<comp>` or split `<...>.<comp>.aa`, `.ab`, ...
            let segments: Vec<&str> = suffix.split('.').filter(|x| !x.is_empty()).collect();
            if segments.len() >= 2 && segments.last() != Some(&"aa") {
                continue;
            }
            let number = part_number(part).ok_or_else(|| cz(format!("partition name {part}")))?;
            images.push(CzImage {
                number,
                path: e.path(),
            });
        } else if let Some(part) = name
            .strip_prefix("swappt-")
            .and_then(|s| s.strip_suffix(".info"))
        {
            let number = part_number(part).ok_or_else(|| cz(format!("partition name {part}")))?;
            let text = std::fs::read_to_string(e.path()).map_err(io_err("reading", &e.path()))?;
            swaps.push(CzSwap {
                number,
                uuid: info_value(&text, "UUID"),
                label: info_value(&text, "LABEL"),
            });
        }
    }
    let pt = pt.ok_or_else(|| cz("no <disk>-pt.sf".into()))?;
    let text = std::fs::read_to_string(&pt).map_err(io_err("reading", &pt))?;
    let mut layout = parse_sfdisk(&text).map_err(cz)?;
    for s in &mut layout.slots {
        if swaps.iter().any(|w| w.number == s.number) {
            s.role = Role::Swap;
        }
    }
    images.sort_by_key(|i| i.number);
    Ok(Clonezilla {
        layout,
        images,
        swaps,
    })
}

/// Converts a qcow2 image to a sparse raw file of its virtual size (the
/// bytes `qemu-img convert -O raw` writes), read by [`crate::qcow2`]:
/// backing files, external data files and encryption are refused. `dst` is
/// created or truncated, and removed again on error.
pub fn qcow2_to_raw(src: &Path, dst: &Path) -> Result<(), SourceError> {
    crate::qcow2::convert_file(src, dst)
        .map(|_| ())
        .map_err(|source| SourceError::Qcow2 {
            path: src.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sfdisk_gpt_dump() {
        let t = "label: gpt\nlabel-id: 0d4c2b1a-0000-4000-8000-000000000001\ndevice: /dev/sda\nunit: sectors\nfirst-lba: 34\nlast-lba: 131038\nsector-size: 512\n\n/dev/sda1 : start=        2048, size=       65536, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, uuid=11111111-2222-3333-4444-555555555555, name=\"EFI, system\"\n/dev/sda2 : start=       67584, size=        8192, type=0657FD6D-A4AB-43C4-84E5-0933C84B4F4F, uuid=21111111-2222-3333-4444-555555555555\n";
        let l = parse_sfdisk(t).unwrap();
        assert_eq!(l.partition_table, TableKind::Gpt);
        assert_eq!(l.slots.len(), 2);
        assert_eq!(l.slots[0].name, "EFI, system");
        assert_eq!(l.slots[0].role, Role::Esp);
        assert_eq!(l.slots[1].role, Role::Swap);
        assert_eq!(l.slots[1].start_bytes, 67584 * 512);
    }

    #[test]
    fn partclone_streams_plain_gzip_zstd_and_raw() {
        use std::io::Write as _;
        let img = crate::partclone::build("EXTFS", 4096, &[true, false, true], &[7u8; 8192], 0);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&img).unwrap();
        let gz = gz.finish().unwrap();
        let zst = zstd::stream::encode_all(&img[..], 1).unwrap();
        for (input, what) in [(&img, "plain"), (&gz, "gzip"), (&zst, "zstd")] {
            let (mut r, kind) = open_partclone_stream(&input[..]).unwrap();
            assert_eq!(kind, ImageKind::Partclone, "{what}");
            let mut back = Vec::new();
            r.read_to_end(&mut back).unwrap();
            assert!(back == img, "{what}");
        }
        let (mut r, kind) = open_partclone_stream(&b"raw bytes"[..]).unwrap();
        assert_eq!(kind, ImageKind::Raw);
        let mut back = Vec::new();
        r.read_to_end(&mut back).unwrap();
        assert_eq!(back, b"raw bytes");
        assert!(open_partclone_stream(&b"BZh91AY&SY"[..]).is_err());
    }

    #[test]
    fn sfdisk_dos_dump() {
        let t = "label: dos\nlabel-id: 0x12345678\nunit: sectors\n\n/dev/sdb1 : start=2048, size=4096, type=83, bootable\n/dev/sdb2 : start=6144, size=4096, type=82\n";
        let l = parse_sfdisk(t).unwrap();
        assert_eq!(l.disk_signature.as_deref(), Some("78563412"));
        assert!(l.slots[0].bootable);
        assert_eq!(l.slots[1].mbr_type, Some(0x82));
        assert_eq!(l.slots[1].role, Role::Swap);
    }
}
