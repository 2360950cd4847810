//! anneal-initramfs: builds the agent initramfs; see the library.

use std::path::PathBuf;

use anneal_initramfs::{Class, Compression, Inputs, Selection, build};
use anyhow::Context;
use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum CompressionArg {
    Zstd,
    Gzip,
    None,
}

#[derive(Debug, Parser)]
#[command(
    name = "anneal-initramfs",
    version,
    about = "Build the reproducible agent initramfs (newc cpio, zstd or gzip)"
)]
struct Cli {
    /// The static agent binary (becomes /init).
    #[arg(long)]
    agent: PathBuf,
    /// The kernel's lib/modules/<release> directory (modules.dep, kernel/).
    #[arg(long)]
    modules: Option<PathBuf>,
    /// The kernel release (default: the `version` file beside the modules
    /// directory, or its name).
    #[arg(long)]
    kernel_release: Option<String>,
    /// Driver classes (comma-separated): virtio, nvme, sata, sas, nics, fs,
    /// usb-storage; `default` is all but usb-storage.
    #[arg(long, value_delimiter = ',', default_value = "default")]
    classes: Vec<String>,
    /// Extra modules by name.
    #[arg(long = "module")]
    modules_extra: Vec<String>,
    /// Modules to leave out.
    #[arg(long)]
    exclude: Vec<String>,
    /// A firmware tree; files the packed modules declare are taken from it.
    #[arg(long)]
    firmware_dir: Option<PathBuf>,
    /// Extra firmware files relative to --firmware-dir.
    #[arg(long, requires = "firmware_dir")]
    firmware: Vec<String>,
    /// A static busybox for the debug shell.
    #[arg(long)]
    busybox: Option<PathBuf>,
    /// An extra dynamically linked program, packed at its own path with the
    /// libraries ldd lists (repeatable; e.g. /usr/sbin/e2fsck and
    /// /usr/sbin/resize2fs for the growLastPartition post-install step).
    #[arg(long = "binary")]
    binaries: Vec<PathBuf>,
    /// A foreign root (e.g. Debian arm64 packages unpacked with dpkg-deb -x)
    /// the --binary paths are read in; their interpreter and libraries are
    /// found there from the ELF headers instead of with ldd.
    #[arg(long)]
    sysroot: Option<PathBuf>,
    /// Compression.
    #[arg(long, value_enum, default_value = "zstd")]
    compression: CompressionArg,
    /// Compression level (zstd 1-19, gzip 1-9).
    #[arg(long, default_value_t = 15)]
    level: i32,
    /// Output file.
    #[arg(long, short)]
    output: PathBuf,
    /// Also write the build report as JSON here.
    #[arg(long)]
    report: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // colours only on a terminal (logs piped to files stay plain)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let mut classes = Vec::new();
    for c in &cli.classes {
        if c == "default" {
            classes.extend(Class::DEFAULT);
        } else if c == "none" {
        } else {
            classes.push(Class::parse(c).with_context(|| format!("unknown driver class {c:?}"))?);
        }
    }
    let inputs = Inputs {
        agent: cli.agent,
        modules_dir: cli.modules,
        kernel_release: cli.kernel_release,
        selection: Selection {
            classes,
            names: cli.modules_extra,
            exclude: cli.exclude,
        },
        firmware_dir: cli.firmware_dir,
        firmware: cli.firmware,
        busybox: cli.busybox,
        binaries: cli.binaries,
        sysroot: cli.sysroot,
        compression: match cli.compression {
            CompressionArg::Zstd => Compression::Zstd,
            CompressionArg::Gzip => Compression::Gzip,
            CompressionArg::None => Compression::None,
        },
        level: cli.level,
    };
    let (bytes, report) = build(&inputs)?;
    std::fs::write(&cli.output, &bytes)
        .with_context(|| format!("writing {}", cli.output.display()))?;
    if let Some(r) = &cli.report {
        std::fs::write(r, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", r.display()))?;
    }
    if !report.missing.is_empty() {
        eprintln!(
            "not in this kernel (skipped): {}",
            report.missing.join(", ")
        );
    }
    eprint!("{}", report.table());
    println!("{}", cli.output.display());
    Ok(())
}
