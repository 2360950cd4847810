//! Disk layouts: read a GPT or MBR partition table into slots, write the
//! table for a layout onto a target, and invalidate a target's table.

use serde::{Deserialize, Serialize};
use std::io::{self, Read, Seek, SeekFrom, Write};

/// EFI system partition type GUID.
pub const GUID_ESP: &str = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B";
/// Linux swap type GUID.
pub const GUID_SWAP: &str = "0657FD6D-A4AB-43C4-84E5-0933C84B4F4F";
/// Microsoft reserved partition type GUID.
pub const GUID_MSR: &str = "E3C9E316-0B5C-4DB8-817D-F92DF00215AE";

/// Errors of reading or writing partition tables.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// I/O on the disk.
    #[error("partition table i/o")]
    Io(#[source] io::Error),
    /// gptman refused.
    #[error("gpt")]
    Gpt(#[source] gptman::Error),
    /// mbrman refused.
    #[error("mbr")]
    Mbr(#[source] mbrman::Error),
    /// Neither GPT nor MBR found.
    #[error("no gpt or mbr partition table found")]
    NoTable,
    /// A layout that cannot be written.
    #[error("invalid layout: {0}")]
    Invalid(String),
    /// A partition reserved at the end of the disk (the config drive) does
    /// not fit after the layout's last slot.
    #[error(
        "no room for partition {number} ({size} bytes from byte {start} to the end of the {target}-byte target): slot {slot} ends at byte {slot_end}; use a larger disk, a smaller last slot or a smaller config drive"
    )]
    NoRoomAtEnd {
        /// the reserved partition's number
        number: u32,
        /// its size in bytes
        size: u64,
        /// its first byte
        start: u64,
        /// target size
        target: u64,
        /// the slot in the way
        slot: u32,
        /// where that slot ends (its minimum size for a growing slot)
        slot_end: u64,
    },
    /// The layout does not fit the target.
    #[error("layout needs {need} bytes, target has {have}")]
    TooLarge {
        /// bytes required
        need: u64,
        /// target size
        have: u64,
    },
}

/// Partition table kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TableKind {
    /// GUID partition table.
    Gpt,
    /// DOS/MBR (primary partitions only).
    Mbr,
}

/// Role of a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// EFI system partition.
    Esp,
    /// Data.
    Data,
    /// Swap.
    Swap,
    /// Microsoft reserved.
    Msr,
}

/// One partition of a layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Slot {
    /// Partition number (1-based).
    pub number: u32,
    /// Role.
    pub role: Role,
    /// Offset of the partition on the disk.
    pub start_bytes: u64,
    /// Size of the partition.
    pub size_bytes: u64,
    /// The last partition may grow to the end of the target.
    #[serde(default)]
    pub grow: bool,
    /// GPT type GUID (upper case).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub type_guid: Option<String>,
    /// GPT partition GUID (upper case).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part_uuid: Option<String>,
    /// MBR partition type byte.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mbr_type: Option<u8>,
    /// MBR active flag.
    #[serde(default)]
    pub bootable: bool,
    /// GPT partition name.
    #[serde(default)]
    pub name: String,
    /// GPT attribute bits.
    #[serde(default)]
    pub attributes: u64,
    /// Filesystem type found (`ext4`, `vfat`, `swap`, `raw`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
    /// Filesystem UUID as blkid prints it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Filesystem label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Name of the content (files `<ref>.index` and `<ref>.stream`); none
    /// for swap and blank slots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_ref: Option<String>,
}

/// A disk layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Layout {
    /// Table kind.
    pub partition_table: TableKind,
    /// Logical sector size.
    pub sector_size: u64,
    /// Size of the source disk.
    pub disk_size: u64,
    /// GPT disk GUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_guid: Option<String>,
    /// MBR disk signature (hex of the 4 bytes as stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_signature: Option<String>,
    /// Slots in partition-number order.
    pub slots: Vec<Slot>,
}

