//! The content store on disk and `anneal-agent store verify|remove`.
//!
//! Layout: `<store>/<namespace>/<content>/{index,stream,verified}`,
//! `<store>/<namespace>/.imports/<import>/layout.json`,
//! `<store>/<namespace>/.staged/<name>` (uploads), and
//! `<store>/.staging/<namespace>/<import>-<random>/` (ingest work dirs).
//! `verified` holds the stream SHA-256 (hex and a newline) and is written
//! only by `verify`; the content server serves only verified contents.

use std::fs::File;
use std::io::{self, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anneal_image::ContentIndex;
use clap::{Args, Subcommand};
use sha1::Digest as _;

use crate::jsonl::{Failure, Out, Ticker, chain};

/// Largest index file read (an index of a multi-TiB partition is a few MiB).
pub const MAX_INDEX_BYTES: u64 = 1 << 30;
/// The marker written by a successful verify.
pub const VERIFIED: &str = "verified";

/// True for a DNS-1123 subdomain: lowercase alphanumerics, `-` and `.`,
/// at most 253, starting and ending alphanumeric, no `..`.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
        && !s.contains("..")
}

/// Checks every `(what, name)` before anything touches the filesystem.
pub fn check_names(names: &[(&str, &str)]) -> Result<(), Failure> {
    for (what, n) in names {
        if !valid_name(n) {
            return Err(Failure::new(
                "StoreError",
                format!(
                    "{what} {n:?} is not a DNS-1123 name (lowercase alphanumerics, '-', '.', at most 253)"
                ),
            ));
        }
    }
    Ok(())
}

/// Directory of content `name` in namespace `ns`.
pub fn content_dir(store: &Path, ns: &str, name: &str) -> PathBuf {
    store.join(ns).join(name)
}

/// `anneal-agent store ...`.
#[derive(Debug, Args)]
pub struct StoreArgs {
    #[command(subcommand)]
    command: StoreCommand,
}

#[derive(Debug, Subcommand)]
enum StoreCommand {
    /// Check every piece and the stream SHA-256 of a content against its
    /// index; write the `verified` marker on success.
    Verify(ContentArgs),
    /// Delete a content (a missing content is success).
    Remove(ContentArgs),
}

#[derive(Debug, Args)]
struct ContentArgs {
    /// The content store root.
    #[arg(long)]
    store: PathBuf,
    /// Namespace.
    #[arg(long)]
    namespace: String,
    /// Content name.
    #[arg(long)]
    content: String,
}

/// Runs `store verify|remove`, printing the protocol lines; false on failure.
pub fn run(args: &StoreArgs) -> bool {
    let out = Out::new();
    let r = match &args.command {
        StoreCommand::Verify(a) => verify(&a.store, &a.namespace, &a.content, &out),
        StoreCommand::Remove(a) => remove(&a.store, &a.namespace, &a.content),
    };
    match r {
        Ok(v) => {
            out.line(&v);
            true
        }
        Err(f) => {
            tracing::error!(reason = f.reason, message = %f.message, "store");
            out.error(&f);
            false
        }
    }
}

/// Deletes `<store>/<ns>/<name>/`.
pub fn remove(store: &Path, ns: &str, name: &str) -> Result<serde_json::Value, Failure> {
    check_names(&[("namespace", ns), ("content", name)])?;
    let dir = content_dir(store, ns, name);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(serde_json::json!({ "event": "result" })),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Ok(serde_json::json!({ "event": "result" }))
        }
        Err(e) => Err(Failure::new(
            "StoreError",
            format!("removing {}: {e}", dir.display()),
        )),
    }
}

fn read_index(path: &Path, name: &str) -> Result<(Vec<u8>, ContentIndex), Failure> {
    let f = File::open(path).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            Failure::new("Missing", format!("{name}: no index at {}", path.display()))
        } else {
            Failure::new("StoreError", format!("opening {}: {e}", path.display()))
        }
    })?;
    let mut raw = Vec::new();
    f.take(MAX_INDEX_BYTES + 1)
        .read_to_end(&mut raw)
        .map_err(|e| Failure::new("StoreError", format!("reading {}: {e}", path.display())))?;
    if raw.len() as u64 > MAX_INDEX_BYTES {
        return Err(Failure::new(
            "InvalidIndex",
            format!("index of {name} is larger than {MAX_INDEX_BYTES} bytes"),
        ));
    }
    let idx = ContentIndex::parse(&raw)
        .map_err(|e| Failure::new("InvalidIndex", format!("index of {name}: {}", chain(&e))))?;
    Ok((raw, idx))
}

