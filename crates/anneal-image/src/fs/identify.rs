//! What `blkid -p` reports of a filesystem (type, UUID, label), for the
//! inventory: ext2/3/4 (and ext journal devices), vfat, swap, xfs, btrfs,
//! ntfs. Lenient where capture is strict: it reads the superblocks only
//! and never fails on a filesystem it cannot walk. Golden vectors: real
//! mkfs output against `blkid -p` (agent/tests/fsprobe_blkid.rs).

use std::io;

use super::ReadAt;

/// A filesystem as `blkid -p` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// blkid's TYPE (`ext4`, `vfat`, `swap`, `xfs`, `btrfs`, `ntfs`, …).
    pub fs_type: &'static str,
    /// blkid's UUID.
    pub uuid: Option<String>,
    /// blkid's LABEL.
    pub label: Option<String>,
}

/// The ext generation of a superblock's feature sets, blkid's rule (the
/// feature sets the ext2 and ext3 drivers understand): capture and
/// [`identify`] both name ext filesystems by it.
pub fn ext_kind(compat: u32, incompat: u32, ro_compat: u32) -> &'static str {
    const HAS_JOURNAL: u32 = 0x4;
    const EXT2_INCOMPAT: u32 = 0x0002 | 0x0010; // filetype, meta_bg
    const EXT3_INCOMPAT: u32 = EXT2_INCOMPAT | 0x0004; // + recover
    const EXT23_RO: u32 = 0x1 | 0x2 | 0x4; // sparse_super, large_file, btree_dir
    if incompat & !EXT3_INCOMPAT != 0 || ro_compat & !EXT23_RO != 0 {
        "ext4"
    } else if compat & HAS_JOURNAL != 0 {
        "ext3"
    } else if incompat & !EXT2_INCOMPAT != 0 {
        "ext4"
    } else {
        "ext2"
    }
}

/// Up to `len` bytes at `offset` (fewer at the end of `dev`, none past it).
fn read_upto(dev: &dyn ReadAt, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let have = dev.size().saturating_sub(offset);
    let n = usize::try_from(have).unwrap_or(usize::MAX).min(len);
    let mut buf = vec![0u8; n];
    if n > 0 {
        dev.read_exact_at(&mut buf, offset)?;
    }
    Ok(buf)
}

fn le16(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}
fn le32(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}
fn le64(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?))
}

fn uuid_string(b: &[u8]) -> Option<String> {
    if b.len() != 16 || b.iter().all(|&x| x == 0) {
        return None;
    }
    let h = hex::encode(b);
    Some(format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    ))
}

fn c_label(b: &[u8]) -> Option<String> {
    let end = b.iter().position(|&x| x == 0).unwrap_or(b.len());
    let s = String::from_utf8_lossy(&b[..end]).to_string();
    if s.is_empty() { None } else { Some(s) }
}

/// What `blkid -p` would report of the filesystem on `dev` (type, UUID,
/// label, formatted as blkid prints them); `None` when nothing is
/// recognised. Reads the first 64 KiB and a block at 64 KiB (btrfs), and
/// NTFS's `$Volume` record for its label.
pub fn identify(dev: &dyn ReadAt) -> io::Result<Option<Identity>> {
    let head = read_upto(dev, 0, 0x1_0000)?;
    if let Some(fs) = probe_xfs(&head) {
        return Ok(Some(fs));
    }
    if let Some(fs) = probe_ext(&head) {
        return Ok(Some(fs));
    }
    let btrfs = read_upto(dev, 0x1_0000, 0x1000)?;
    if let Some(fs) = probe_btrfs(&btrfs) {
        return Ok(Some(fs));
    }
    if let Some(fs) = probe_swap(&head) {
        return Ok(Some(fs));
    }
    if head.get(3..11) == Some(b"NTFS    ") {
        return probe_ntfs(dev, &head);
    }
    Ok(probe_vfat(&head))
}

fn probe_ext(b: &[u8]) -> Option<Identity> {
    const SB: usize = 1024;
    if le16(b, SB + 56)? != 0xEF53 {
        return None;
    }
    let compat = le32(b, SB + 92)?;
    let incompat = le32(b, SB + 96)?;
    let ro_compat = le32(b, SB + 100)?;
    const INCOMPAT_JOURNAL_DEV: u32 = 0x8;
    if incompat & INCOMPAT_JOURNAL_DEV != 0 {
        return Some(Identity {
            fs_type: "jbd",
            uuid: uuid_string(b.get(SB + 104..SB + 120)?),
            label: c_label(b.get(SB + 120..SB + 136)?),
        });
    }
    Some(Identity {
        fs_type: ext_kind(compat, incompat, ro_compat),
        uuid: uuid_string(b.get(SB + 104..SB + 120)?),
        label: c_label(b.get(SB + 120..SB + 136)?),
    })
}

