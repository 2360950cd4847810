//! `anneal-oci build`: a FROM-scratch image of static binaries as an OCI
//! layout archive (see the library).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "anneal-oci", about = "Reproducible FROM-scratch OCI images")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build one image; prints one JSON line (reference, digests, size).
    Build(BuildArgs),
}

#[derive(clap::Args)]
struct BuildArgs {
    /// Repository, e.g. `anneal/manager`.
    #[arg(long)]
    name: String,
    /// Tag.
    #[arg(long, default_value = "dev")]
    tag: String,
    /// OCI architecture.
    #[arg(long, default_value = "amd64")]
    arch: String,
    /// Entrypoint (repeat for its arguments).
    #[arg(long)]
    entrypoint: Vec<String>,
    /// Default arguments (repeat).
    #[arg(long)]
    cmd: Vec<String>,
    /// `KEY=value` (repeat).
    #[arg(long)]
    env: Vec<String>,
    /// `uid:gid`, numeric (empty: root).
    #[arg(long, default_value = "65532:65532")]
    user: String,
    /// `key=value` label (repeat).
    #[arg(long)]
    label: Vec<String>,
    /// `IMAGE_PATH=HOST_PATH[:MODE]` (octal mode, default 0755) (repeat).
    #[arg(long)]
    file: Vec<String>,
    /// CA roots to put at /etc/ssl/certs/ca-certificates.crt.
    #[arg(long)]
    ca_roots: Option<PathBuf>,
    /// Refuse an image larger than this (manifest, config and compressed layer).
    #[arg(long, default_value_t = 30)]
    max_size_mib: u64,
    /// The archive to write (an OCI image layout in a tar).
    #[arg(long)]
    out: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Build(a) => build(&a),
    }
}

fn build(a: &BuildArgs) -> anyhow::Result<()> {
    let mut files = Vec::new();
    for f in &a.file {
        let (at, host) = f
            .split_once('=')
            .with_context(|| format!("--file {f}: expected IMAGE_PATH=HOST_PATH[:MODE]"))?;
        let (host, mode) = match host.rsplit_once(':') {
            Some((h, m)) if !m.is_empty() && m.bytes().all(|b| (b'0'..=b'7').contains(&b)) => {
                (h, u32::from_str_radix(m, 8)?)
            }
            _ => (host, 0o755),
        };
        let data = std::fs::read(host).with_context(|| format!("--file {f}: reading {host}"))?;
        files.push(anneal_oci::File {
            path: at.trim_start_matches('/').to_string(),
            data,
            mode,
        });
    }
    if let Some(ca) = &a.ca_roots {
        let data = std::fs::read(ca).with_context(|| format!("--ca-roots {}", ca.display()))?;
        files.push(anneal_oci::File {
            path: "etc/ssl/certs/ca-certificates.crt".into(),
            data,
            mode: 0o644,
        });
    }
    let mut labels = BTreeMap::new();
    for l in &a.label {
        let (k, v) = l
            .split_once('=')
            .with_context(|| format!("--label {l}: expected key=value"))?;
        labels.insert(k.to_string(), v.to_string());
    }
    let spec = anneal_oci::ImageSpec {
        name: a.name.clone(),
        tag: a.tag.clone(),
        architecture: a.arch.clone(),
        entrypoint: a.entrypoint.clone(),
        cmd: a.cmd.clone(),
        env: a.env.clone(),
        user: a.user.clone(),
        labels,
        files,
    };
    let built = anneal_oci::build(&spec)?;
    if built.size > a.max_size_mib << 20 {
        bail!(
            "image {}: {} bytes is over --max-size-mib {}",
            built.reference,
            built.size,
            a.max_size_mib
        );
    }
    let tmp = a.out.with_extension("tmp");
    std::fs::write(&tmp, &built.archive).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &a.out).with_context(|| format!("writing {}", a.out.display()))?;
    println!(
        "{}",
        serde_json::json!({
            "image": built.reference,
            "digest": built.manifest_digest,
            "config": built.config_digest,
            "layer": built.layer_digest,
            "size": built.size,
            "archive": a.out.display().to_string(),
        })
    );
    Ok(())
}