/// Verifies `<store>/<ns>/<name>/stream` against its index and writes the
/// `verified` marker.
pub fn verify(store: &Path, ns: &str, name: &str, out: &Out) -> Result<serde_json::Value, Failure> {
    check_names(&[("namespace", ns), ("content", name)])?;
    let dir = content_dir(store, ns, name);
    if !dir.is_dir() {
        return Err(Failure::new(
            "Missing",
            format!("content {ns}/{name} does not exist ({})", dir.display()),
        ));
    }
    let marker = dir.join(VERIFIED);
    // a failed verify must leave no marker behind, even an old one
    match std::fs::remove_file(&marker) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(Failure::new(
                "StoreError",
                format!("removing {}: {e}", marker.display()),
            ));
        }
    }
    let (raw, idx) = read_index(&dir.join("index"), name)?;
    let index_sha = hex::encode(sha2::Sha256::digest(&raw));
    let stream_path = dir.join("stream");
    let mut stream = File::open(&stream_path).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            Failure::new(
                "Missing",
                format!("{name}: no stream at {}", stream_path.display()),
            )
        } else {
            Failure::new(
                "StoreError",
                format!("opening {}: {e}", stream_path.display()),
            )
        }
    })?;
    let used = idx.header.used_bytes;
    let len = stream
        .metadata()
        .map_err(|e| Failure::new("StoreError", format!("{}: {e}", stream_path.display())))?
        .len();
    if len != used {
        return Err(Failure::new(
            "PieceMismatch",
            format!("stream of {name} is {len} bytes, its index says usedBytes {used}"),
        ));
    }
    let done = Arc::new(AtomicU64::new(0));
    let ticker = {
        let done = done.clone();
        out.line(&progress(0, used));
        Ticker::start(out.clone(), Duration::from_millis(500), move || {
            progress(done.load(Ordering::Relaxed), used)
        })
    };
    let mut whole = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let pieces = idx.piece_count();
    for i in 0..pieces {
        let mut left = idx.piece_len(i);
        let mut h = sha1::Sha1::new();
        while left > 0 {
            let n = (buf.len() as u64).min(left) as usize;
            stream.read_exact(&mut buf[..n]).map_err(|e| {
                Failure::new(
                    "StoreError",
                    format!(
                        "reading piece {i} of {name} from {}: {e}",
                        stream_path.display()
                    ),
                )
            })?;
            h.update(&buf[..n]);
            whole.update(&buf[..n]);
            left -= n as u64;
            done.fetch_add(n as u64, Ordering::Relaxed);
        }
        let got: [u8; 20] = h.finalize().into();
        let want = idx
            .piece_hashes
            .get(i as usize)
            .copied()
            .unwrap_or_default();
        if got != want {
            return Err(Failure::new(
                "PieceMismatch",
                format!(
                    "piece {i} of {name}: sha1 {} does not match the index ({})",
                    hex::encode(got),
                    hex::encode(want)
                ),
            ));
        }
    }
    let sha: [u8; 32] = whole.finalize().into();
    if sha != idx.header.stream_sha256 {
        return Err(Failure::new(
            "PieceMismatch",
            format!(
                "stream of {name}: sha256 {} does not match the index header ({})",
                hex::encode(sha),
                idx.stream_sha256_hex()
            ),
        ));
    }
    drop(ticker);
    out.line(&progress(used, used));
    let hexsha = hex::encode(sha);
    write_atomic(&marker, format!("{hexsha}\n").as_bytes())
        .map_err(|e| Failure::new("StoreError", format!("writing {}: {e}", marker.display())))?;
    Ok(serde_json::json!({
        "event": "result",
        "sha256": hexsha,
        "indexSha256": index_sha,
        "infoHash": anneal_image::torrent::Metainfo::from_index(&idx, name, None).info_hash_hex(),
        "pieces": pieces,
        "usedBytes": used,
    }))
}

fn progress(done: u64, total: u64) -> serde_json::Value {
    serde_json::json!({
        "event": "progress",
        "phase": "Verifying",
        "bytesDone": done,
        "bytesTotal": total,
    })
}

/// Writes `data` to `path` through a temporary file in the same directory,
/// fsynced, then renamed over `path`.
pub fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp-{:016x}",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        rand::random::<u64>()
    ));
    let r = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["a", "lab", "ubuntu-24.04-p1", "x.y", "0abc"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in [
            "",
            ".x",
            "x.",
            "-x",
            "x-",
            "A",
            "a/b",
            "a..b",
            "..",
            "a_b",
            "a b",
            &"a".repeat(254),
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert!(check_names(&[("namespace", "lab"), ("content", "../x")]).is_err());
    }
}