impl Layout {
    /// Pretty JSON (what `layout.json` holds).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// Formats mixed-endian GPT GUID bytes as the usual upper-case string.
pub fn guid_to_string(g: &[u8; 16]) -> String {
    format!(
        "{:02X}{:02X}{:02X}{:02X}-{:02X}{:02X}-{:02X}{:02X}-{:02X}{:02X}-{:02X}{:02X}{:02X}{:02X}{:02X}{:02X}",
        g[3],
        g[2],
        g[1],
        g[0],
        g[5],
        g[4],
        g[7],
        g[6],
        g[8],
        g[9],
        g[10],
        g[11],
        g[12],
        g[13],
        g[14],
        g[15]
    )
}

/// Parses a GUID string into mixed-endian GPT bytes.
pub fn guid_from_string(s: &str) -> Option<[u8; 16]> {
    let h: String = s.chars().filter(|c| *c != '-').collect();
    if h.len() != 32 {
        return None;
    }
    let b = hex::decode(h).ok()?;
    let mut g = [0u8; 16];
    g[0] = b[3];
    g[1] = b[2];
    g[2] = b[1];
    g[3] = b[0];
    g[4] = b[5];
    g[5] = b[4];
    g[6] = b[7];
    g[7] = b[6];
    g[8..].copy_from_slice(&b[8..]);
    Some(g)
}

/// Role for a GPT type GUID.
pub fn role_for_guid(g: &str) -> Role {
    match g.to_ascii_uppercase().as_str() {
        GUID_ESP => Role::Esp,
        GUID_SWAP => Role::Swap,
        GUID_MSR => Role::Msr,
        _ => Role::Data,
    }
}

/// Role for an MBR type byte.
pub fn role_for_mbr(t: u8) -> Role {
    match t {
        0xEF => Role::Esp,
        0x82 => Role::Swap,
        _ => Role::Data,
    }
}

/// Reads the partition table of a disk image (GPT first, then MBR).
pub fn read_layout<R: Read + Seek>(disk: &mut R) -> Result<Layout, LayoutError> {
    let disk_size = disk.seek(SeekFrom::End(0)).map_err(LayoutError::Io)?;
    for ss in [512u64, 4096] {
        if let Ok(gpt) = gptman::GPT::read_from(disk, ss) {
            let mut slots = Vec::new();
            for (n, e) in gpt.iter() {
                if !e.is_used() {
                    continue;
                }
                let tg = guid_to_string(&e.partition_type_guid);
                let start = e.starting_lba.checked_mul(ss);
                let size = e
                    .ending_lba
                    .checked_sub(e.starting_lba)
                    .and_then(|x| x.checked_add(1))
                    .and_then(|x| x.checked_mul(ss));
                let (Some(start), Some(size)) = (start, size) else {
                    return Err(LayoutError::Invalid(format!("partition {n} range")));
                };
                slots.push(Slot {
                    number: n,
                    role: role_for_guid(&tg),
                    start_bytes: start,
                    size_bytes: size,
                    grow: false,
                    type_guid: Some(tg),
                    part_uuid: Some(guid_to_string(&e.unique_partition_guid)),
                    mbr_type: None,
                    bootable: false,
                    name: e.partition_name.as_str().to_string(),
                    attributes: e.attribute_bits,
                    fs_type: None,
                    uuid: None,
                    label: None,
                    content_ref: None,
                });
            }
            let layout = Layout {
                partition_table: TableKind::Gpt,
                sector_size: ss,
                disk_size,
                disk_guid: Some(guid_to_string(&gpt.header.disk_guid)),
                disk_signature: None,
                slots,
            };
            validate(&layout, disk_size)?;
            return Ok(layout);
        }
    }
    let mut sig = [0u8; 2];
    disk.seek(SeekFrom::Start(510)).map_err(LayoutError::Io)?;
    disk.read_exact(&mut sig).map_err(LayoutError::Io)?;
    if sig != [0x55, 0xAA] {
        return Err(LayoutError::NoTable);
    }
    let mbr = mbrman::MBR::read_from(disk, 512).map_err(LayoutError::Mbr)?;
    let mut slots = Vec::new();
    for (n, e) in mbr.iter() {
        if !e.is_used() {
            continue;
        }
        if e.is_extended() || n > 4 {
            return Err(LayoutError::Invalid(
                "extended/logical mbr partitions are not supported".into(),
            ));
        }
        if e.sys == 0xEE {
            return Err(LayoutError::Invalid(
                "protective mbr without a readable gpt".into(),
            ));
        }
        slots.push(Slot {
            number: n as u32,
            role: role_for_mbr(e.sys),
            start_bytes: u64::from(e.starting_lba) * 512,
            size_bytes: u64::from(e.sectors) * 512,
            grow: false,
            type_guid: None,
            part_uuid: None,
            mbr_type: Some(e.sys),
            bootable: e.is_active(),
            name: String::new(),
            attributes: 0,
            fs_type: None,
            uuid: None,
            label: None,
            content_ref: None,
        });
    }
    let layout = Layout {
        partition_table: TableKind::Mbr,
        sector_size: 512,
        disk_size,
        disk_guid: None,
        disk_signature: Some(hex::encode(mbr.header.disk_signature)),
        slots,
    };
    validate(&layout, disk_size)?;
    Ok(layout)
}

/// Bytes a layout needs at the end of the disk after its last partition.
fn tail_reserve(l: &Layout) -> u64 {
    match l.partition_table {
        TableKind::Gpt => 33 * l.sector_size,
        TableKind::Mbr => 0,
    }
}

/// Checks slots are sorted, non-overlapping, sector-aligned, off the table
/// area and within `target_size`; only the last slot may grow.
pub fn validate(l: &Layout, target_size: u64) -> Result<(), LayoutError> {
    let ss = l.sector_size;
    if ss != 512 && ss != 4096 {
        return Err(LayoutError::Invalid(format!("sector size {ss}")));
    }
    if l.partition_table == TableKind::Mbr && ss != 512 {
        return Err(LayoutError::Invalid("mbr needs 512-byte sectors".into()));
    }
    let first = match l.partition_table {
        TableKind::Gpt => 34 * ss,
        TableKind::Mbr => ss,
    };
    let mut prev_end = first;
    let mut prev_num = 0u32;
    let n = l.slots.len();
    for (i, s) in l.slots.iter().enumerate() {
        if s.number <= prev_num || s.number > 128 {
            return Err(LayoutError::Invalid(format!("slot number {}", s.number)));
        }
        if l.partition_table == TableKind::Mbr && s.number > 4 {
            return Err(LayoutError::Invalid(format!(
                "mbr slot number {}",
                s.number
            )));
        }
        if s.grow && i + 1 != n {
            return Err(LayoutError::Invalid(format!(
                "slot {} grows but is not last",
                s.number
            )));
        }
        if s.size_bytes == 0 || s.start_bytes % ss != 0 || s.size_bytes % ss != 0 {
            return Err(LayoutError::Invalid(format!(
                "slot {} is empty or not sector aligned",
                s.number
            )));
        }
        if s.start_bytes < prev_end {
            return Err(LayoutError::Invalid(format!(
                "slot {} overlaps the table or the previous slot",
                s.number
            )));
        }
        let end = s
            .start_bytes
            .checked_add(s.size_bytes)
            .ok_or_else(|| LayoutError::Invalid(format!("slot {} range", s.number)))?;
        prev_end = end;
        prev_num = s.number;
        match l.partition_table {
            TableKind::Gpt => {
                if s.type_guid.as_deref().and_then(guid_from_string).is_none() {
                    return Err(LayoutError::Invalid(format!("slot {} type guid", s.number)));
                }
                if let Some(p) = &s.part_uuid
                    && guid_from_string(p).is_none()
                {
                    return Err(LayoutError::Invalid(format!(
                        "slot {} partition guid",
                        s.number
                    )));
                }
            }
            TableKind::Mbr => {
                if s.mbr_type.is_none_or(|t| t == 0) || end / 512 > u64::from(u32::MAX) {
                    return Err(LayoutError::Invalid(format!("slot {} mbr entry", s.number)));
                }
            }
        }
    }
    let need = prev_end.saturating_add(tail_reserve(l));
    if need > target_size {
        return Err(LayoutError::TooLarge {
            need,
            have: target_size,
        });
    }
    Ok(())
}

/// Final size of each slot on a target of `target_size` bytes (the last slot
/// grows when asked to).
pub fn final_sizes(l: &Layout, target_size: u64) -> Vec<u64> {
    let n = l.slots.len();
    l.slots
        .iter()
        .enumerate()
        .map(|(i, s)| {
            if s.grow && i + 1 == n {
                let limit = target_size.saturating_sub(tail_reserve(l));
                let limit = limit - limit % l.sector_size;
                limit.saturating_sub(s.start_bytes).max(s.size_bytes)
            } else {
                s.size_bytes
            }
        })
        .collect()
}

/// A partition to reserve at the end of the disk, after the layout's slots
/// (the cloud-init config drive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TailSlot<'a> {
    /// Partition number: greater than every slot's (at most 4 on MBR).
    pub number: u32,
    /// Requested size in bytes (the partition gets at least this much).
    pub size_bytes: u64,
    /// GPT type GUID.
    pub type_guid: &'a str,
    /// MBR type byte.
    pub mbr_type: u8,
    /// GPT partition name.
    pub name: &'a str,
}

