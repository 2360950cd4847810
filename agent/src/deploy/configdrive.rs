//! The cloud-init NoCloud config drive (docs/deploy.md, "Day-1
//! configuration (cloud-init)"): a FAT file system
//! labelled as the plan says (`CIDATA`) in the partition reserved at the end
//! of the OS disk, holding the plan's files (`user-data`, `meta-data`,
//! `network-config`) in its root directory, byte for byte, under their long
//! names. The files carry user secrets: only names and sizes are ever
//! logged.

use crate::posthook::fat::Window;
use anneal_api::agent::{
    CONFIG_DRIVE_MBR_TYPE, CONFIG_DRIVE_PART_NAME, CONFIG_DRIVE_TYPE_GUID, PlannedConfigDrive,
};
use anneal_image::layout::{self, Layout, LayoutError};
use std::fs::File;
use std::io::{self, Write as _};
use std::os::unix::fs::FileExt as _;

/// Bytes zeroed at both ends of the partition before it is formatted, so
/// no signature of an earlier file system is left for blkid to find.
const WIPE: u64 = 1 << 20;

/// Room the FAT structures take besides the files (FATs, root directory,
/// one partly used cluster per file), checked before the first write.
const OVERHEAD: u64 = 256 << 10;

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// `FAT12`, `FAT16` or `FAT32`, as fatfs chose for the size.
    pub fat_type: &'static str,
    /// Cluster size in bytes.
    pub cluster_bytes: u32,
}

/// The OS disk's layout with the config drive's partition added at the end
/// of a `target_size`-byte disk (see [`layout::with_config_drive`]).
pub fn reserve(
    l: &Layout,
    target_size: u64,
    cd: &PlannedConfigDrive,
) -> Result<Layout, LayoutError> {
    layout::with_config_drive(
        l,
        target_size,
        &layout::TailSlot {
            number: cd.partition,
            size_bytes: cd.size_bytes,
            type_guid: CONFIG_DRIVE_TYPE_GUID,
            mbr_type: CONFIG_DRIVE_MBR_TYPE,
            name: CONFIG_DRIVE_PART_NAME,
        },
    )
}

/// The label as the 11 bytes of a FAT volume label (space padded).
fn label_bytes(label: &str) -> Result<[u8; 11], String> {
    let ok = !label.is_empty()
        && label.len() <= 11
        && label
            .bytes()
            .all(|b| b.is_ascii_graphic() && !b"\"*+,./:;<=>?[\\]|".contains(&b) || b == b' ');
    if !ok {
        return Err(format!(
            "config drive label {label:?} is not a FAT volume label (1 to 11 ASCII letters, digits or -_; cloud-init looks for CIDATA)"
        ));
    }
    let mut out = [b' '; 11];
    out[..label.len()].copy_from_slice(label.as_bytes());
    Ok(out)
}

/// Checks the plan's config drive before anything is written: its label,
/// its file names (plain names in the root directory) and that the files fit
/// a partition of `part_bytes`.
pub fn check(cd: &PlannedConfigDrive, part_bytes: u64) -> Result<(), String> {
    label_bytes(&cd.label)?;
    for name in cd.files.keys() {
        let bad = name.is_empty()
            || name.len() > 255
            || name == "."
            || name == ".."
            || name
                .chars()
                .any(|c| c.is_control() || "/\\:*?\"<>|".contains(c));
        if bad {
            return Err(format!(
                "config drive file name {name:?} is not a plain FAT long file name (no path separators or control characters)"
            ));
        }
    }
    let data: u64 = cd.files.values().map(|f| f.len() as u64).sum();
    if data.saturating_add(OVERHEAD) > part_bytes {
        return Err(format!(
            "config drive files take {data} bytes, more than partition {} of {part_bytes} bytes holds with its FAT structures; raise the config drive's size",
            cd.partition
        ));
    }
    Ok(())
}

