//! `growLastPartition`: grows the last partition to the end of the disk
//! (GPT: entry, primary and backup headers and the protective MBR; MBR: the
//! last primary) or, when the disk carries a cloud-init config drive (GPT: a
//! partition named `config-drive`; either table: the partition the plan
//! names), the last partition before the drive up to the drive's start, the
//! drive left as it is; and then its file system: ext2/3/4 with `e2fsck -fy` and
//! `resize2fs` from the live environment (run on `<disk>?offset=<bytes>`, so
//! no partition device node or kernel re-read is needed), swap by rewriting
//! its header with the same UUID and label. Other file systems are left to the
//! deployed OS (logged).

use super::Context;
use anneal_api::agent::CONFIG_DRIVE_PART_NAME;
use anneal_image::fs::FileRegion;
use anneal_image::layout::{self, TableKind};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Errors of `growLastPartition`.
#[derive(Debug, thiserror::Error)]
pub enum GrowError {
    /// Opening or sizing the target.
    #[error("cannot open {disk}")]
    Open {
        /// target
        disk: PathBuf,
        /// cause
        #[source]
        source: io::Error,
    },
    /// Reading the table.
    #[error("cannot read the partition table of {disk}")]
    Table {
        /// target
        disk: PathBuf,
        /// cause
        #[source]
        source: layout::LayoutError,
    },
    /// gptman refused.
    #[error("cannot rewrite the GPT of {disk}")]
    Gpt {
        /// target
        disk: PathBuf,
        /// cause
        #[source]
        source: gptman::Error,
    },
    /// mbrman refused.
    #[error("cannot rewrite the MBR of {disk}")]
    Mbr {
        /// target
        disk: PathBuf,
        /// cause
        #[source]
        source: mbrman::Error,
    },
    /// No partition at all.
    #[error("{0} has no partition to grow")]
    Empty(PathBuf),
    /// A tool is missing from the live environment.
    #[error(
        "{tool} not found on PATH ({path}): the initramfs must carry e2fsprogs' {tool} to grow ext file systems"
    )]
    MissingTool {
        /// e2fsck or resize2fs
        tool: &'static str,
        /// the PATH searched
        path: String,
    },
    /// A tool failed.
    #[error("{tool} on partition {slot} of {disk} failed ({status}): {output}")]
    Tool {
        /// e2fsck or resize2fs
        tool: &'static str,
        /// partition number
        slot: u32,
        /// target
        disk: PathBuf,
        /// exit status
        status: String,
        /// its output tail
        output: String,
    },
    /// Running a tool.
    #[error("cannot run {tool}")]
    Spawn {
        /// e2fsck or resize2fs
        tool: &'static str,
        /// cause
        #[source]
        source: io::Error,
    },
    /// Rewriting a swap header.
    #[error("cannot rewrite the swap header of partition {slot} on {disk}")]
    Swap {
        /// partition number
        slot: u32,
        /// target
        disk: PathBuf,
        /// cause
        #[source]
        source: io::Error,
    },
}

/// The last partition, as grown: number, start and size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grown {
    /// The config drive the grow stopped at: its offset and length in bytes.
    pub config_drive: Option<(u64, u64)>,
    /// Partition number.
    pub number: u32,
    /// Offset in bytes.
    pub start: u64,
    /// Old size in bytes.
    pub old_size: u64,
    /// New size in bytes.
    pub new_size: u64,
}

/// One used partition: number, first and last sector (inclusive), whether
/// it is the config drive.
type Entry = (u32, u64, u64, bool);

/// The partition to grow and the last sector it may end on: the one ending
/// last before the config drive (up to the sector before it) when there is
/// a drive, else the one ending last (up to `last_usable`). Also the drive's
/// first and last sector.
#[allow(clippy::type_complexity)]
fn pick(entries: &[Entry], last_usable: u64) -> Option<(Entry, u64, Option<(u64, u64)>)> {
    let drive = entries
        .iter()
        .filter(|e| e.3)
        .min_by_key(|e| e.1)
        .map(|e| (e.1, e.2));
    let limit = drive.map_or(last_usable, |(start, _)| start.saturating_sub(1));
    let grow = entries
        .iter()
        .filter(|e| !e.3 && (drive.is_none() || e.2 <= limit))
        .max_by_key(|e| e.2)?;
    Some((*grow, limit.max(grow.2), drive))
}