/// One past the last byte a partition may use on a target of `target_size`
/// bytes (GPT: before the backup entries and header; MBR: within 2 TiB).
fn usable_end(l: &Layout, target_size: u64) -> u64 {
    let end = match l.partition_table {
        TableKind::Gpt => target_size.saturating_sub(tail_reserve(l)),
        TableKind::Mbr => target_size.min(u64::from(u32::MAX) * 512),
    };
    end - end % l.sector_size.max(1)
}

/// `l` with `tail` added as its last slot on a target of `target_size`
/// bytes: the slot starts on a 1 MiB boundary and ends at the last usable
/// byte, so it is `tail.size_bytes` plus less than 1 MiB. A growing last
/// slot is materialised to end where it starts (`grow` cleared, size set);
/// a last slot that would overlap it is [`LayoutError::NoRoomAtEnd`].
pub fn with_config_drive(
    l: &Layout,
    target_size: u64,
    tail: &TailSlot<'_>,
) -> Result<Layout, LayoutError> {
    const ALIGN: u64 = 1 << 20;
    let n = tail.number;
    if let Some(max) = l.slots.iter().map(|s| s.number).max()
        && n <= max
    {
        return Err(LayoutError::Invalid(format!(
            "partition {n} for the config drive: the layout already has slots up to {max}; it must come after the last one"
        )));
    }
    match l.partition_table {
        TableKind::Mbr if !(1..=4).contains(&n) => {
            return Err(LayoutError::Invalid(format!(
                "partition {n} for the config drive: an MBR table holds primary partitions 1 to 4 only; use an Image with a GPT layout or fewer partitions"
            )));
        }
        TableKind::Gpt if !(1..=128).contains(&n) => {
            return Err(LayoutError::Invalid(format!(
                "partition {n} for the config drive: a GPT holds partitions 1 to 128"
            )));
        }
        _ => {}
    }
    if tail.size_bytes == 0 {
        return Err(LayoutError::Invalid(format!(
            "partition {n} for the config drive has size 0"
        )));
    }
    let end = usable_end(l, target_size);
    let start = end
        .checked_sub(tail.size_bytes)
        .map(|s| s - s % ALIGN)
        .filter(|s| *s > 0)
        .ok_or(LayoutError::TooLarge {
            need: tail.size_bytes.saturating_add(ALIGN),
            have: target_size,
        })?;
    let mut out = l.clone();
    if let Some(last) = out.slots.last_mut() {
        let min_end = last.start_bytes.saturating_add(last.size_bytes);
        if min_end > start {
            return Err(LayoutError::NoRoomAtEnd {
                number: n,
                size: end - start,
                start,
                target: target_size,
                slot: last.number,
                slot_end: min_end,
            });
        }
        if last.grow {
            last.grow = false;
            last.size_bytes = start - last.start_bytes;
        }
    }
    let gpt = l.partition_table == TableKind::Gpt;
    out.slots.push(Slot {
        number: n,
        role: Role::Data,
        start_bytes: start,
        size_bytes: end - start,
        grow: false,
        type_guid: gpt.then(|| tail.type_guid.to_ascii_uppercase()),
        part_uuid: None,
        mbr_type: (!gpt).then_some(tail.mbr_type),
        bootable: false,
        name: if gpt {
            tail.name.to_string()
        } else {
            String::new()
        },
        attributes: 0,
        fs_type: None,
        uuid: None,
        label: None,
        content_ref: None,
    });
    validate(&out, target_size)?;
    Ok(out)
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = f.read_exact(&mut b);
    }
    b
}

