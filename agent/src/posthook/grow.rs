//! `growLastPartition`: grows the last partition to the end of the disk
//! (GPT: entry, primary and backup headers and the protective MBR; MBR: the
//! last primary) and then its file system: ext2/3/4 with `e2fsck -fy` and
//! `resize2fs` from the live environment (run on `<disk>?offset=<bytes>`, so
//! no partition device node or kernel re-read is needed), swap by rewriting
//! its header with the same UUID and label. Other file systems are left to the
//! deployed OS (logged).

use super::Context;
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
    /// Partition number.
    pub number: u32,
    /// Offset in bytes.
    pub start: u64,
    /// Old size in bytes.
    pub old_size: u64,
    /// New size in bytes.
    pub new_size: u64,
}

/// Grows the last partition in the table of `disk` to the end of the disk.
pub fn grow_table(disk: &Path) -> Result<Grown, GrowError> {
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
    let grown = match l.partition_table {
        TableKind::Gpt => {
            let gpt_err = |source| GrowError::Gpt {
                disk: disk.to_path_buf(),
                source,
            };
            let mut gpt = gptman::GPT::read_from(&mut f, l.sector_size).map_err(gpt_err)?;
            let ss = gpt.sector_size;
            gpt.header.update_from(&mut f, ss).map_err(gpt_err)?;
            let last_usable = gpt.header.last_usable_lba;
            let (number, start, old_end) = gpt
                .iter()
                .filter(|(_, e)| e.is_used())
                .map(|(n, e)| (n, e.starting_lba, e.ending_lba))
                .max_by_key(|(_, _, end)| *end)
                .ok_or_else(|| GrowError::Empty(disk.to_path_buf()))?;
            let new_end = last_usable.max(old_end);
            gpt[number].ending_lba = new_end;
            gpt.write_into(&mut f).map_err(gpt_err)?;
            gptman::GPT::write_protective_mbr_into(&mut f, ss).map_err(gpt_err)?;
            Grown {
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
            let (number, start, old_sectors) = mbr
                .iter()
                .filter(|(_, e)| e.is_used())
                .map(|(n, e)| (n, e.starting_lba, e.sectors))
                .max_by_key(|(_, s, n)| u64::from(*s) + u64::from(*n))
                .ok_or_else(|| GrowError::Empty(disk.to_path_buf()))?;
            let end = (disk_size / 512).min(u64::from(u32::MAX));
            let new_sectors = u32::try_from(end.saturating_sub(u64::from(start)))
                .unwrap_or(u32::MAX)
                .max(old_sectors);
            mbr[number].sectors = new_sectors;
            mbr.write_into(&mut f).map_err(mbr_err)?;
            Grown {
                number: u32::try_from(number).unwrap_or(u32::MAX),
                start: u64::from(start) * 512,
                old_size: u64::from(old_sectors) * 512,
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
    let g = grow_table(&ctx.os_disk)?;
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
        "ext2" | "ext3" | "ext4" => {
            let dev = format!("{}?offset={}", ctx.os_disk.display(), g.start);
            // e2fsck: 0 clean, 1 errors corrected, 2 corrected (reboot advised).
            run_tool(
                "e2fsck",
                &["-fy".into(), dev.clone()],
                &[0, 1, 2],
                g.number,
                &ctx.os_disk,
                &path,
                log,
            )?;
            run_tool(
                "resize2fs",
                &["-f".into(), dev, format!("{}s", g.new_size / 512)],
                &[0],
                g.number,
                &ctx.os_disk,
                &path,
                log,
            )?;
            if let Some(len) = file_len {
                let f = super::open_rw(&ctx.os_disk).map_err(|source| GrowError::Open {
                    disk: ctx.os_disk.clone(),
                    source,
                })?;
                if f.metadata().map(|m| m.len()).unwrap_or(len) != len {
                    f.set_len(len).map_err(|source| GrowError::Open {
                        disk: ctx.os_disk.clone(),
                        source,
                    })?;
                    drop(f);
                    grow_table(&ctx.os_disk)?;
                }
            }
        }
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