/// Grows the last partition in the table of `disk` to the end of the disk,
/// or the last one before the config drive (a GPT partition named
/// [`CONFIG_DRIVE_PART_NAME`], or partition `config_drive`) up to its start.
pub fn grow_table(disk: &Path, config_drive: Option<u32>) -> Result<Grown, GrowError> {
    let open_err = |source| GrowError::Open {
        disk: disk.to_path_buf(),
        source,
    };
    let mut f = super::open_rw(disk).map_err(open_err)?;
    let l = layout::read_layout(&mut f).map_err(|source| GrowError::Table {
        disk: disk.to_path_buf(),
        source,
    })?;
    let disk_size = f.seek(SeekFrom::End(0)).map_err(open_err)?;
    let empty = || GrowError::Empty(disk.to_path_buf());
    let grown = match l.partition_table {
        TableKind::Gpt => {
            let gpt_err = |source| GrowError::Gpt {
                disk: disk.to_path_buf(),
                source,
            };
            let mut gpt = gptman::GPT::read_from(&mut f, l.sector_size).map_err(gpt_err)?;
            let ss = gpt.sector_size;
            gpt.header.update_from(&mut f, ss).map_err(gpt_err)?;
            let entries: Vec<Entry> = gpt
                .iter()
                .filter(|(_, e)| e.is_used())
                .map(|(n, e)| {
                    let cd = e.partition_name.as_str() == CONFIG_DRIVE_PART_NAME
                        || config_drive == Some(n);
                    (n, e.starting_lba, e.ending_lba, cd)
                })
                .collect();
            let ((number, start, old_end, _), new_end, drive) =
                pick(&entries, gpt.header.last_usable_lba).ok_or_else(empty)?;
            gpt[number].ending_lba = new_end;
            gpt.write_into(&mut f).map_err(gpt_err)?;
            gptman::GPT::write_protective_mbr_into(&mut f, ss).map_err(gpt_err)?;
            Grown {
                config_drive: drive.map(|(a, b)| (a * ss, (b - a + 1) * ss)),
                number,
                start: start * ss,
                old_size: (old_end - start + 1) * ss,
                new_size: (new_end - start + 1) * ss,
            }
        }
        TableKind::Mbr => {
            let mbr_err = |source| GrowError::Mbr {
                disk: disk.to_path_buf(),
                source,
            };
            let mut mbr = mbrman::MBR::read_from(&mut f, 512).map_err(mbr_err)?;
            let entries: Vec<Entry> = mbr
                .iter()
                .filter(|(_, e)| e.is_used() && e.sectors > 0)
                .map(|(n, e)| {
                    let n = u32::try_from(n).unwrap_or(u32::MAX);
                    let first = u64::from(e.starting_lba);
                    (
                        n,
                        first,
                        first + u64::from(e.sectors) - 1,
                        config_drive == Some(n),
                    )
                })
                .collect();
            let end = (disk_size / 512).min(u64::from(u32::MAX));
            let ((number, start, old_last, _), new_last, drive) =
                pick(&entries, end.saturating_sub(1)).ok_or_else(empty)?;
            let new_sectors = u32::try_from(new_last + 1 - start).unwrap_or(u32::MAX);
            mbr[number as usize].sectors = new_sectors;
            mbr.write_into(&mut f).map_err(mbr_err)?;
            Grown {
                config_drive: drive.map(|(a, b)| (a * 512, (b - a + 1) * 512)),
                number,
                start: start * 512,
                old_size: (old_last + 1 - start) * 512,
                new_size: u64::from(new_sectors) * 512,
            }
        }
    };
    f.sync_all().map_err(open_err)?;
    Ok(grown)
}