fn probe_xfs(b: &[u8]) -> Option<Identity> {
    if b.get(0..4)? != b"XFSB" {
        return None;
    }
    Some(Identity {
        fs_type: "xfs",
        uuid: uuid_string(b.get(32..48)?),
        label: c_label(b.get(108..120)?),
    })
}

fn probe_btrfs(b: &[u8]) -> Option<Identity> {
    if b.get(0x40..0x48)? != b"_BHRfS_M" {
        return None;
    }
    Some(Identity {
        fs_type: "btrfs",
        uuid: uuid_string(b.get(0x20..0x30)?),
        label: c_label(b.get(0x12b..0x12b + 256)?),
    })
}

fn probe_swap(b: &[u8]) -> Option<Identity> {
    for page in [4096usize, 8192, 16384, 65536] {
        let Some(magic) = b.get(page - 10..page) else {
            continue;
        };
        if magic == b"SWAPSPACE2" {
            return Some(Identity {
                fs_type: "swap",
                uuid: uuid_string(b.get(0x40c..0x41c)?),
                label: c_label(b.get(0x41c..0x42c)?),
            });
        }
        if magic == b"SWAP-SPACE" {
            return Some(Identity {
                fs_type: "swap",
                uuid: None,
                label: None,
            });
        }
    }
    None
}

fn probe_vfat(b: &[u8]) -> Option<Identity> {
    if b.get(510..512)? != [0x55, 0xAA] {
        return None;
    }
    let bps = le16(b, 0x0B)?;
    let spc = *b.get(0x0D)?;
    let reserved = le16(b, 0x0E)?;
    let fats = *b.get(0x10)?;
    if !matches!(bps, 512 | 1024 | 2048 | 4096)
        || spc == 0
        || !spc.is_power_of_two()
        || reserved == 0
        || !(1..=2).contains(&fats)
    {
        return None;
    }
    let (id_off, label_off) = if b.get(0x52..0x57)? == b"FAT32" {
        (0x43, 0x47)
    } else if matches!(b.get(0x36..0x3B)?, b"FAT12" | b"FAT16" | b"FAT  ") {
        (0x27, 0x2B)
    } else {
        return None;
    };
    let id = le32(b, id_off)?;
    let label_raw = b.get(label_off..label_off + 11)?;
    let label = String::from_utf8_lossy(label_raw)
        .trim_end_matches([' ', '\0'])
        .to_string();
    let label = if label.is_empty() || label == "NO NAME" {
        None
    } else {
        Some(label)
    };
    Some(Identity {
        fs_type: "vfat",
        uuid: Some(format!("{:04X}-{:04X}", id >> 16, id & 0xFFFF)),
        label,
    })
}

fn probe_ntfs(dev: &dyn ReadAt, b: &[u8]) -> io::Result<Option<Identity>> {
    let serial = le64(b, 0x48);
    let uuid = serial.map(|s| format!("{s:016X}"));
    let label = ntfs_label(dev, b).unwrap_or(None);
    Ok(Some(Identity {
        fs_type: "ntfs",
        uuid,
        label,
    }))
}

