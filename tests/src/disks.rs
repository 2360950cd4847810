//! Reading a VM's disk file from the host: its GPT and what `blkid` finds
//! at an offset (the deploy tests check what the agent wrote or wiped).
#![allow(clippy::unwrap_used)]

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// The first and last byte of every partition of the GPT in `disk` (512-byte
/// sectors); None when neither header (LBA 1, the last LBA) has the
/// `EFI PART` signature.
pub fn gpt_partitions(disk: &Path) -> Option<Vec<(u64, u64)>> {
    let mut f = std::fs::File::open(disk).unwrap();
    let len = f.metadata().unwrap().len();
    let mut sector = |at: u64| {
        let mut b = vec![0u8; 512];
        f.seek(SeekFrom::Start(at)).unwrap();
        f.read_exact(&mut b).unwrap();
        b
    };
    if &sector(512)[..8] != b"EFI PART" && &sector(len - 512)[..8] != b"EFI PART" {
        return None;
    }
    let mut parts = Vec::new();
    for lba in 2..34u64 {
        for e in sector(lba * 512).chunks(128) {
            if e[..16].iter().any(|&x| x != 0) {
                let first = u64::from_le_bytes(e[32..40].try_into().unwrap());
                let last = u64::from_le_bytes(e[40..48].try_into().unwrap());
                parts.push((first * 512, last * 512 + 511));
            }
        }
    }
    Some(parts)
}

/// `blkid -p` at byte `offset` of `file`: its `KEY="value"` pairs (empty:
/// nothing found).
pub fn probe(file: &Path, offset: u64) -> String {
    let out = std::process::Command::new("blkid")
        .args(["-p", "-O", &offset.to_string()])
        .arg(file)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The UUIDs of the ext4 filesystems at the partitions of `disk`.
pub fn ext4_uuids(disk: &Path) -> Vec<String> {
    gpt_partitions(disk)
        .unwrap_or_default()
        .iter()
        .filter_map(|(first, _)| {
            let p = probe(disk, *first);
            if !p.contains(" TYPE=\"ext4\"") {
                return None;
            }
            let at = p.find(" UUID=\"")? + 7;
            Some(p[at..].split('"').next()?.to_string())
        })
        .collect()
}
