//! The wipe of a Recycle: discard the whole device where it supports it,
//! then zero what makes a disk look used: the first and last MiB (MBR, both
//! GPT copies) and the first and last MiB of every partition the old table
//! names (ext2/3/4 superblock at 1024, the vfat boot sector, the swap
//! signature at the page end - 10, xfs at 0, btrfs at 64 KiB, md and other
//! end-of-device labels), then sync and ask the kernel to re-read the table.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek as _, SeekFrom};
use std::os::unix::fs::{FileExt as _, FileTypeExt as _};
use std::path::{Path, PathBuf};

use anneal_image::layout;
use serde::Serialize;

/// Zeroed at both ends of the disk and of each partition.
const EDGE: u64 = 1 << 20;

/// Why a wipe failed.
#[derive(Debug, thiserror::Error)]
pub enum WipeError {
    /// Opening or sizing the disk.
    #[error("wipe of {path}: {what}; check the device exists and is not in use")]
    Open {
        /// the disk
        path: PathBuf,
        /// what failed
        what: &'static str,
        /// cause
        #[source]
        source: io::Error,
    },
    /// Zeroing a range failed.
    #[error("wipe of {path}: zeroing bytes {start}..{end} failed")]
    Zero {
        /// the disk
        path: PathBuf,
        /// first byte
        start: u64,
        /// end byte
        end: u64,
        /// cause
        #[source]
        source: io::Error,
    },
    /// The final flush failed.
    #[error("wipe of {path}: flushing failed")]
    Sync {
        /// the disk
        path: PathBuf,
        /// cause
        #[source]
        source: io::Error,
    },
}

/// What a wipe did.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WipeReport {
    /// The disk's size.
    pub size_bytes: u64,
    /// Whether the whole device was discarded.
    pub discarded: bool,
    /// Why not, when the device claims discard support but it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discard_error: Option<String>,
    /// Partitions of the old table whose edges were zeroed.
    pub partitions: usize,
    /// Ranges zeroed.
    pub zeroed_ranges: usize,
    /// Whether the kernel re-read the (now empty) table.
    pub reread: bool,
}

/// Wipes `disk` (a block device, or a regular file in tests).
pub fn wipe(disk: &Path) -> Result<WipeReport, WipeError> {
    let open = |what, source| WipeError::Open {
        path: disk.to_owned(),
        what,
        source,
    };
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(disk)
        .map_err(|e| open("opening", e))?;
    let blk = f
        .metadata()
        .map_err(|e| open("inspecting", e))?
        .file_type()
        .is_block_device();
    let size = f.seek(SeekFrom::End(0)).map_err(|e| open("sizing", e))?;
    let mut rep = WipeReport {
        size_bytes: size,
        ..WipeReport::default()
    };
    // the old table's partitions, before anything is zeroed
    let parts: Vec<(u64, u64)> = match layout::read_layout(&mut f) {
        Ok(l) => l
            .slots
            .iter()
            .map(|s| (s.start_bytes, s.size_bytes))
            .collect(),
        Err(_) => Vec::new(),
    };
    rep.partitions = parts.len();
    if blk && discard_supported(disk) {
        match sys::discard(&f, 0, size) {
            Ok(()) => rep.discarded = true,
            Err(e) => {
                tracing::warn!(disk = %disk.display(), error = %e, "discard failed; zeroing instead");
                rep.discard_error = Some(e.to_string());
            }
        }
    }
    // discarded blocks need not read as zeros: zero the signatures anyway
    let mut ranges = vec![(0, EDGE.min(size)), (size.saturating_sub(EDGE), size)];
    // a filesystem on the whole disk (no table) starts at 0 too
    for (start, len) in parts {
        let end = start.saturating_add(len).min(size);
        if start >= end {
            continue;
        }
        ranges.push((start, (start + EDGE).min(end)));
        ranges.push((end.saturating_sub(EDGE).max(start), end));
    }
    ranges.sort_unstable();
    ranges.dedup();
    let zeros = vec![0u8; EDGE as usize];
    for (start, end) in ranges {
        let mut pos = start;
        while pos < end {
            let n = (end - pos).min(EDGE) as usize;
            f.write_all_at(&zeros[..n], pos)
                .map_err(|source| WipeError::Zero {
                    path: disk.to_owned(),
                    start,
                    end,
                    source,
                })?;
            pos += n as u64;
        }
        rep.zeroed_ranges += 1;
    }
    f.sync_all().map_err(|source| WipeError::Sync {
        path: disk.to_owned(),
        source,
    })?;
    if blk {
        match reread_partitions(&f) {
            Ok(()) => rep.reread = true,
            Err(e) => {
                tracing::warn!(disk = %disk.display(), error = %e, "re-reading the partition table failed")
            }
        }
    }
    tracing::info!(disk = %disk.display(), discarded = rep.discarded, ranges = rep.zeroed_ranges, "disk wiped");
    Ok(rep)
}

/// `queue/discard_max_bytes` of the disk is not zero.
fn discard_supported(disk: &Path) -> bool {
    let real = std::fs::canonicalize(disk).unwrap_or_else(|_| disk.to_owned());
    let Some(name) = real.file_name() else {
        return false;
    };
    let p = Path::new("/sys/class/block")
        .join(name)
        .join("queue/discard_max_bytes");
    std::fs::read_to_string(p)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .is_some_and(|n| n > 0)
}

/// BLKRRPART on a whole-disk block device.
pub(super) fn reread_partitions(f: &File) -> io::Result<()> {
    sys::rrpart(f)
}

/// The two block-device ioctls, the only unsafe code of the agent: both
/// take a descriptor this module opened and (for discard) a two-element
/// array that lives across the call.
#[allow(unsafe_code)]
mod sys {
    use std::fs::File;
    use std::io;
    use std::os::fd::AsRawFd as _;

    nix::ioctl_none_bad!(blkrrpart, 0x125f);
    nix::ioctl_write_ptr_bad!(blkdiscard, 0x1277, [u64; 2]);

    /// BLKRRPART.
    pub(super) fn rrpart(f: &File) -> io::Result<()> {
        // SAFETY: BLKRRPART takes no argument; the descriptor is open.
        unsafe { blkrrpart(f.as_raw_fd()) }
            .map(|_| ())
            .map_err(io::Error::from)
    }

    /// BLKDISCARD of `[start, start+len)`.
    pub(super) fn discard(f: &File, start: u64, len: u64) -> io::Result<()> {
        let range = [start, len];
        // SAFETY: BLKDISCARD reads two u64 from the pointer, which points to
        // `range` for the duration of the call; the descriptor is open.
        unsafe { blkdiscard(f.as_raw_fd(), &range) }
            .map(|_| ())
            .map_err(io::Error::from)
    }
}