fn find_tool(tool: &'static str, path: &str) -> Result<PathBuf, GrowError> {
    std::env::split_paths(path)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
        .ok_or_else(|| GrowError::MissingTool {
            tool,
            path: path.to_string(),
        })
}

fn tail(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

fn run_tool(
    tool: &'static str,
    args: &[String],
    ok_codes: &[i32],
    slot: u32,
    disk: &Path,
    path: &str,
    log: &mut dyn FnMut(&str),
) -> Result<(), GrowError> {
    let exe = find_tool(tool, path)?;
    log(&format!("growLastPartition: {tool} {}", args.join(" ")));
    let out = Command::new(&exe)
        .args(args)
        .env("PATH", path)
        .output()
        .map_err(|source| GrowError::Spawn { tool, source })?;
    let mut both = out.stdout.clone();
    both.extend_from_slice(&out.stderr);
    for l in String::from_utf8_lossy(&both).lines() {
        log(&format!("{tool}: {l}"));
    }
    match out.status.code() {
        Some(c) if ok_codes.contains(&c) => Ok(()),
        _ => Err(GrowError::Tool {
            tool,
            slot,
            disk: disk.to_path_buf(),
            status: out.status.to_string(),
            output: tail(&both),
        }),
    }
}

/// Grows the last partition and its file system.
pub fn run(ctx: &Context, log: &mut dyn FnMut(&str)) -> Result<(), GrowError> {
    let g = grow_table(&ctx.os_disk, ctx.config_drive)?;
    // resize2fs truncates a regular file to the file system's size, ignoring
    // `?offset=` (it cuts the backup GPT of a disk image): remember the length
    // to restore it (and the backup table) afterwards. Block devices are not
    // affected.
    let file_len = std::fs::metadata(&ctx.os_disk)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len());
    log(&format!(
        "growLastPartition: partition {} {} -> {} bytes",
        g.number, g.old_size, g.new_size
    ));
    if let Some((at, len)) = g.config_drive {
        log(&format!(
            "growLastPartition: stopped before the config drive at byte {at} ({len} bytes)"
        ));
    }
    let disk = std::fs::File::open(&ctx.os_disk).map_err(|source| GrowError::Open {
        disk: ctx.os_disk.clone(),
        source,
    })?;
    let region = FileRegion {
        file: &disk,
        start: g.start,
        len: g.new_size,
    };
    let info = anneal_image::fs::probe(&region);
    let path = ctx
        .tool_path
        .clone()
        .or_else(|| std::env::var("PATH").ok())
        .unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    match info.fs_type.as_str() {
        "ext2" | "ext3" | "ext4" => grow_ext(ctx, &g, file_len, &path, log)?,
        "swap" => {
            drop(disk);
            let f = super::open_rw(&ctx.os_disk).map_err(|source| GrowError::Open {
                disk: ctx.os_disk.clone(),
                source,
            })?;
            let page = anneal_image::fs::swap_header(g.new_size, &info.uuid, &info.label);
            f.write_all_at(&page, g.start)
                .and_then(|()| f.sync_all())
                .map_err(|source| GrowError::Swap {
                    slot: g.number,
                    disk: ctx.os_disk.clone(),
                    source,
                })?;
            log("growLastPartition: swap header rewritten for the new size");
        }
        other => log(&format!(
            "growLastPartition: file system {other:?} on partition {} is not grown offline by the agent (ext2/3/4 and swap are); grow it from the deployed OS",
            g.number
        )),
    }
    reread_partitions(&ctx.os_disk, &path, log);
    Ok(())
}