/// Reads the volume name from MFT record 3 (`$Volume`), attribute 0x60.
fn ntfs_label(dev: &dyn ReadAt, b: &[u8]) -> io::Result<Option<String>> {
    let Some(bps) = le16(b, 0x0B) else {
        return Ok(None);
    };
    let Some(&spc) = b.get(0x0D) else {
        return Ok(None);
    };
    let cluster = u64::from(bps) * u64::from(spc);
    let (Some(mft_lcn), Some(&cpr)) = (le64(b, 0x30), b.get(0x40)) else {
        return Ok(None);
    };
    let cpr = cpr as i8;
    let record_size: u64 = if cpr < 0 {
        1u64 << u32::from(cpr.unsigned_abs()).min(20)
    } else {
        u64::from(cpr as u8) * cluster
    };
    if cluster == 0 || record_size == 0 || record_size > 64 * 1024 {
        return Ok(None);
    }
    let offset = mft_lcn
        .checked_mul(cluster)
        .and_then(|o| o.checked_add(3 * record_size));
    let Some(offset) = offset else {
        return Ok(None);
    };
    let mut rec = read_upto(dev, offset, record_size as usize)?;
    if rec.get(0..4) != Some(b"FILE") {
        return Ok(None);
    }
    // Apply the update sequence (fixups): the last two bytes of every
    // 512-byte stride hold the sequence number; the real bytes are in the array.
    let (Some(usa_ofs), Some(usa_count)) = (le16(&rec, 4), le16(&rec, 6)) else {
        return Ok(None);
    };
    for i in 1..usize::from(usa_count) {
        let src = usize::from(usa_ofs) + 2 * i;
        let dst = i * 512 - 2;
        if src + 2 > rec.len() || dst + 2 > rec.len() {
            break;
        }
        let (a, c) = (rec[src], rec[src + 1]);
        rec[dst] = a;
        rec[dst + 1] = c;
    }
    let Some(mut at) = le16(&rec, 0x14).map(usize::from) else {
        return Ok(None);
    };
    while let (Some(kind), Some(len)) = (le32(&rec, at), le32(&rec, at + 4)) {
        if kind == 0xFFFF_FFFF || len == 0 {
            break;
        }
        if kind == 0x60 && rec.get(at + 8) == Some(&0) {
            let (Some(vlen), Some(voff)) = (le32(&rec, at + 0x10), le16(&rec, at + 0x14)) else {
                break;
            };
            let start = at + usize::from(voff);
            let Some(raw) = rec.get(start..start + vlen as usize) else {
                break;
            };
            let units: Vec<u16> = raw
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect();
            let s = String::from_utf16_lossy(&units);
            return Ok(if s.is_empty() { None } else { Some(s) });
        }
        at += len as usize;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext_image(compat: u32, incompat: u32, ro: u32) -> Vec<u8> {
        let mut b = vec![0u8; 4096];
        b[1024 + 56..1024 + 58].copy_from_slice(&0xEF53u16.to_le_bytes());
        b[1024 + 92..1024 + 96].copy_from_slice(&compat.to_le_bytes());
        b[1024 + 96..1024 + 100].copy_from_slice(&incompat.to_le_bytes());
        b[1024 + 100..1024 + 104].copy_from_slice(&ro.to_le_bytes());
        b[1024 + 104..1024 + 120].copy_from_slice(&[0x11; 16]);
        b[1024 + 120..1024 + 124].copy_from_slice(b"root");
        b
    }

    #[test]
    fn ext_generations() {
        let e2 = identify(&ext_image(0, 0x2, 0x3)).unwrap().unwrap();
        assert_eq!(e2.fs_type, "ext2");
        assert_eq!(e2.label.as_deref(), Some("root"));
        assert_eq!(
            e2.uuid.as_deref(),
            Some("11111111-1111-1111-1111-111111111111")
        );
        let e3 = identify(&ext_image(0x4, 0x2, 0x3)).unwrap().unwrap();
        assert_eq!(e3.fs_type, "ext3");
        let e4 = identify(&ext_image(0x4, 0x2c2, 0x46b)).unwrap().unwrap();
        assert_eq!(e4.fs_type, "ext4");
    }

    #[test]
    fn garbage_and_short_inputs_find_nothing() {
        assert_eq!(identify(&Vec::new()).unwrap(), None);
        assert_eq!(identify(&vec![0xFFu8; 600]).unwrap(), None);
        // An MBR (boot signature but no BPB) is not vfat.
        let mut mbr = vec![0u8; 512];
        mbr[510] = 0x55;
        mbr[511] = 0xAA;
        assert_eq!(identify(&mbr).unwrap(), None);
        // NTFS magic with a hostile BPB must not panic or read wildly.
        let mut ntfs = vec![0u8; 4096];
        ntfs[3..11].copy_from_slice(b"NTFS    ");
        ntfs[0x30..0x38].copy_from_slice(&u64::MAX.to_le_bytes());
        ntfs[0x0B] = 0;
        ntfs[0x0C] = 2;
        ntfs[0x0D] = 8;
        ntfs[0x40] = 0x80;
        let got = identify(&ntfs).unwrap().unwrap();
        assert_eq!(got.fs_type, "ntfs");
        assert_eq!(got.label, None);
    }
}