/// Writes the partition table of `l` onto a target of `target_size` bytes.
pub fn write_table<F: Read + Write + Seek>(
    l: &Layout,
    target: &mut F,
    target_size: u64,
) -> Result<(), LayoutError> {
    validate(l, target_size)?;
    let sizes = final_sizes(l, target_size);
    let ss = l.sector_size;
    match l.partition_table {
        TableKind::Gpt => {
            let dg = l
                .disk_guid
                .as_deref()
                .and_then(guid_from_string)
                .unwrap_or_else(random_bytes::<16>);
            let mut gpt = gptman::GPT::new_from(target, ss, dg).map_err(LayoutError::Gpt)?;
            for (s, size) in l.slots.iter().zip(&sizes) {
                let start = s.start_bytes / ss;
                let end = start + size / ss - 1;
                if start < gpt.header.first_usable_lba || end > gpt.header.last_usable_lba {
                    return Err(LayoutError::TooLarge {
                        need: (end + 34) * ss,
                        have: target_size,
                    });
                }
                let tg = s.type_guid.as_deref().and_then(guid_from_string);
                let Some(tg) = tg else {
                    return Err(LayoutError::Invalid(format!("slot {} type guid", s.number)));
                };
                let pg = s
                    .part_uuid
                    .as_deref()
                    .and_then(guid_from_string)
                    .unwrap_or_else(random_bytes::<16>);
                gpt[s.number] = gptman::GPTPartitionEntry {
                    partition_type_guid: tg,
                    unique_partition_guid: pg,
                    starting_lba: start,
                    ending_lba: end,
                    attribute_bits: s.attributes,
                    partition_name: s.name.as_str().into(),
                };
            }
            gpt.write_into(target).map_err(LayoutError::Gpt)?;
            gptman::GPT::write_protective_mbr_into(target, ss).map_err(LayoutError::Gpt)?;
        }
        TableKind::Mbr => {
            let mut sig = [0u8; 4];
            if let Some(h) = l.disk_signature.as_deref()
                && let Ok(b) = hex::decode(h)
                && b.len() == 4
            {
                sig.copy_from_slice(&b);
            } else {
                sig = random_bytes::<4>();
            }
            let mut mbr = mbrman::MBR::new_from(target, 512, sig).map_err(LayoutError::Mbr)?;
            for (s, size) in l.slots.iter().zip(&sizes) {
                let start = u32::try_from(s.start_bytes / 512)
                    .map_err(|_| LayoutError::Invalid("mbr start".into()))?;
                let sectors = u32::try_from(size / 512)
                    .map_err(|_| LayoutError::Invalid("mbr size".into()))?;
                mbr[s.number as usize] = mbrman::MBRPartitionEntry {
                    boot: if s.bootable {
                        mbrman::BOOT_ACTIVE
                    } else {
                        mbrman::BOOT_INACTIVE
                    },
                    first_chs: mbrman::CHS::empty(),
                    sys: s.mbr_type.unwrap_or(0x83),
                    last_chs: mbrman::CHS::empty(),
                    starting_lba: start,
                    sectors,
                };
            }
            mbr.write_into(target).map_err(LayoutError::Mbr)?;
        }
    }
    target.flush().map_err(LayoutError::Io)?;
    Ok(())
}