/// Formats `len` bytes of `disk` from `start` as FAT with the plan's label
/// and writes its files into the root directory; logs names and sizes only.
pub fn write(disk: &File, start: u64, len: u64, cd: &PlannedConfigDrive) -> io::Result<Written> {
    let label = label_bytes(&cd.label).map_err(io::Error::other)?;
    let zeros = vec![0u8; WIPE.min(len) as usize];
    disk.write_all_at(&zeros, start)?;
    disk.write_all_at(&zeros, start + len - zeros.len() as u64)?;
    fatfs::format_volume(
        Window::new(disk, start, len),
        fatfs::FormatVolumeOptions::new().volume_label(label),
    )?;
    let fs = fatfs::FileSystem::new(
        Window::new(disk, start, len),
        fatfs::FsOptions::new().update_accessed_date(false),
    )?;
    for (name, bytes) in &cd.files {
        let mut f = fs
            .root_dir()
            .create_file(name)
            .map_err(|e| io::Error::new(e.kind(), format!("creating {name}: {e}")))?;
        f.truncate()?;
        f.write_all(bytes.expose())
            .and_then(|()| f.flush())
            .map_err(|e| io::Error::new(e.kind(), format!("writing {name}: {e}")))?;
        tracing::info!(file = %name, bytes = bytes.len(), "config drive file written");
    }
    let written = Written {
        fat_type: match fs.fat_type() {
            fatfs::FatType::Fat12 => "FAT12",
            fatfs::FatType::Fat16 => "FAT16",
            fatfs::FatType::Fat32 => "FAT32",
        },
        cluster_bytes: fs.cluster_size(),
    };
    fs.unmount()?;
    disk.sync_all()?;
    Ok(written)
}

/// The log line of a written drive: partition, size, FAT type, label and
/// each file's name and size (never its bytes).
pub fn summary(cd: &PlannedConfigDrive, len: u64, w: &Written) -> String {
    let files: Vec<String> = cd
        .files
        .iter()
        .map(|(n, b)| format!("{n} ({} bytes)", b.len()))
        .collect();
    format!(
        "config drive: partition {} ({len} bytes, {} with {}-byte clusters, label {}): {}",
        cd.partition,
        w.fat_type,
        w.cluster_bytes,
        cd.label,
        files.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_api::agent::SecretBytes;
    use std::collections::BTreeMap;

    fn drive(label: &str, files: &[(&str, &[u8])]) -> PlannedConfigDrive {
        PlannedConfigDrive {
            partition: 4,
            size_bytes: 1 << 20,
            label: label.into(),
            files: files
                .iter()
                .map(|(n, b)| (n.to_string(), SecretBytes::new(*b)))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    #[test]
    fn labels_and_names_are_checked_before_writing() {
        assert_eq!(&label_bytes("CIDATA").unwrap(), b"CIDATA     ");
        assert_eq!(&label_bytes("cidata").unwrap(), b"cidata     ");
        for bad in ["", "TWELVE-CHARS", "CI/DATA", "CIDATÄ"] {
            let e = check(&drive(bad, &[]), 4 << 20).unwrap_err();
            assert!(e.contains("FAT volume label"), "{bad}: {e}");
        }
        for bad in ["a/b", "", "..", "x\ny"] {
            let e = check(&drive("CIDATA", &[(bad, b"x")]), 4 << 20).unwrap_err();
            assert!(e.contains("file name"), "{bad:?}: {e}");
        }
        let big = vec![0u8; 1 << 20];
        let e = check(&drive("CIDATA", &[("user-data", &big)]), 1 << 20).unwrap_err();
        assert!(e.contains("raise the config drive's size"), "{e}");
        check(
            &drive("CIDATA", &[("user-data", b"#cloud-config\n")]),
            1 << 20,
        )
        .unwrap();
    }

    #[test]
    fn files_come_back_under_their_long_names() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(6 << 20).unwrap();
        let cd = drive(
            "CIDATA",
            &[("user-data", b"#cloud-config\n"), ("meta-data", b"")],
        );
        let w = write(&f, 1 << 20, 4 << 20, &cd).unwrap();
        assert_eq!(w.fat_type, "FAT12"); // under 4085 clusters of 1 KiB
        let fs = fatfs::FileSystem::new(Window::new(&f, 1 << 20, 4 << 20), fatfs::FsOptions::new())
            .unwrap();
        let names: Vec<String> = fs
            .root_dir()
            .iter()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["meta-data", "user-data"]);
        let mut got = Vec::new();
        io::Read::read_to_end(&mut fs.root_dir().open_file("user-data").unwrap(), &mut got)
            .unwrap();
        assert_eq!(got, b"#cloud-config\n");
        assert_eq!(fs.volume_label(), "CIDATA");
        let s = summary(&cd, 4 << 20, &w);
        assert!(
            s.contains("user-data (14 bytes)") && !s.contains("cloud-config"),
            "{s}"
        );
    }
}
