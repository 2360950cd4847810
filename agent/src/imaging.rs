//! `capture` and `restore` subcommands over the `anneal-image` library.

use anneal_image::capture::{self, Options};
use anneal_image::restore::{self, Content, RestoreOptions, Target};
use anyhow::Context as _;
use clap::{Args, ValueEnum};
use std::io::Read as _;
use std::path::{Path, PathBuf};

/// Kind of capture source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SourceFormat {
    /// Detect from the path and magic bytes.
    Auto,
    /// A raw disk image with a GPT or MBR partition table.
    Raw,
    /// A qcow2 disk image (read natively; backing files, external data
    /// files and encryption are refused).
    Qcow2,
    /// A single partclone image (plain, gzip, zstd; split parts `.aa`...).
    Partclone,
    /// A Clonezilla image directory.
    Clonezilla,
    /// A single partition (filesystem image) without a partition table.
    Partition,
}

/// Arguments of `anneal-agent capture`.
#[derive(Debug, Args)]
pub struct CaptureArgs {
    /// Source: disk image, qcow2, partclone image, Clonezilla directory or
    /// partition image.
    pub source: PathBuf,
    /// Output directory (layout.json, <name>.index, <name>.stream).
    #[arg(long, short)]
    pub out: PathBuf,
    /// Source format.
    #[arg(long, value_enum, default_value = "auto")]
    pub format: SourceFormat,
    /// Piece length in bytes (power of two, 16 KiB..64 MiB).
    #[arg(long, default_value_t = anneal_image::format::DEFAULT_PIECE_LENGTH)]
    pub piece_length: u32,
    /// Content name for single-partition sources.
    #[arg(long, default_value = "p1")]
    pub name: String,
    /// Scratch file for the raw conversion of a qcow2 image.
    #[arg(long)]
    pub scratch: Option<PathBuf>,
}

/// Arguments of `anneal-agent restore`.
#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// Target block device or file.
    pub target: PathBuf,
    /// Capture directory holding layout.json and the contents.
    #[arg(long)]
    pub from: PathBuf,
    /// Restore only this content (partition-level, at --offset), no table.
    #[arg(long)]
    pub content: Option<String>,
    /// Byte offset of the partition for --content.
    #[arg(long, default_value_t = 0)]
    pub offset: u64,
    /// Grow the last partition to the end of the target.
    #[arg(long)]
    pub grow: bool,
    /// Create or extend a regular-file target to this many bytes.
    #[arg(long)]
    pub size: Option<u64>,
}

fn detect(path: &Path) -> anyhow::Result<SourceFormat> {
    if path.is_dir() {
        return Ok(SourceFormat::Clonezilla);
    }
    if path.to_string_lossy().ends_with(".aa") {
        return Ok(SourceFormat::Partclone);
    }
    let mut magic = [0u8; 16];
    let n = std::fs::File::open(path)
        .with_context(|| format!("opening {}", path.display()))?
        .read(&mut magic)?;
    let m = &magic[..n];
    Ok(if m.starts_with(b"QFI\xfb") {
        SourceFormat::Qcow2
    } else if m.starts_with(b"partclone-image")
        || m.starts_with(&[0x1f, 0x8b])
        || m.starts_with(&[0x28, 0xb5, 0x2f, 0xfd])
    {
        SourceFormat::Partclone
    } else {
        SourceFormat::Raw
    })
}

/// Runs `capture`.
pub fn capture(args: &CaptureArgs) -> anyhow::Result<()> {
    let opts = Options {
        piece_length: args.piece_length,
    };
    let format = match args.format {
        SourceFormat::Auto => detect(&args.source)?,
        f => f,
    };
    tracing::info!(source = %args.source.display(), ?format, "capture");
    let out = &args.out;
    let report = match format {
        SourceFormat::Raw | SourceFormat::Auto => {
            capture::capture_disk(&args.source, out, opts)?.to_json()
        }
        SourceFormat::Qcow2 => {
            let scratch = args
                .scratch
                .clone()
                .unwrap_or_else(|| out.join("qcow2-scratch.raw"));
            std::fs::create_dir_all(out)?;
            capture::capture_qcow2(&args.source, &scratch, out, opts)?.to_json()
        }
        SourceFormat::Clonezilla => capture::capture_clonezilla(&args.source, out, opts)?.to_json(),
        SourceFormat::Partclone => {
            let (idx, _) = capture::capture_partclone_file(&args.source, out, &args.name, opts)?;
            idx.summary_json(&args.name)
        }
        SourceFormat::Partition => {
            std::fs::create_dir_all(out)?;
            let f = std::fs::File::open(&args.source)
                .with_context(|| format!("opening {}", args.source.display()))?;
            let len = f.metadata()?.len();
            let (ip, sp) = capture::content_paths(out, &args.name);
            let (idx, _) = capture::capture_region(&f, 0, len, &ip, &sp, opts)?;
            idx.summary_json(&args.name)
        }
    };
    println!("{report}");
    Ok(())
}

/// Runs `restore`.
pub fn restore(args: &RestoreArgs) -> anyhow::Result<()> {
    if let Some(name) = &args.content {
        let (ip, sp) = capture::content_paths(&args.from, name);
        let content = Content::load(name, &ip, &sp)?;
        let need = args.offset + content.index.header.partition_size;
        let mut target = Target::open(&args.target, Some(args.size.unwrap_or(0).max(need)))?;
        restore::restore_partition(&mut target, args.offset, &content)?;
        tracing::info!(content = %name, bytes = content.index.header.used_bytes, "restored");
        return Ok(());
    }
    let opts = RestoreOptions {
        grow_last: args.grow,
        target_size: args.size,
    };
    restore::restore_image(&args.from, &args.target, &opts)?;
    tracing::info!(target = %args.target.display(), "restored");
    Ok(())
}