/// Zeroes the protective/DOS MBR, the primary GPT header and entries, and the
/// backup GPT entries and header, so the target has no partition table.
pub fn invalidate<F: Write + Seek>(target: &mut F, target_size: u64) -> io::Result<()> {
    let head = (34 * 4096u64).min(target_size);
    let zeros = vec![0u8; head as usize];
    target.seek(SeekFrom::Start(0))?;
    target.write_all(&zeros)?;
    let tail = (33 * 4096u64).min(target_size);
    target.seek(SeekFrom::Start(target_size - tail))?;
    target.write_all(&zeros[..tail as usize])?;
    target.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guid_round_trip() {
        let g = guid_from_string(GUID_ESP).unwrap();
        assert_eq!(g[0], 0x28);
        assert_eq!(guid_to_string(&g), GUID_ESP);
        assert_eq!(role_for_guid(&GUID_SWAP.to_lowercase()), Role::Swap);
    }

    fn slot(number: u32, start: u64, size: u64) -> Slot {
        Slot {
            number,
            role: Role::Data,
            start_bytes: start,
            size_bytes: size,
            grow: false,
            type_guid: Some("0FC63DAF-8483-4772-8E79-3D69D8477DE4".into()),
            part_uuid: None,
            mbr_type: None,
            bootable: false,
            name: "x".into(),
            attributes: 0,
            fs_type: None,
            uuid: None,
            label: None,
            content_ref: None,
        }
    }

    #[test]
    fn gpt_write_read_round_trip_and_invalidate() {
        let mut l = Layout {
            partition_table: TableKind::Gpt,
            sector_size: 512,
            disk_size: 8 << 20,
            disk_guid: Some("11111111-2222-3333-4444-555555555555".into()),
            disk_signature: None,
            slots: vec![slot(1, 1 << 20, 1 << 20), slot(2, 2 << 20, 2 << 20)],
        };
        l.slots[1].grow = true;
        l.slots[1].part_uuid = Some("AAAAAAAA-BBBB-CCCC-DDDD-EEEEEEEEEEEE".into());
        let mut disk = std::io::Cursor::new(vec![0u8; 8 << 20]);
        write_table(&l, &mut disk, 8 << 20).unwrap();
        let got = read_layout(&mut disk).unwrap();
        assert_eq!(got.slots.len(), 2);
        assert_eq!(got.slots[1].part_uuid, l.slots[1].part_uuid);
        // grown to the last usable sector
        assert_eq!(got.slots[1].size_bytes, (8 << 20) - (2 << 20) - 33 * 512);
        invalidate(&mut disk, 8 << 20).unwrap();
        assert!(read_layout(&mut disk).is_err());
    }

    #[test]
    fn hostile_layouts_are_refused() {
        let l = Layout {
            partition_table: TableKind::Gpt,
            sector_size: 512,
            disk_size: 8 << 20,
            disk_guid: None,
            disk_signature: None,
            slots: vec![slot(1, 1 << 20, 4 << 20), slot(2, 2 << 20, 1 << 20)],
        };
        assert!(validate(&l, 8 << 20).is_err()); // overlap
        let mut l2 = l.clone();
        l2.slots.pop();
        assert!(validate(&l2, 8 << 20).is_ok());
        assert!(matches!(
            validate(&l2, 4 << 20),
            Err(LayoutError::TooLarge { .. })
        ));
        l2.slots[0].start_bytes = 512; // on the gpt
        assert!(validate(&l2, 8 << 20).is_err());
    }

    const CD_GUID: &str = "EBD0A0A2-B9E5-4433-87C0-68B6B72699C7";

    fn drive(number: u32, size_bytes: u64) -> TailSlot<'static> {
        TailSlot {
            number,
            size_bytes,
            type_guid: CD_GUID,
            mbr_type: 0x0c,
            name: "config-drive",
        }
    }

    fn gpt(slots: Vec<Slot>) -> Layout {
        Layout {
            partition_table: TableKind::Gpt,
            sector_size: 512,
            disk_size: 64 << 20,
            disk_guid: None,
            disk_signature: None,
            slots,
        }
    }

    #[test]
    fn config_drive_on_gpt_ends_at_the_last_usable_byte() {
        let target = 64u64 << 20;
        let l = gpt(vec![slot(1, 1 << 20, 8 << 20), slot(2, 9 << 20, 16 << 20)]);
        let got = with_config_drive(&l, target, &drive(3, 4 << 20)).unwrap();
        assert_eq!(got.slots.len(), 3);
        assert_eq!(&got.slots[..2], &l.slots[..]);
        let cd = &got.slots[2];
        let end = target - 33 * 512;
        // 4 MiB back from the last usable byte, rounded down to 1 MiB
        assert_eq!(cd.start_bytes, 59 << 20);
        assert_eq!(cd.start_bytes + cd.size_bytes, end);
        assert!(cd.size_bytes >= 4 << 20 && cd.size_bytes < 5 << 20);
        assert_eq!(cd.number, 3);
        assert_eq!(cd.type_guid.as_deref(), Some(CD_GUID));
        assert_eq!(cd.name, "config-drive");
        assert_eq!(cd.mbr_type, None);
        assert!(!cd.grow);
        // the table written and read back has it at the end
        let mut disk = std::io::Cursor::new(vec![0u8; target as usize]);
        write_table(&got, &mut disk, target).unwrap();
        let back = read_layout(&mut disk).unwrap();
        assert_eq!(back.slots[2].start_bytes, cd.start_bytes);
        assert_eq!(back.slots[2].size_bytes, cd.size_bytes);
        assert_eq!(back.slots[2].name, "config-drive");
        assert_eq!(back.slots[2].type_guid.as_deref(), Some(CD_GUID));
    }

    #[test]
    fn a_growing_last_slot_stops_before_the_config_drive() {
        let target = 64u64 << 20;
        let mut l = gpt(vec![slot(1, 1 << 20, 8 << 20), slot(2, 9 << 20, 16 << 20)]);
        l.slots[1].grow = true;
        let got = with_config_drive(&l, target, &drive(3, 2 << 20)).unwrap();
        let root = &got.slots[1];
        assert!(!root.grow);
        assert_eq!(root.start_bytes + root.size_bytes, got.slots[2].start_bytes);
        assert_eq!(got.slots[2].start_bytes, 61 << 20);
        assert_eq!(final_sizes(&got, target)[1], (61 - 9) << 20);
        // the input is unchanged
        assert!(l.slots[1].grow);
    }

    #[test]
    fn config_drive_on_mbr() {
        let target = 32u64 << 20;
        let mut l = gpt(vec![slot(1, 1 << 20, 8 << 20)]);
        l.partition_table = TableKind::Mbr;
        l.slots[0].type_guid = None;
        l.slots[0].mbr_type = Some(0x83);
        l.slots[0].grow = true;
        let got = with_config_drive(&l, target, &drive(2, 1 << 20)).unwrap();
        let cd = &got.slots[1];
        assert_eq!(cd.start_bytes, 31 << 20);
        assert_eq!(cd.size_bytes, 1 << 20);
        assert_eq!(cd.mbr_type, Some(0x0c));
        assert_eq!(cd.type_guid, None);
        assert_eq!(got.slots[0].size_bytes, 30 << 20);
        let mut disk = std::io::Cursor::new(vec![0u8; target as usize]);
        write_table(&got, &mut disk, target).unwrap();
        let back = read_layout(&mut disk).unwrap();
        assert_eq!(back.slots[1].mbr_type, Some(0x0c));
        assert_eq!(back.slots[1].start_bytes, 31 << 20);
        // MBR holds four primaries
        let e = with_config_drive(&l, target, &drive(5, 1 << 20)).unwrap_err();
        assert!(e.to_string().contains("primary partitions 1 to 4"), "{e}");
    }

    #[test]
    fn config_drive_without_room_names_the_sizes() {
        let target = 32u64 << 20;
        let l = gpt(vec![slot(1, 1 << 20, 28 << 20)]);
        let e = with_config_drive(&l, target, &drive(2, 4 << 20)).unwrap_err();
        let LayoutError::NoRoomAtEnd {
            number,
            start,
            slot,
            slot_end,
            target: t,
            ..
        } = e
        else {
            panic!("{e}");
        };
        assert_eq!((number, slot, slot_end, t), (2, 1, 29 << 20, target));
        assert_eq!(start, 27 << 20);
        let msg = e.to_string();
        assert!(msg.contains("slot 1 ends at byte 30408704"), "{msg}");
        // a growing slot is no smaller than its size in the layout
        let mut g = l.clone();
        g.slots[0].grow = true;
        assert!(matches!(
            with_config_drive(&g, target, &drive(2, 4 << 20)),
            Err(LayoutError::NoRoomAtEnd { .. })
        ));
        // a drive larger than the disk
        assert!(with_config_drive(&l, 1 << 20, &drive(2, 4 << 20)).is_err());
    }

    #[test]
    fn config_drive_number_must_follow_the_slots() {
        let l = gpt(vec![slot(1, 1 << 20, 1 << 20), slot(3, 2 << 20, 1 << 20)]);
        for n in [0, 1, 2, 3] {
            let e = with_config_drive(&l, 64 << 20, &drive(n, 1 << 20)).unwrap_err();
            assert!(e.to_string().contains("slots up to 3"), "{n}: {e}");
        }
        assert!(with_config_drive(&l, 64 << 20, &drive(129, 1 << 20)).is_err());
        assert!(with_config_drive(&l, 64 << 20, &drive(4, 0)).is_err());
        assert_eq!(
            with_config_drive(&l, 64 << 20, &drive(4, 1 << 20))
                .unwrap()
                .slots[2]
                .number,
            4
        );
    }
}