/// `e2fsck -fy` and `resize2fs` on the grown partition. On a regular file
/// (which resize2fs truncates) the file's length, the config drive's bytes
/// and the backup GPT are put back afterwards.
fn grow_ext(
    ctx: &Context,
    g: &Grown,
    file_len: Option<u64>,
    path: &str,
    log: &mut dyn FnMut(&str),
) -> Result<(), GrowError> {
    let open_err = |source| GrowError::Open {
        disk: ctx.os_disk.clone(),
        source,
    };
    // the config drive's bytes, kept in memory while resize2fs runs (it is
    // a few MiB)
    let saved = match (file_len, g.config_drive) {
        (Some(_), Some((at, len))) => {
            let mut b = vec![0u8; usize::try_from(len).unwrap_or(usize::MAX)];
            let f = std::fs::File::open(&ctx.os_disk).map_err(open_err)?;
            f.read_exact_at(&mut b, at).map_err(open_err)?;
            Some((at, b))
        }
        _ => None,
    };
    let dev = format!("{}?offset={}", ctx.os_disk.display(), g.start);
    // e2fsck: 0 clean, 1 errors corrected, 2 corrected (reboot advised).
    run_tool(
        "e2fsck",
        &["-fy".into(), dev.clone()],
        &[0, 1, 2],
        g.number,
        &ctx.os_disk,
        path,
        log,
    )?;
    run_tool(
        "resize2fs",
        &["-f".into(), dev, format!("{}s", g.new_size / 512)],
        &[0],
        g.number,
        &ctx.os_disk,
        path,
        log,
    )?;
    let Some(len) = file_len else {
        return Ok(());
    };
    let f = super::open_rw(&ctx.os_disk).map_err(open_err)?;
    if f.metadata().map(|m| m.len()).unwrap_or(len) == len {
        return Ok(());
    }
    f.set_len(len).map_err(open_err)?;
    if let Some((at, bytes)) = &saved {
        f.write_all_at(bytes, *at).map_err(open_err)?;
        log("growLastPartition: the config drive's bytes put back after resize2fs");
    }
    f.sync_all().map_err(open_err)?;
    drop(f);
    grow_table(&ctx.os_disk, ctx.config_drive)?;
    Ok(())
}

/// Asks the kernel to re-read the table of a block device (`blockdev
/// --rereadpt`, busybox has it) so later steps see the grown partition's
/// device at its new size. Best effort: a failure is logged, the disk itself
/// is already right.
fn reread_partitions(disk: &Path, path: &str, log: &mut dyn FnMut(&str)) {
    use std::os::unix::fs::FileTypeExt as _;
    let is_block = std::fs::metadata(disk).is_ok_and(|m| m.file_type().is_block_device());
    if !is_block {
        return;
    }
    let Ok(exe) = find_tool("blockdev", path) else {
        log(
            "growLastPartition: no blockdev on PATH, the kernel keeps the old partition size until reboot",
        );
        return;
    };
    match Command::new(exe).arg("--rereadpt").arg(disk).output() {
        Ok(o) if o.status.success() => log("growLastPartition: kernel re-read the partition table"),
        Ok(o) => log(&format!(
            "growLastPartition: blockdev --rereadpt failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => log(&format!("growLastPartition: blockdev --rereadpt: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grow_stops_before_the_config_drive() {
        // esp, root, config drive at the end
        let e = [
            (1, 2048, 10_239, false),
            (2, 10_240, 40_959, false),
            (3, 120_832, 131_038, true),
        ];
        let (g, end, drive) = pick(&e, 131_038).unwrap();
        assert_eq!(g.0, 2);
        assert_eq!(end, 120_831);
        assert_eq!(drive, Some((120_832, 131_038)));
        // without a drive: the partition ending last, to the last usable sector
        let plain = [e[0], e[1], (3, 120_832, 131_038, false)];
        let (g, end, drive) = pick(&plain, 131_038).unwrap();
        assert_eq!((g.0, end, drive), (3, 131_038, None));
        // a root already up to the drive stays
        let full = [e[0], (2, 10_240, 120_831, false), e[2]];
        let (g, end, _) = pick(&full, 131_038).unwrap();
        assert_eq!((g.0, end), (2, 120_831));
        // only a drive: nothing to grow
        assert!(pick(&e[2..], 131_038).is_none());
    }
}
