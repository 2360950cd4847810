//! `anneal-agent ingest`: fetch one source disk image (http, https or
//! `staged://`), capture it into contents in a staging directory, check its
//! checksum, and publish the contents into the store without ever
//! overwriting. stdout carries the JSON-lines protocol (see [`crate::jsonl`]).
//!
//! How each source is read (bounded memory: fixed buffers only):
//! - a single partclone image (plain, gzip, zstd; or `partclone.dd` output)
//!   is captured while it streams;
//! - a raw disk image is captured while it streams too, in one pass over
//!   the body: each 1 MiB chunk is read into a buffer that the [`Spool`]
//!   keeps in memory (all-zero chunks as nothing; past a 96 MiB cap, in a
//!   sparse scratch file) and a SHA-256 thread hashes, no copy in between,
//!   while `capture_disk_of` reads the partition table and then the
//!   partitions in offset order from it (used-block detection reads the
//!   filesystems' own metadata, ext bitmaps or the FAT, at offsets inside
//!   each partition; such a read waits until its bytes have arrived); the
//!   download stays within a window of the capture's reads and what the
//!   capture has read is dropped;
//! - qcow2 needs random access: it is spooled into a scratch file and
//!   converted by `capture_qcow2`;
//! - a Clonezilla image directory packed as tar is unpacked into a scratch
//!   directory (our own ustar/GNU reader: regular files and directories
//!   only, no absolute paths, no `..`) and captured by `capture_clonezilla`.
//!
//! Whatever the source, the capture writes only into the private staging
//! directory `<store>/.staging/<ns>/<import>-<random>/` (the content server
//! serves only `<store>/<ns>/<content>/`); the contents are published
//! (mkdir and rename, never overwriting) only once the whole source was read
//! and its checksum matched. Scratch and staging are removed at the end, success or
//! failure.

use std::fs::File;
use std::io::{self, Read, Write as _};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, mpsc};
use std::time::Duration;

use anneal_image::ContentIndex;
use anneal_image::capture::{self, CaptureError, Options};
use anneal_image::fs;
use anneal_image::layout::Layout;
use anneal_image::source::{self, ImageKind};
use clap::{Args, ValueEnum};
use sha2::Digest as _;

use crate::fetch::{self, FetchError, FetchOptions};
use crate::jsonl::{Failure, Out, Ticker, chain};
use crate::store::{check_names, write_atomic};

/// Source format given on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IngestFormat {
    /// A raw disk image with a GPT or MBR partition table.
    Raw,
    /// A qcow2 disk image.
    Qcow2,
    /// A single partclone image or a Clonezilla image directory as tar.
    Partclone,
}

/// Arguments of `anneal-agent ingest`.
#[derive(Debug, Args)]
pub struct IngestArgs {
    /// Source: http://, https:// or staged://NAME (`<store>/<NS>/.staged/NAME`).
    #[arg(long)]
    pub url: String,
    /// The content store root.
    #[arg(long)]
    pub store: PathBuf,
    /// Namespace of the import and its contents.
    #[arg(long)]
    pub namespace: String,
    /// The ImageImport name (names `.imports/<import>/`).
    #[arg(long)]
    pub import: String,
    /// Content prefix: partition N becomes `<prefix>-p<N>`.
    #[arg(long)]
    pub prefix: String,
    /// Expected SHA-256 of the source: `sha256:<hex>`.
    #[arg(long)]
    pub checksum: Option<String>,
    /// Source format (default: detected from the first bytes).
    #[arg(long, value_enum)]
    pub format: Option<IngestFormat>,
    /// Trust only the certificates of this PEM file for https.
    #[arg(long)]
    pub ca_bundle: Option<PathBuf>,
    /// Refuse a source larger than this many bytes.
    #[arg(long)]
    pub max_bytes: Option<u64>,
    /// Store at most this many bytes of contents (what is left of the
    /// namespace's store quota, docs/images.md "Store quota"): checked
    /// while the capture runs (every 16 MiB read) and exactly before
    /// publishing; past it the ingest ends with QuotaExceeded and publishes
    /// nothing.
    #[arg(long)]
    pub max_store_bytes: Option<u64>,
    /// Directory for scratch files (default `<store>/.staging/...`).
    #[arg(long)]
    pub scratch: Option<PathBuf>,
    /// Retries on connect errors and 5xx answers; as many resumptions of a
    /// body whose connection broke (with Range when the server supports it).
    #[arg(long, default_value_t = 3)]
    pub retries: u32,
    /// Piece length of the produced streams.
    #[arg(long, default_value_t = anneal_image::format::DEFAULT_PIECE_LENGTH)]
    pub piece_length: u32,
    /// Connect and read stall timeout, seconds.
    #[arg(long, default_value_t = 30)]
    pub timeout_secs: u64,
}

/// What the source turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Raw,
    Qcow2,
    Partclone,
    ClonezillaTar,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Raw => "raw",
            Kind::Qcow2 => "qcow2",
            Kind::Partclone => "partclone",
            Kind::ClonezillaTar => "clonezilla",
        }
    }
}

fn is_ustar(head: &[u8]) -> bool {
    head.len() >= 262 && &head[257..262] == b"ustar"
}

fn detect(head: &[u8], forced: Option<IngestFormat>) -> Kind {
    match forced {
        Some(IngestFormat::Raw) => Kind::Raw,
        Some(IngestFormat::Qcow2) => Kind::Qcow2,
        Some(IngestFormat::Partclone) if is_ustar(head) => Kind::ClonezillaTar,
        Some(IngestFormat::Partclone) => Kind::Partclone,
        None if head.starts_with(b"QFI\xfb") => Kind::Qcow2,
        None if is_ustar(head) => Kind::ClonezillaTar,
        None if head.starts_with(anneal_image::partclone::MAGIC)
            || head.starts_with(&[0x1f, 0x8b])
            || head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) =>
        {
            Kind::Partclone
        }
        None => Kind::Raw,
    }
}

/// One chunk of a read under the spool's lock: its stream offset, its
/// buffer when held in memory, and whether it is in the scratch file.
type ChunkPart = (u64, Option<Arc<Vec<u8>>>, bool);

/// What a streamed raw capture returns: the capture's result, the source's
/// SHA-256 and the stream's statistics.
type Streamed = (Result<Layout, CaptureError>, Option<[u8; 32]>, StreamStats);

const PHASES: [&str; 3] = ["Fetching", "Capturing", "Publishing"];

/// Counters shared with the progress ticker.
#[derive(Debug)]
struct Progress {
    phase: AtomicU64,
    fetched: AtomicU64,
    total: AtomicU64,
    captured: AtomicU64,
    /// Capture output directory: `*.stream` sizes are the bytes captured.
    out_dir: PathBuf,
}

/// Bytes of the `*.stream` files in the capture output directory `dir`.
fn stream_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".stream"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// The failure of a capture that took `captured` bytes, more than the
/// `budget` left of the namespace's store quota.
fn over_store_budget(url: &str, captured: u64, budget: u64) -> Failure {
    Failure::new(
        "QuotaExceeded",
        format!(
            "the contents captured from {url} take {captured} bytes or more, past the {budget} bytes left of the namespace's content store quota; nothing was published"
        ),
    )
}

/// How many source bytes are read between two looks at what the capture
/// stored so far.
const STORE_CHECK_EVERY: u64 = 16 << 20;

impl Progress {
    fn json(&self) -> serde_json::Value {
        let captured = self
            .captured
            .load(Ordering::Relaxed)
            .max(stream_bytes(&self.out_dir));
        let phase = PHASES
            .get(self.phase.load(Ordering::Relaxed) as usize)
            .copied()
            .unwrap_or("Fetching");
        serde_json::json!({
            "event": "progress",
            "phase": phase,
            "bytesFetched": self.fetched.load(Ordering::Relaxed),
            "bytesTotal": self.total.load(Ordering::Relaxed),
            "bytesCaptured": captured,
        })
    }
}

/// The source as read: hashed and counted while it streams, capped at
/// `max_bytes`; the first failure is kept for the report.
struct Source {
    inner: Box<dyn Read + Send>,
    /// `None` without a checksum to verify (the source is then not
    /// hashed at all), and while [`stream_raw`] hashes on its own thread.
    hasher: Option<sha2::Sha256>,
    n: u64,
    max: Option<u64>,
    /// What the capture may store (`--max-store-bytes`), looked at every
    /// [`STORE_CHECK_EVERY`] bytes read.
    store_budget: Option<u64>,
    next_store_check: u64,
    url: String,
    prog: Arc<Progress>,
    failure: Arc<Mutex<Option<Failure>>>,
}

impl Source {
    fn fail(&self, f: Failure) -> io::Error {
        let msg = f.message.clone();
        if let Ok(mut g) = self.failure.lock()
            && g.is_none()
        {
            *g = Some(f);
        }
        io::Error::other(msg)
    }

    /// Reads what the capture left unread, so the hash covers everything.
    fn drain(&mut self) -> io::Result<()> {
        let mut buf = vec![0u8; 1 << 20];
        while self.read(&mut buf)? > 0 {}
        Ok(())
    }
}

impl Read for Source {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.inner.read(buf) {
            Ok(k) => {
                if let Some(h) = &mut self.hasher {
                    h.update(&buf[..k]);
                }
                self.n += k as u64;
                self.prog.fetched.store(self.n, Ordering::Relaxed);
                if let Some(max) = self.max
                    && self.n > max
                {
                    return Err(self.fail(Failure::new(
                        "SourceTooLarge",
                        format!(
                            "{} is larger than --max-bytes {max}: {} bytes read so far",
                            self.url, self.n
                        ),
                    )));
                }
                if let Some(budget) = self.store_budget
                    && self.n >= self.next_store_check
                {
                    self.next_store_check = self.n.saturating_add(STORE_CHECK_EVERY);
                    let captured = stream_bytes(&self.prog.out_dir);
                    if captured > budget {
                        return Err(self.fail(over_store_budget(&self.url, captured, budget)));
                    }
                }
                Ok(k)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Err(e),
            Err(e) => {
                let f = fetch_read_failure(&self.url, self.n, &e);
                Err(self.fail(f))
            }
        }
    }
}

fn fetch_read_failure(url: &str, n: u64, e: &io::Error) -> Failure {
    let is_tls = e.get_ref().is_some_and(|i| i.is::<rustls::Error>());
    let reason = if is_tls { "TLSError" } else { "Unreachable" };
    Failure::new(
        reason,
        format!("reading {url} failed after {n} bytes: {}", chain(e)),
    )
}

fn fetch_failure(e: &FetchError) -> Failure {
    let reason = match e {
        FetchError::NotFound { .. } => "SourceNotFound",
        FetchError::Status { .. } | FetchError::Malformed { .. } => "HTTPError",
        FetchError::Tls { .. } | FetchError::Roots { .. } => "TLSError",
        FetchError::Unreachable { .. } => "Unreachable",
        FetchError::BadUrl { .. } => "InvalidSource",
    };
    Failure::new(reason, chain(e))
}

/// The work directories of a running ingest, for a signal handler that
/// removes them before the process ends (SIGTERM when a Job is deleted).
#[derive(Debug, Clone, Default)]
pub struct WorkDirs(Arc<Mutex<Vec<PathBuf>>>);

impl WorkDirs {
    /// Removes every registered directory (called on SIGTERM/SIGINT).
    pub fn remove_all(&self) {
        let dirs = self.0.lock().map(|mut g| std::mem::take(&mut *g));
        for p in dirs.unwrap_or_default() {
            remove_tree(&p);
        }
    }
}

fn remove_tree(p: &Path) {
    if let Err(e) = std::fs::remove_dir_all(p)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %p.display(), error = %e, "cleanup failed");
    }
}

/// Removes directory trees when dropped (registered in [`WorkDirs`] while
/// alive).
struct Cleanup {
    dirs: Vec<PathBuf>,
    registry: WorkDirs,
}

impl Cleanup {
    fn new(registry: &WorkDirs) -> Self {
        Self {
            dirs: Vec::new(),
            registry: registry.clone(),
        }
    }

    fn add(&mut self, p: PathBuf) {
        if let Ok(mut g) = self.registry.0.lock() {
            g.push(p.clone());
        }
        self.dirs.push(p);
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.dirs {
            remove_tree(p);
        }
        if let Ok(mut g) = self.registry.0.lock() {
            g.retain(|p| !self.dirs.contains(p));
        }
    }
}

fn store_err(what: &str, p: &Path, e: &dyn std::error::Error) -> Failure {
    Failure::new(
        "StoreError",
        format!("{what} {}: {}", p.display(), chain(e)),
    )
}

fn parse_checksum(s: &str) -> Result<[u8; 32], Failure> {
    let bad = || {
        Failure::new(
            "InvalidSource",
            format!("checksum {s:?} is not sha256:<64 hex digits>"),
        )
    };
    let hexpart = s.strip_prefix("sha256:").ok_or_else(bad)?;
    let v = hex::decode(hexpart.to_ascii_lowercase()).map_err(|_| bad())?;
    v.try_into().map_err(|_| bad())
}

/// Runs `ingest`, printing the protocol lines; false on failure.
pub fn run(args: &IngestArgs, work_dirs: &WorkDirs) -> bool {
    let out = Out::new();
    match ingest(args, &out, work_dirs) {
        Ok(v) => {
            out.line(&v);
            true
        }
        Err(f) => {
            tracing::error!(reason = f.reason, message = %f.message, "ingest failed");
            out.error(&f);
            false
        }
    }
}

/// One captured content before publishing.
struct Captured {
    number: u32,
    /// `p<N>` in the capture output directory.
    capture_name: String,
    /// `<prefix>-p<N>`.
    name: String,
    index: ContentIndex,
    index_sha256: String,
}

fn check_piece_length(pl: u32) -> Result<Options, Failure> {
    if !pl.is_power_of_two()
        || !(anneal_image::format::MIN_PIECE_LENGTH..=anneal_image::format::MAX_PIECE_LENGTH)
            .contains(&pl)
    {
        return Err(Failure::new(
            "InvalidSource",
            format!("piece length {pl} is not a power of two in 16 KiB..64 MiB"),
        ));
    }
    Ok(Options { piece_length: pl })
}

/// The private directories of one ingest, removed by its [`Cleanup`].
struct Staging {
    work: PathBuf,
    scratch: PathBuf,
    capture_dir: PathBuf,
}

/// Creates the namespace directory and this ingest's staging, scratch and
/// capture directories, each registered with `cleanup` first.
fn make_staging(
    args: &IngestArgs,
    ns_dir: &Path,
    cleanup: &mut Cleanup,
) -> Result<Staging, Failure> {
    let tag = format!("{}-{:016x}", args.import, rand::random::<u64>());
    let work = args.store.join(".staging").join(&args.namespace).join(&tag);
    cleanup.add(work.clone());
    for d in [ns_dir, &work] {
        std::fs::create_dir_all(d).map_err(|e| store_err("creating", d, &e))?;
    }
    let scratch = match &args.scratch {
        Some(s) => {
            let d = s.join(&tag);
            cleanup.add(d.clone());
            std::fs::create_dir_all(&d).map_err(|e| store_err("creating", &d, &e))?;
            d
        }
        None => work.join("scratch"),
    };
    std::fs::create_dir_all(&scratch).map_err(|e| store_err("creating", &scratch, &e))?;
    let capture_dir = work.join("out");
    std::fs::create_dir_all(&capture_dir).map_err(|e| store_err("creating", &capture_dir, &e))?;
    Ok(Staging {
        work,
        scratch,
        capture_dir,
    })
}

/// Opens the source: a staged upload under `ns_dir`, or the URL fetched
/// with resumption; its length when known.
fn open_source(
    args: &IngestArgs,
    ns_dir: &Path,
) -> Result<(Box<dyn Read + Send>, Option<u64>), Failure> {
    if let Some(name) = args.url.strip_prefix("staged://") {
        check_names(&[("staged name", name)])?;
        let p = ns_dir.join(".staged").join(name);
        let f = File::open(&p).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                Failure::new(
                    "SourceNotFound",
                    format!("{}: no staged upload at {}", args.url, p.display()),
                )
            } else {
                store_err("opening", &p, &e)
            }
        })?;
        let len = f
            .metadata()
            .map_err(|e| store_err("reading", &p, &e))?
            .len();
        Ok((
            Box::new(io::BufReader::with_capacity(1 << 20, f)),
            Some(len),
        ))
    } else {
        let fo = FetchOptions {
            timeout: Duration::from_secs(args.timeout_secs.max(1)),
            retries: args.retries,
            ca_bundle: args.ca_bundle.clone(),
            backoff: Duration::from_millis(500),
        };
        let tls = if args.url.starts_with("https://") {
            Some(fetch::tls_config(args.ca_bundle.as_deref()).map_err(|e| fetch_failure(&e))?)
        } else {
            None
        };
        let body =
            fetch::get_resuming(&args.url, &fo, tls.as_ref()).map_err(|e| fetch_failure(&e))?;
        let len = body.content_length;
        Ok((Box::new(body), len))
    }
}

/// What capturing the source needs besides the source itself.
struct CaptureStep<'a> {
    url: &'a str,
    /// The checksum the source must match, when one was given.
    expected: Option<[u8; 32]>,
    /// Where the [`Source`] leaves the failure behind an I/O error.
    failure: &'a Mutex<Option<Failure>>,
    capture_dir: &'a Path,
    scratch: &'a Path,
    cz_dir: PathBuf,
    staged: Option<&'a Path>,
    opts: Options,
    set_phase: &'a dyn Fn(u64),
}

impl CaptureStep<'_> {
    /// The failure the source recorded, else `fallback`.
    fn source_failure(&self, fallback: Failure) -> Failure {
        self.failure
            .lock()
            .ok()
            .and_then(|mut g| g.take())
            .unwrap_or(fallback)
    }

    fn invalid(&self, e: &CaptureError) -> Failure {
        Failure::new("InvalidSource", format!("{}: {}", self.url, chain(e)))
    }

    /// The source's SHA-256, hex, when a checksum asked for it ("" without).
    fn check_sum(&self, got: Option<[u8; 32]>, n: u64) -> Result<String, Failure> {
        let Some(want) = self.expected else {
            return Ok(String::new());
        };
        let Some(got) = got else {
            return Err(Failure::new(
                "StoreError",
                format!("{}: the source was not hashed", self.url),
            ));
        };
        if got != want {
            return Err(Failure::new(
                "ChecksumMismatch",
                format!(
                    "{}: expected sha256:{}, got sha256:{} ({} bytes)",
                    self.url,
                    hex::encode(want),
                    hex::encode(got),
                    n
                ),
            ));
        }
        Ok(hex::encode(got))
    }

    /// Checks the checksum once the source has been read completely.
    fn finish(&self, src: &mut Source) -> Result<String, Failure> {
        src.drain()
            .map_err(|e| self.source_failure(Failure::new("Unreachable", chain(&e))))?;
        let got = src.hasher.clone().map(|h| h.finalize().into());
        self.check_sum(got, src.n)
    }

    fn tar_failure(&self, e: TarError, dir: &Path) -> Failure {
        match e {
            TarError::Io(e) => store_err("unpacking into", dir, &e),
            TarError::Invalid(m) => Failure::new(
                "InvalidSource",
                format!("{}: not a usable tar archive: {m}", self.url),
            ),
        }
    }

    fn capture_cz(&self, dir: &Path) -> Result<Layout, Failure> {
        let root = clonezilla_root(dir).ok_or_else(|| {
            Failure::new(
                "InvalidSource",
                format!(
                    "{}: the tar archive holds no Clonezilla image (<disk>-pt.sf)",
                    self.url
                ),
            )
        })?;
        let r = capture::capture_clonezilla(&root, self.capture_dir, self.opts);
        let _ = std::fs::remove_dir_all(dir);
        r.map_err(|e| self.invalid(&e))
    }

    /// Captures the source by its kind: the layout (none for a single
    /// partclone image), the source's SHA-256 and the kind it turned out to
    /// be (a partclone stream may be a compressed Clonezilla tar).
    fn capture(
        &self,
        kind: Kind,
        src: &mut Source,
        head: Vec<u8>,
    ) -> Result<(Kind, Option<Layout>, String), Failure> {
        let (layout, sha) = match kind {
            Kind::Partclone => {
                let (layout, sha, is_tar) = self.partclone(src, head)?;
                if is_tar {
                    return Ok((Kind::ClonezillaTar, layout, sha));
                }
                (layout, sha)
            }
            Kind::Raw if self.staged.is_none() => self.raw_streamed(src, head)?,
            Kind::Raw => self.raw_staged(src)?,
            Kind::Qcow2 => self.qcow2(src, head)?,
            Kind::ClonezillaTar => {
                untar(io::Cursor::new(head).chain(&mut *src), &self.cz_dir)
                    .map_err(|e| self.source_failure(self.tar_failure(e, &self.cz_dir)))?;
                let sha = self.finish(src)?;
                (self.set_phase)(1);
                (Some(self.capture_cz(&self.cz_dir)?), sha)
            }
        };
        Ok((kind, layout, sha))
    }

    /// Captured while it streams; a compressed tar (a Clonezilla directory
    /// as .tar.gz / .tar.zst) is unpacked instead (true).
    fn partclone(
        &self,
        src: &mut Source,
        head: Vec<u8>,
    ) -> Result<(Option<Layout>, String, bool), Failure> {
        (self.set_phase)(1);
        let (ip, sp) = capture::content_paths(self.capture_dir, "p1");
        let opts = self.opts;
        let cz_dir = &self.cz_dir;
        let streamed = (|| -> Result<bool, Failure> {
            let reader = io::Cursor::new(head).chain(&mut *src);
            let (mut input, ikind) = source::open_partclone_stream(reader).map_err(|e| {
                Failure::new(
                    "InvalidSource",
                    format!("{}: reading the partclone image: {}", self.url, chain(&e)),
                )
            })?;
            match ikind {
                ImageKind::Partclone => capture::capture_partclone(input, &ip, &sp, opts)
                    .map(|_| false)
                    .map_err(|e| self.invalid(&e)),
                ImageKind::Raw => {
                    let mut peek = Vec::with_capacity(512);
                    (&mut input).take(512).read_to_end(&mut peek).map_err(|e| {
                        Failure::new("InvalidSource", format!("{}: {}", self.url, chain(&e)))
                    })?;
                    if is_ustar(&peek) {
                        untar(io::Cursor::new(peek).chain(input), cz_dir)
                            .map_err(|e| self.tar_failure(e, cz_dir))?;
                        Ok(true)
                    } else {
                        capture::capture_raw_stream(
                            io::Cursor::new(peek).chain(input),
                            &ip,
                            &sp,
                            opts,
                        )
                        .map(|_| false)
                        .map_err(|e| self.invalid(&e))
                    }
                }
            }
        })();
        let is_tar = streamed.map_err(|f| self.source_failure(f))?;
        let sha = self.finish(src)?;
        if is_tar {
            Ok((Some(self.capture_cz(cz_dir)?), sha, true))
        } else {
            Ok((None, sha, false))
        }
    }

    /// One pass over the body: spooled through a bounded window, captured
    /// while it arrives, hashed on its own thread.
    fn raw_streamed(
        &self,
        src: &mut Source,
        head: Vec<u8>,
    ) -> Result<(Option<Layout>, String), Failure> {
        (self.set_phase)(1);
        let spool_path = self.scratch.join("source.raw");
        let r = stream_raw(src, head, &spool_path, self.capture_dir, self.opts, LIMITS);
        let _ = std::fs::remove_file(&spool_path);
        let (captured, got, stats) = r.map_err(|f| self.source_failure(f))?;
        tracing::info!(
            download_secs = stats.download_secs,
            capture_secs = stats.capture_secs,
            hash_secs = stats.hash_secs,
            mem_peak = stats.mem_peak,
            spilled = stats.spilled,
            "raw source streamed"
        );
        let sha = self.check_sum(got, src.n)?;
        Ok((Some(captured.map_err(|e| self.invalid(&e))?), sha))
    }

    /// A staged upload is a local file already: captured from it directly
    /// while this thread hashes it.
    fn raw_staged(&self, src: &mut Source) -> Result<(Option<Layout>, String), Failure> {
        let file = self.staged.map(Path::to_path_buf).unwrap_or_default();
        (self.set_phase)(1);
        let (capture_dir, opts) = (self.capture_dir, self.opts);
        let (captured, sha) = std::thread::scope(|s| {
            let cap = s.spawn(|| capture::capture_disk(&file, capture_dir, opts));
            let sha = self.finish(src);
            let captured = cap.join().unwrap_or(Err(CaptureError::Pipeline));
            (captured, sha)
        });
        let sha = sha?;
        Ok((Some(captured.map_err(|e| self.invalid(&e))?), sha))
    }

    /// qcow2 needs random access: a fetched source is spooled to a sparse
    /// scratch file first (deleted afterwards).
    fn qcow2(&self, src: &mut Source, head: Vec<u8>) -> Result<(Option<Layout>, String), Failure> {
        let (file, sha) = match self.staged {
            Some(p) => (p.to_path_buf(), self.finish(src)?),
            None => {
                let file = self.scratch.join("source.qcow2");
                spool(io::Cursor::new(head).chain(&mut *src), &file)
                    .map_err(|e| self.source_failure(store_err("writing", &file, &e)))?;
                (file, self.finish(src)?)
            }
        };
        (self.set_phase)(1);
        let converted = self.scratch.join("converted.raw");
        let r = capture::capture_qcow2(&file, &converted, self.capture_dir, self.opts);
        if self.staged.is_none() {
            let _ = std::fs::remove_file(&file);
        }
        let _ = std::fs::remove_file(&converted);
        Ok((Some(r.map_err(|e| self.invalid(&e))?), sha))
    }
}

/// Reads the captured contents' indexes back, named `<prefix>-p<N>`.
fn captured_contents(
    args: &IngestArgs,
    capture_dir: &Path,
    layout: Option<&Layout>,
) -> Result<Vec<Captured>, Failure> {
    let numbers: Vec<(u32, String)> = match layout {
        Some(l) => l
            .slots
            .iter()
            .filter_map(|s| s.content_ref.clone().map(|c| (s.number, c)))
            .collect(),
        None => vec![(1, "p1".to_owned())],
    };
    let mut contents = Vec::new();
    for (number, capture_name) in numbers {
        let (ip, _) = capture::content_paths(capture_dir, &capture_name);
        let raw = std::fs::read(&ip).map_err(|e| store_err("reading", &ip, &e))?;
        let index = ContentIndex::parse(&raw).map_err(|e| store_err("parsing", &ip, &e))?;
        contents.push(Captured {
            number,
            capture_name,
            name: format!("{}-p{number}", args.prefix),
            index,
            index_sha256: hex::encode(sha2::Sha256::digest(&raw)),
        });
    }
    Ok(contents)
}

/// The upload did its job: its contents are published (a failed import
/// keeps it for the next attempt).
fn remove_staged_upload(p: &Path) {
    match std::fs::remove_file(p) {
        Ok(()) => tracing::info!(path = %p.display(), "staged upload removed after its import"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(path = %p.display(), error = %e, "staged upload not removed"),
    }
}

fn ingest(
    args: &IngestArgs,
    out: &Out,
    work_dirs: &WorkDirs,
) -> Result<serde_json::Value, Failure> {
    check_names(&[
        ("namespace", &args.namespace),
        ("import", &args.import),
        ("prefix", &args.prefix),
    ])?;
    let expected = args.checksum.as_deref().map(parse_checksum).transpose()?;
    let opts = check_piece_length(args.piece_length)?;
    let ns_dir = args.store.join(&args.namespace);
    let import_dir = ns_dir.join(".imports").join(&args.import);
    if import_dir.exists() {
        return Err(Failure::new(
            "ContentExists",
            format!(
                "import {}/{} was already published ({})",
                args.namespace,
                args.import,
                import_dir.display()
            ),
        ));
    }
    let mut cleanup = Cleanup::new(work_dirs);
    let Staging {
        work,
        scratch,
        capture_dir,
    } = make_staging(args, &ns_dir, &mut cleanup)?;

    let prog = Arc::new(Progress {
        phase: AtomicU64::new(0),
        fetched: AtomicU64::new(0),
        total: AtomicU64::new(0),
        captured: AtomicU64::new(0),
        out_dir: capture_dir.clone(),
    });
    let set_phase = |p: u64| {
        prog.phase.store(p, Ordering::Relaxed);
        out.line(&prog.json());
    };
    set_phase(0);
    let ticker = {
        let prog = prog.clone();
        Ticker::start(out.clone(), Duration::from_millis(500), move || prog.json())
    };

    // open the source
    let staged = args
        .url
        .strip_prefix("staged://")
        .map(|name| ns_dir.join(".staged").join(name));
    let (inner, total) = open_source(args, &ns_dir)?;
    prog.total.store(total.unwrap_or(0), Ordering::Relaxed);
    if let (Some(max), Some(t)) = (args.max_bytes, total)
        && t > max
    {
        return Err(Failure::new(
            "SourceTooLarge",
            format!(
                "{} is {t} bytes (Content-Length), larger than --max-bytes {max}",
                args.url
            ),
        ));
    }
    let failure = Arc::new(Mutex::new(None));
    let mut src = Source {
        inner,
        // the whole source is hashed only to verify a checksum: 1 GiB of
        // SHA-256 is ~0.6 CPU-s, a third of a raw ingest's CPU time
        hasher: expected.is_some().then(sha2::Sha256::new),
        n: 0,
        max: args.max_bytes,
        store_budget: args.max_store_bytes,
        next_store_check: STORE_CHECK_EVERY,
        url: args.url.clone(),
        prog: prog.clone(),
        failure: failure.clone(),
    };
    let step = CaptureStep {
        url: &args.url,
        expected,
        failure: &failure,
        capture_dir: &capture_dir,
        scratch: &scratch,
        cz_dir: scratch.join("clonezilla"),
        staged: staged.as_deref(),
        opts,
        set_phase: &set_phase,
    };
    let mut head = Vec::with_capacity(512);
    (&mut src)
        .take(512)
        .read_to_end(&mut head)
        .map_err(|e| step.source_failure(Failure::new("Unreachable", chain(&e))))?;
    let kind = detect(&head, args.format);
    tracing::info!(url = %args.url, format = kind.name(), "ingest");
    if head.is_empty() {
        // nothing to capture, whatever the format: refused before any
        // capture starts (an empty content would publish otherwise)
        return Err(Failure::new(
            "InvalidSource",
            format!("{}: source is empty (0 bytes)", args.url),
        ));
    }
    let (kind, layout, source_sha) = step.capture(kind, &mut src, head)?;
    let fetched = src.n;
    drop(src);

    // the contents
    let contents = captured_contents(args, &capture_dir, layout.as_ref())?;
    let layout = layout.map(|mut l| {
        for s in &mut l.slots {
            if s.content_ref.is_some() {
                s.content_ref = Some(format!("{}-p{}", args.prefix, s.number));
            }
        }
        l
    });
    let captured: u64 = contents.iter().map(|c| c.index.header.used_bytes).sum();
    prog.captured.store(captured, Ordering::Relaxed);
    if let Some(budget) = args.max_store_bytes
        && captured > budget
    {
        return Err(over_store_budget(&args.url, captured, budget));
    }

    set_phase(2);
    publish(
        args,
        &ns_dir,
        &import_dir,
        &capture_dir,
        &work,
        &contents,
        layout.as_ref(),
    )?;
    drop(ticker);
    out.line(&prog.json());
    drop(cleanup);
    if let Some(p) = &staged {
        remove_staged_upload(p);
    }

    let contents_json: Vec<serde_json::Value> = contents.iter().map(content_json).collect();
    Ok(serde_json::json!({
        "event": "result",
        "sourceSha256": source_sha,
        "format": kind.name(),
        "bytesFetched": fetched,
        "layout": layout,
        "contents": contents_json,
    }))
}

fn content_json(c: &Captured) -> serde_json::Value {
    let h = &c.index.header;
    let mut v = serde_json::json!({
        "name": c.name,
        "partitionNumber": c.number,
        "usedBytes": h.used_bytes,
        "sizeBytes": h.partition_size,
        "lastExtentEnd": h.last_extent_end,
        "blockSize": h.block_size,
        "pieceLength": h.piece_length,
        "streamSha256": c.index.stream_sha256_hex(),
        "indexSha256": c.index_sha256,
    });
    if let Some(m) = v.as_object_mut() {
        if !h.fs_type.is_empty() {
            m.insert("fsType".into(), h.fs_type.clone().into());
        }
        if !h.uuid.is_empty() {
            m.insert("uuid".into(), h.uuid_string().into());
        }
        if !h.label.is_empty() {
            m.insert("label".into(), h.label.clone().into());
        }
    }
    v
}

/// Publishes every content as `<ns>/<name>/{index,stream}` and the layout
/// as `<ns>/.imports/<import>/layout.json`, never overwriting: every name
/// is checked first, each directory is claimed with mkdir (fails if it
/// exists) and replaced by the full one with rename(2) (which replaces only
/// an empty directory); a failure removes what this run published.
fn publish(
    args: &IngestArgs,
    ns_dir: &Path,
    import_dir: &Path,
    capture_dir: &Path,
    work: &Path,
    contents: &[Captured],
    layout: Option<&Layout>,
) -> Result<(), Failure> {
    let taken = |what: String| Failure::new("ContentExists", what);
    for c in contents {
        let t = ns_dir.join(&c.name);
        if t.symlink_metadata().is_ok() {
            return Err(taken(format!(
                "content {}/{} already exists ({}); nothing was published",
                args.namespace,
                c.name,
                t.display()
            )));
        }
    }
    if import_dir.symlink_metadata().is_ok() {
        return Err(taken(format!(
            "import {}/{} already exists ({}); nothing was published",
            args.namespace,
            args.import,
            import_dir.display()
        )));
    }
    // assemble `<work>/pub/<name>/{index,stream}`
    let pub_root = work.join("pub");
    for c in contents {
        let d = pub_root.join(&c.name);
        std::fs::create_dir_all(&d).map_err(|e| store_err("creating", &d, &e))?;
        let (ip, sp) = capture::content_paths(capture_dir, &c.capture_name);
        for (from, to) in [(ip, d.join("index")), (sp, d.join("stream"))] {
            std::fs::rename(&from, &to).map_err(|e| store_err("moving", &from, &e))?;
            File::open(&to)
                .and_then(|f| f.sync_all())
                .map_err(|e| store_err("syncing", &to, &e))?;
        }
    }
    let mut published: Vec<PathBuf> = Vec::new();
    let rollback = |published: &[PathBuf]| {
        for p in published {
            if let Err(e) = std::fs::remove_dir_all(p) {
                tracing::warn!(path = %p.display(), error = %e, "rolling back a published content");
            }
        }
    };
    for c in contents {
        let target = ns_dir.join(&c.name);
        if let Err(e) = std::fs::create_dir(&target) {
            rollback(&published);
            return Err(if e.kind() == io::ErrorKind::AlreadyExists {
                taken(format!(
                    "content {}/{} appeared while publishing ({}); nothing was published",
                    args.namespace,
                    c.name,
                    target.display()
                ))
            } else {
                store_err("creating", &target, &e)
            });
        }
        // rename(2) replaces only an empty directory: if someone wrote into
        // the one we claimed, this fails and their files stay
        let from = pub_root.join(&c.name);
        if let Err(e) = std::fs::rename(&from, &target) {
            let _ = std::fs::remove_dir(&target);
            rollback(&published);
            return Err(store_err("publishing", &target, &e));
        }
        published.push(target);
    }
    if let Some(l) = layout {
        let r = (|| -> Result<(), Failure> {
            let parent = import_dir.parent().unwrap_or(ns_dir);
            std::fs::create_dir_all(parent).map_err(|e| store_err("creating", parent, &e))?;
            std::fs::create_dir(import_dir).map_err(|e| {
                if e.kind() == io::ErrorKind::AlreadyExists {
                    taken(format!(
                        "import {}/{} appeared while publishing; nothing was published",
                        args.namespace, args.import
                    ))
                } else {
                    store_err("creating", import_dir, &e)
                }
            })?;
            let p = import_dir.join("layout.json");
            let json =
                serde_json::to_vec_pretty(l).map_err(|e| store_err("serialising", &p, &e))?;
            write_atomic(&p, &json).map_err(|e| store_err("writing", &p, &e))
        })();
        if let Err(f) = r {
            rollback(&published);
            return Err(f);
        }
    }
    if let Ok(d) = File::open(ns_dir) {
        let _ = d.sync_all();
    }
    tracing::info!(
        namespace = %args.namespace,
        contents = contents.len(),
        "published"
    );
    Ok(())
}

/// Fills `buf` from `input` up to its capacity; the bytes read (fewer only
/// at the end of the input).
fn fill(input: &mut impl Read, buf: &mut Vec<u8>, cap: usize) -> io::Result<usize> {
    let start = buf.len();
    buf.resize(cap, 0);
    let mut n = start;
    let r = loop {
        if n == cap {
            break Ok(());
        }
        match input.read(&mut buf[n..]) {
            Ok(0) => break Ok(()),
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    buf.truncate(n);
    r.map(|()| n - start)
}

/// Whether a block is all zero (the first bytes decide most data blocks).
fn is_zero(b: &[u8]) -> bool {
    let (head, rest) = b.split_at(b.len().min(16));
    head.iter().all(|x| *x == 0) && rest.iter().fold(0u8, |a, x| a | x) == 0
}

/// Writes the blocks of `buf` (read at `off`) that are not all zero into
/// `f` at `off`: runs of non-zero 4 KiB blocks in one call each, zero
/// blocks left as holes. Bytes below `skip_below` are not written.
fn write_nonzero(f: &File, buf: &[u8], off: u64, skip_below: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    const BLK: usize = 4096;
    let first = usize::try_from(skip_below.saturating_sub(off))
        .unwrap_or(usize::MAX)
        .min(buf.len());
    let mut i = first / BLK * BLK;
    while i < buf.len() {
        while i < buf.len() && is_zero(&buf[i..(i + BLK).min(buf.len())]) {
            i += BLK;
        }
        let s = i.max(first);
        while i < buf.len() && !is_zero(&buf[i..(i + BLK).min(buf.len())]) {
            i += BLK;
        }
        let e = i.min(buf.len());
        if e > s {
            f.write_all_at(&buf[s..e], off + s as u64)?;
        }
    }
    Ok(())
}

/// Copies `input` into a new sparse file at `path` (all-zero 4 KiB blocks
/// are holes). Not fsynced: the file is scratch, deleted afterwards.
fn spool(mut input: impl Read, path: &Path) -> io::Result<u64> {
    let f = File::create(path)?;
    let mut buf = Vec::with_capacity(CHUNK);
    let mut size = 0u64;
    loop {
        buf.clear();
        let n = fill(&mut input, &mut buf, CHUNK)?;
        if n == 0 {
            break;
        }
        write_nonzero(&f, &buf, size, 0)?;
        size += n as u64;
        if n < CHUNK {
            break;
        }
    }
    f.set_len(size)?;
    Ok(size)
}

/// Size of the reads from the source.
const CHUNK: usize = 1 << 20;

/// How far the download may run ahead of the capture's latest read.
const WINDOW: u64 = 64 << 20;

/// How many bytes of a raw source the spool holds in memory at most; past
/// that, arriving chunks go to the sparse scratch file.
const MEM_CAP: u64 = 96 << 20;

/// The bounds of a streamed raw source's spool.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// [`WINDOW`] (smaller in tests).
    window: u64,
    /// [`MEM_CAP`] (smaller in tests).
    mem_cap: u64,
}

const LIMITS: Limits = Limits {
    window: WINDOW,
    mem_cap: MEM_CAP,
};

/// Where one [`CHUNK`] of the source is, once it arrived.
#[derive(Debug)]
enum Chunk {
    /// In memory (the buffer it was read into, shared with the hash thread).
    Mem(Arc<Vec<u8>>),
    /// All zero: nothing stored.
    Zero,
    /// In the scratch file at its own offset (zero blocks are holes).
    Spilled,
}

/// The state of a raw source being spooled and captured at once.
#[derive(Debug, Default)]
struct SpoolState {
    /// Bytes arrived so far (`[0, avail)` readable).
    avail: u64,
    /// The source's length once its end was read.
    end: Option<u64>,
    /// The download stopped on an error (reported by the fetching side).
    failed: bool,
    /// The end of the capture's latest read.
    want: u64,
    /// Nothing below this will be read again (released by the capture).
    discard_below: u64,
    /// The capture returned (the rest is only hashed).
    capture_ended: bool,
    /// The arrived chunks not released yet, by index (`offset / CHUNK`);
    /// a chunk released or below `discard_below` is absent.
    chunks: std::collections::BTreeMap<u64, Chunk>,
    /// Bytes in [`Chunk::Mem`] chunks, and their peak.
    mem: u64,
    mem_peak: u64,
    /// Bytes written to the scratch file.
    spilled: u64,
}

/// What streaming a raw source cost, for the log.
#[derive(Debug, Default, Clone, Copy)]
struct StreamStats {
    mem_peak: u64,
    spilled: u64,
    /// Seconds from the start until the body was read, the capture
    /// returned, and the hash was done.
    download_secs: f64,
    capture_secs: f64,
    hash_secs: f64,
}

/// A raw source arriving while the capture reads it: each chunk is kept in
/// memory as read (no copy; all-zero chunks as nothing), or, past
/// [`MEM_CAP`], written into a sparse scratch file. A read blocks until its
/// bytes have arrived; the download waits while it is a window ahead of the
/// capture's latest read (a read beyond what has arrived always lets it
/// run); what the capture releases is dropped (punched out of the file) and
/// not stored again. Memory holds at most the cap; the file the chunks
/// that arrived past it (the partition metadata the capture reads ahead
/// pulls the download that far), never the whole image.
struct Spool {
    file: File,
    path: PathBuf,
    /// Content-Length, when the server sent one.
    total: Option<u64>,
    limits: Limits,
    st: Mutex<SpoolState>,
    cv: Condvar,
    /// Buffers the spool let go, back to the download for reuse.
    returned: Mutex<mpsc::Sender<Arc<Vec<u8>>>>,
}

impl Spool {
    fn lock(&self) -> MutexGuard<'_, SpoolState> {
        self.st.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn update(&self, f: impl FnOnce(&mut SpoolState)) {
        f(&mut self.lock());
        self.cv.notify_all();
    }

    /// Blocks the download at `off` while it is a window ahead of the
    /// capture; whether the chunk at `off` is to be stored at all.
    fn wait_room(&self, off: u64) -> bool {
        let mut g = self.lock();
        while !g.capture_ended && !g.failed && off >= g.want.saturating_add(self.limits.window) {
            g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
        }
        !g.capture_ended && off + CHUNK as u64 > g.discard_below
    }

    /// Stores the chunk `buf` read at `off` (a multiple of [`CHUNK`]) and
    /// makes `[0, off + len)` readable.
    fn store(&self, buf: &Arc<Vec<u8>>, off: u64, keep: bool) -> io::Result<()> {
        let len = buf.len() as u64;
        let idx = off / CHUNK as u64;
        let zero = keep && buf.chunks(4096).all(is_zero);
        let spill = keep && !zero && {
            let g = self.lock();
            g.mem + len > self.limits.mem_cap
        };
        if spill {
            write_nonzero(&self.file, buf, off, 0)?;
            if self.total.is_none() {
                self.file.set_len(off + len)?;
            }
        }
        self.update(|g| {
            if keep {
                let c = if zero {
                    Chunk::Zero
                } else if spill {
                    g.spilled += len;
                    Chunk::Spilled
                } else {
                    g.mem += len;
                    g.mem_peak = g.mem_peak.max(g.mem);
                    Chunk::Mem(buf.clone())
                };
                g.chunks.insert(idx, c);
            }
            g.avail = off + len;
        });
        Ok(())
    }

    /// Drops the chunks wholly inside `[start, end)` or below
    /// `discard_below`.
    fn drop_chunks(&self, start: u64, end: u64) {
        use std::os::fd::AsFd as _;
        let c = CHUNK as u64;
        let mut gone = Vec::new();
        {
            let mut g = self.lock();
            g.discard_below = g.discard_below.max(end);
            let below = g.discard_below / c;
            let mut idxs: Vec<u64> = g.chunks.range(..below).map(|(i, _)| *i).collect();
            idxs.extend(g.chunks.range(start.div_ceil(c)..end / c).map(|(i, _)| *i));
            for i in idxs {
                match g.chunks.remove(&i) {
                    Some(Chunk::Mem(b)) => {
                        g.mem -= b.len() as u64;
                        gone.push((i, Some(b)));
                    }
                    Some(Chunk::Spilled) => gone.push((i, None)),
                    _ => {}
                }
            }
        }
        self.cv.notify_all();
        let returned = self.returned.lock().unwrap_or_else(PoisonError::into_inner);
        for (i, b) in gone {
            match b {
                Some(b) => {
                    let _ = returned.send(b);
                }
                None => {
                    let (Ok(so), Ok(len)) = (i64::try_from(i * c), i64::try_from(c)) else {
                        continue;
                    };
                    let flags = nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                        | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE;
                    if let Err(e) = nix::fcntl::fallocate(self.file.as_fd(), flags, so, len) {
                        tracing::debug!(path = %self.path.display(), error = %e, "punching the spool");
                    }
                }
            }
        }
    }
}

impl fs::ReadAt for Spool {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        let end = off
            .checked_add(buf.len() as u64)
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        if buf.is_empty() {
            return Ok(());
        }
        let c = CHUNK as u64;
        // the chunks under the lock, the copies outside it
        let parts: Vec<ChunkPart> = {
            let mut g = self.lock();
            let grew = end > g.want;
            g.want = end;
            if grew {
                self.cv.notify_all();
            }
            loop {
                if g.failed {
                    return Err(io::Error::other(format!(
                        "the download stopped before byte {end}"
                    )));
                }
                if g.avail >= end {
                    break;
                }
                if let Some(e) = g.end {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("the source ends at byte {e}, before {end}"),
                    ));
                }
                g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
            }
            (off / c..end.div_ceil(c))
                .map(|i| match g.chunks.get(&i) {
                    Some(Chunk::Mem(b)) => (i, Some(b.clone()), false),
                    Some(Chunk::Spilled) => (i, None, true),
                    // all zero, or released (never read again: zeros, as
                    // a hole would read)
                    _ => (i, None, false),
                })
                .collect()
        };
        for (i, mem, spilled) in parts {
            let cs = i * c;
            let (s, e) = (off.max(cs), end.min(cs + c));
            let dst = &mut buf[(s - off) as usize..(e - off) as usize];
            match mem {
                Some(b) => {
                    let from = (s - cs) as usize;
                    let src = b.get(from..from + dst.len()).ok_or_else(|| {
                        io::Error::new(io::ErrorKind::UnexpectedEof, "short chunk")
                    })?;
                    dst.copy_from_slice(src);
                }
                None if spilled => self.file.read_exact_at(dst, s)?,
                None => dst.fill(0),
            }
        }
        Ok(())
    }

    fn size(&self) -> u64 {
        if let Some(t) = self.total {
            return t;
        }
        // the size of a body without Content-Length is known at its end:
        // let the download run there (past the memory cap into the file)
        let mut g = self.lock();
        g.want = u64::MAX;
        self.cv.notify_all();
        loop {
            if let Some(e) = g.end {
                return e;
            }
            if g.failed {
                return g.avail;
            }
            g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl capture::DiskSource for Spool {
    fn release(&self, start: u64, end: u64) {
        self.drop_chunks(start, end);
    }
}

/// Marks the capture as ended when dropped.
struct CaptureEnded<'a>(&'a Spool);

impl Drop for CaptureEnded<'_> {
    fn drop(&mut self) {
        self.0.update(|g| g.capture_ended = true);
    }
}

/// Reads from `input` into `buf` until it is full or the input ends; the
/// bytes read.
fn fill_slice(input: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Streams a raw disk image from `src` (`head` already read from it and
/// hashed): one pass over the body, each chunk read into a buffer that the
/// spool keeps for the capture (on its own thread, `capture_disk_of` over
/// the [`Spool`]) and that the hash thread hashes, no copy in between;
/// buffers come back for reuse once both let go. The capture's result and
/// the source's SHA-256; an error when reading or spooling the source
/// failed. A capture that fails stops the spooling; the rest is still read
/// and hashed (so a damaged download is reported as a checksum mismatch).
fn stream_raw(
    src: &mut Source,
    head: Vec<u8>,
    spool_path: &Path,
    capture_dir: &Path,
    opts: Options,
    limits: Limits,
) -> Result<Streamed, Failure> {
    let t0 = std::time::Instant::now();
    let file = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(spool_path)
        .map_err(|e| store_err("creating", spool_path, &e))?;
    let total = match src.prog.total.load(Ordering::Relaxed) {
        0 => None,
        t => Some(t),
    };
    if let Some(t) = total {
        file.set_len(t)
            .map_err(|e| store_err("sizing", spool_path, &e))?;
    }
    let (ret_tx, ret_rx) = mpsc::channel::<Arc<Vec<u8>>>();
    let spool = Spool {
        file,
        path: spool_path.to_owned(),
        total,
        limits,
        st: Mutex::new(SpoolState::default()),
        cv: Condvar::new(),
        returned: Mutex::new(ret_tx.clone()),
    };
    // without a checksum to verify, no hash thread: the chunks then go
    // back to the pool from the spool alone
    let hasher = src.hasher.take();
    let (hash_tx, hash_rx) = mpsc::sync_channel::<(Arc<Vec<u8>>, usize)>(8);
    let (fetched, captured, sha, capture_secs, hash_secs) = std::thread::scope(|s| {
        let hash = hasher.map(|mut hasher| {
            std::thread::Builder::new()
                .name("ingest-sha256".into())
                .spawn_scoped(s, move || {
                    for (b, from) in hash_rx {
                        hasher.update(b.get(from..).unwrap_or_default());
                        let _ = ret_tx.send(b);
                    }
                    (hasher.finalize().into(), t0.elapsed().as_secs_f64())
                })
        });
        let cap = std::thread::Builder::new()
            .name("ingest-capture".into())
            .spawn_scoped(s, || {
                // set when the capture returns or unwinds: the download
                // then never waits for it
                let _ended = CaptureEnded(&spool);
                let r = capture::capture_disk_of(&spool, capture_dir, opts);
                (r, t0.elapsed().as_secs_f64())
            });
        if cap.is_err() {
            spool.update(|g| g.capture_ended = true);
        }
        let fetched = (|| -> Result<u64, Failure> {
            let hash_tx = match &hash {
                Some(Ok(_)) => Some(hash_tx),
                Some(Err(e)) => {
                    return Err(store_err("starting the hash thread for", spool_path, e));
                }
                None => None,
            };
            let mut pool: Vec<Vec<u8>> = Vec::new();
            let mut off = 0u64;
            let mut first = Some(head);
            loop {
                let keep = spool.wait_room(off);
                for b in ret_rx.try_iter() {
                    if let Ok(v) = Arc::try_unwrap(b)
                        && v.len() == CHUNK
                    {
                        pool.push(v);
                    }
                }
                let mut buf = pool.pop().unwrap_or_else(|| vec![0u8; CHUNK]);
                let pre = first.take().map_or(0, |h| {
                    buf[..h.len()].copy_from_slice(&h);
                    h.len()
                });
                let n = fill_slice(src, &mut buf[pre..])
                    .map_err(|e| Failure::new("Unreachable", chain(&e)))?;
                if n + pre == 0 {
                    return Ok(off);
                }
                buf.truncate(n + pre);
                let buf = Arc::new(buf);
                spool
                    .store(&buf, off, keep)
                    .map_err(|e| store_err("writing", spool_path, &e))?;
                off += buf.len() as u64;
                let last = buf.len() < CHUNK;
                // the head was hashed already
                if let Some(tx) = &hash_tx {
                    let _ = tx.send((buf, pre));
                }
                if last {
                    return Ok(off);
                }
            }
        })();
        let download_secs = t0.elapsed().as_secs_f64();
        spool.update(|g| match &fetched {
            Ok(n) => g.end = Some(*n),
            Err(_) => g.failed = true,
        });
        let (captured, capture_secs) = match cap {
            Ok(h) => h.join().unwrap_or((Err(CaptureError::Pipeline), f64::NAN)),
            Err(e) => (
                Err(CaptureError::Io {
                    what: "starting the capture thread for",
                    path: spool_path.to_owned(),
                    source: e,
                }),
                f64::NAN,
            ),
        };
        let (sha, hash_secs) = match hash.map(|h| h.map(|h| h.join())) {
            None => (Ok(None), f64::NAN),
            Some(Ok(Ok((sha, secs)))) => (Ok(Some(sha)), secs),
            Some(_) => (Err(()), f64::NAN),
        };
        (
            fetched.map(|n| (n, download_secs)),
            captured,
            sha,
            capture_secs,
            hash_secs,
        )
    });
    let (_, download_secs) = fetched?;
    let sha = sha.map_err(|()| {
        Failure::new(
            "StoreError",
            format!("hashing {}: the hash thread stopped", src.url),
        )
    })?;
    let g = spool.lock();
    let stats = StreamStats {
        mem_peak: g.mem_peak,
        spilled: g.spilled,
        download_secs,
        capture_secs,
        hash_secs,
    };
    drop(g);
    Ok((captured, sha, stats))
}

/// Errors of unpacking a tar archive.
#[derive(Debug, thiserror::Error)]
enum TarError {
    /// Writing the unpacked files (or reading the source).
    #[error("unpacking")]
    Io(#[from] io::Error),
    /// Not an archive we unpack.
    #[error("{0}")]
    Invalid(String),
}

fn tar_octal(field: &[u8]) -> Result<u64, TarError> {
    // GNU base-256 for large sizes
    if field.first().is_some_and(|b| b & 0x80 != 0) {
        let mut v: u64 = u64::from(field[0] & 0x7f);
        for b in &field[1..] {
            v = v
                .checked_mul(256)
                .and_then(|x| x.checked_add(u64::from(*b)))
                .ok_or_else(|| TarError::Invalid("size field overflows".into()))?;
        }
        return Ok(v);
    }
    let s: String = field
        .iter()
        .take_while(|b| **b != 0)
        .map(|b| *b as char)
        .collect();
    let s = s.trim();
    if s.is_empty() {
        return Ok(0);
    }
    u64::from_str_radix(s, 8).map_err(|_| TarError::Invalid(format!("bad octal field {s:?}")))
}

fn tar_str(field: &[u8]) -> String {
    let end = field.iter().position(|b| *b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// A relative path inside `root`, refusing absolute paths and `..`.
fn safe_join(root: &Path, name: &str) -> Result<Option<PathBuf>, TarError> {
    let p = Path::new(name);
    let mut out = root.to_path_buf();
    let mut any = false;
    for c in p.components() {
        match c {
            Component::Normal(s) => {
                out.push(s);
                any = true;
            }
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err(TarError::Invalid(format!(
                    "entry {name:?} is absolute or contains '..'"
                )));
            }
        }
    }
    Ok(any.then_some(out))
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> Result<bool, TarError> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) if n == 0 => return Ok(false),
            Ok(0) => return Err(TarError::Invalid("truncated archive".into())),
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TarError::Io(e)),
        }
    }
    Ok(true)
}

/// Unpacks a ustar/GNU tar stream into `dir` (regular files and
/// directories; pax headers skipped, GNU long names honoured; links and
/// devices refused).
fn untar(mut r: impl Read, dir: &Path) -> Result<(), TarError> {
    std::fs::create_dir_all(dir)?;
    let mut hdr = [0u8; 512];
    let mut long_name: Option<String> = None;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        if !read_full(&mut r, &mut hdr)? {
            return Ok(());
        }
        if hdr.iter().all(|b| *b == 0) {
            return Ok(());
        }
        let sum: u64 = hdr
            .iter()
            .enumerate()
            .map(|(i, b)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    u64::from(*b)
                }
            })
            .sum();
        if tar_octal(&hdr[148..156])? != sum {
            return Err(TarError::Invalid("header checksum mismatch".into()));
        }
        let size = tar_octal(&hdr[124..136])?;
        let typ = hdr[156];
        let mut name = tar_str(&hdr[0..100]);
        if &hdr[257..262] == b"ustar" && hdr[263] == b'0' {
            // POSIX ustar: prefix field
            let prefix = tar_str(&hdr[345..500]);
            if !prefix.is_empty() {
                name = format!("{prefix}/{name}");
            }
        }
        if let Some(l) = long_name.take() {
            name = l;
        }
        let padded = size.div_ceil(512) * 512;
        match typ {
            b'L' => {
                if size > 4096 {
                    return Err(TarError::Invalid("long name too long".into()));
                }
                let mut v = vec![0u8; padded as usize];
                if !read_full(&mut r, &mut v)? {
                    return Err(TarError::Invalid("truncated archive".into()));
                }
                long_name = Some(tar_str(&v[..size as usize]));
            }
            b'x' | b'g' => skip(&mut r, padded, &mut buf)?,
            b'5' => {
                if let Some(p) = safe_join(dir, &name)? {
                    std::fs::create_dir_all(&p)?;
                }
                skip(&mut r, padded, &mut buf)?;
            }
            b'0' | 0 | b'7' => {
                let p = safe_join(dir, &name)?
                    .ok_or_else(|| TarError::Invalid("file entry without a name".into()))?;
                if let Some(parent) = p.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&p)
                    .map_err(|e| {
                        if e.kind() == io::ErrorKind::AlreadyExists {
                            TarError::Invalid(format!("entry {name:?} appears twice"))
                        } else {
                            TarError::Io(e)
                        }
                    })?;
                let mut left = size;
                while left > 0 {
                    let n = (buf.len() as u64).min(left) as usize;
                    if !read_full(&mut r, &mut buf[..n])? {
                        return Err(TarError::Invalid("truncated archive".into()));
                    }
                    f.write_all(&buf[..n])?;
                    left -= n as u64;
                }
                skip(&mut r, padded - size, &mut buf)?;
            }
            t => {
                return Err(TarError::Invalid(format!(
                    "entry {name:?} has unsupported type {:?} (only files and directories)",
                    t as char
                )));
            }
        }
    }
}

fn skip(r: &mut impl Read, mut n: u64, buf: &mut [u8]) -> Result<(), TarError> {
    while n > 0 {
        let k = (buf.len() as u64).min(n) as usize;
        if !read_full(r, &mut buf[..k])? {
            return Err(TarError::Invalid("truncated archive".into()));
        }
        n -= k as u64;
    }
    Ok(())
}

/// The directory holding `<disk>-pt.sf`: `dir` itself or one level below.
fn clonezilla_root(dir: &Path) -> Option<PathBuf> {
    let has_pt = |d: &Path| {
        std::fs::read_dir(d).ok().is_some_and(|rd| {
            rd.filter_map(Result::ok)
                .any(|e| e.file_name().to_string_lossy().ends_with("-pt.sf"))
        })
    };
    if has_pt(dir) {
        return Some(dir.to_owned());
    }
    let subs: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir() && has_pt(p))
        .collect();
    match subs.as_slice() {
        [one] => Some(one.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection() {
        let mut tar = vec![0u8; 512];
        tar[257..262].copy_from_slice(b"ustar");
        assert_eq!(detect(b"QFI\xfb\0\0\0\x03", None), Kind::Qcow2);
        assert_eq!(detect(&tar, None), Kind::ClonezillaTar);
        assert_eq!(
            detect(&tar, Some(IngestFormat::Partclone)),
            Kind::ClonezillaTar
        );
        assert_eq!(detect(b"partclone-image\0", None), Kind::Partclone);
        assert_eq!(detect(&[0x1f, 0x8b, 8, 0], None), Kind::Partclone);
        assert_eq!(detect(&[0u8; 512], None), Kind::Raw);
        assert_eq!(detect(b"QFI\xfb", Some(IngestFormat::Raw)), Kind::Raw);
    }

    #[test]
    fn checksums_and_paths() {
        assert!(parse_checksum(&format!("sha256:{}", "ab".repeat(32))).is_ok());
        assert!(parse_checksum("sha256:abcd").is_err());
        assert!(parse_checksum(&format!("md5:{}", "ab".repeat(32))).is_err());
        let root = Path::new("/r");
        assert!(safe_join(root, "/etc/passwd").is_err());
        assert!(safe_join(root, "a/../../x").is_err());
        assert_eq!(
            safe_join(root, "./a/b").unwrap(),
            Some(PathBuf::from("/r/a/b"))
        );
        assert_eq!(safe_join(root, "./").unwrap(), None);
    }

    /// A reader over a file that records, before each read, how much of
    /// `spool` is allocated on disk.
    struct Watch {
        f: File,
        spool: PathBuf,
        max: Arc<AtomicU64>,
    }

    impl Read for Watch {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            use std::os::unix::fs::MetadataExt as _;
            if let Ok(m) = std::fs::metadata(&self.spool) {
                self.max.fetch_max(m.blocks() * 512, Ordering::Relaxed);
            }
            self.f.read(buf)
        }
    }

    /// A GPT disk (8 MiB ESP, 140 MiB ext4 with 4 KiB blocks) holding 96
    /// MiB of incompressible files, in a temporary directory.
    fn disk_with_files() -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let tree = d.path().join("tree");
        std::fs::create_dir_all(&tree).unwrap();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..4 {
            let v: Vec<u8> = (0..(24usize << 20) / 8)
                .flat_map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x.to_le_bytes()
                })
                .collect();
            std::fs::write(tree.join(format!("f{i}")), v).unwrap();
        }
        let disk = d.path().join("disk.raw");
        let st = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "truncate -s 160M {disk} && sgdisk -o -n 1:2048:+8M -t 1:ef00 -n 2:0:+140M {disk} >/dev/null && \
                 mkfs.vfat --offset 2048 {disk} 8192 >/dev/null && \
                 mke2fs -q -F -t ext4 -b 4096 -E offset=$((18432*512)) -d {tree} {disk} 140M",
                disk = disk.display(),
                tree = tree.display()
            ))
            .status()
            .unwrap();
        assert!(st.success());
        (d, disk)
    }

    /// Streams `disk` through a spool with `limits`; checks the contents
    /// and layout equal `capture_disk`'s of the file and the hash the
    /// file's (none when `hash` is off, as without a checksum); the stats
    /// and the peak allocation of the spool file.
    fn stream_and_compare(d: &Path, disk: &Path, limits: Limits, hash: bool) -> (StreamStats, u64) {
        let want = capture::capture_disk(disk, &d.join("ref"), Options::default()).unwrap();
        let spool = d.join("spool.raw");
        let out = d.join("out");
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        let max = Arc::new(AtomicU64::new(0));
        let len = std::fs::metadata(disk).unwrap().len();
        let prog = Arc::new(Progress {
            phase: AtomicU64::new(1),
            fetched: AtomicU64::new(0),
            total: AtomicU64::new(len),
            captured: AtomicU64::new(0),
            out_dir: out.clone(),
        });
        let mut src = Source {
            inner: Box::new(Watch {
                f: File::open(disk).unwrap(),
                spool: spool.clone(),
                max: max.clone(),
            }),
            hasher: hash.then(sha2::Sha256::new),
            n: 0,
            max: None,
            store_budget: None,
            next_store_check: 0,
            url: "test://disk.raw".into(),
            prog,
            failure: Arc::new(Mutex::new(None)),
        };
        let mut head = Vec::new();
        (&mut src).take(512).read_to_end(&mut head).unwrap();
        let (got, sha, stats) =
            stream_raw(&mut src, head, &spool, &out, Options::default(), limits)
                .map_err(|f| f.message)
                .unwrap();
        let _ = std::fs::remove_file(&spool);
        let got = got.unwrap();
        assert_eq!(
            serde_json::to_value(&got).unwrap(),
            serde_json::to_value(&want).unwrap()
        );
        for s in got.slots.iter().filter_map(|s| s.content_ref.as_ref()) {
            for ext in ["index", "stream"] {
                let a = std::fs::read(out.join(format!("{s}.{ext}"))).unwrap();
                let b = std::fs::read(d.join("ref").join(format!("{s}.{ext}"))).unwrap();
                assert!(a == b, "{s}.{ext} differs");
            }
        }
        let file_sha: [u8; 32] = sha2::Sha256::digest(std::fs::read(disk).unwrap()).into();
        assert_eq!(sha, hash.then_some(file_sha));
        assert_eq!(src.n, len);
        (stats, max.load(Ordering::Relaxed))
    }

    /// A raw disk with 96 MiB of incompressible files streams through a
    /// 4 MiB window: memory never holds more than the window, a release
    /// step and the metadata read ahead, the scratch file nothing; the
    /// contents and layout equal `capture_disk`'s of the file, the hash the
    /// file's. (4 KiB ext4 blocks: one flex group of bitmaps at the start;
    /// with 1 KiB blocks a 140 MiB ext4 has a second flex group whose
    /// bitmaps sit at 128 MiB, and the spool holds everything before them.)
    #[test]
    fn raw_stream_holds_a_window_not_a_copy() {
        let (d, disk) = disk_with_files();
        let limits = Limits {
            window: 4 << 20,
            mem_cap: 96 << 20,
        };
        for hash in [true, false] {
            let (stats, file_peak) = stream_and_compare(d.path(), &disk, limits, hash);
            assert!(
                stats.mem_peak > 0 && stats.mem_peak < 48 << 20,
                "the spool held {} bytes of a source with 96 MiB of files (hash {hash})",
                stats.mem_peak
            );
            assert_eq!((stats.spilled, file_peak), (0, 0), "{stats:?}");
        }
    }

    /// Past its memory cap the spool writes arriving chunks into the
    /// sparse scratch file (punched out once read): same contents, memory
    /// within the cap, the file within the window's bound.
    #[test]
    fn raw_stream_spills_past_its_memory_cap() {
        let (d, disk) = disk_with_files();
        let limits = Limits {
            window: 4 << 20,
            mem_cap: 2 << 20,
        };
        let (stats, file_peak) = stream_and_compare(d.path(), &disk, limits, true);
        assert!(stats.mem_peak <= 2 << 20, "{stats:?}");
        assert!(stats.spilled > 0, "{stats:?}");
        assert!(
            file_peak > 0 && file_peak < 48 << 20,
            "the spool file held {file_peak} bytes of a source with 96 MiB of files"
        );
    }

    #[test]
    fn tar_round_trip_and_refusals() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        std::fs::create_dir_all(src.join("img")).unwrap();
        std::fs::write(src.join("img/sda-pt.sf"), b"label: gpt\n").unwrap();
        std::fs::write(src.join("img/big"), vec![7u8; 70_000]).unwrap();
        let ar = d.path().join("a.tar");
        let st = std::process::Command::new("tar")
            .arg("-C")
            .arg(&src)
            .arg("-cf")
            .arg(&ar)
            .arg("img")
            .status()
            .unwrap();
        assert!(st.success());
        let out = d.path().join("out");
        untar(File::open(&ar).unwrap(), &out).unwrap();
        assert_eq!(
            std::fs::read(out.join("img/big")).unwrap(),
            vec![7u8; 70_000]
        );
        assert_eq!(clonezilla_root(&out), Some(out.join("img")));
        // a hand-made entry with `..`
        let mut h = [0u8; 512];
        h[..8].copy_from_slice(b"../evil\0");
        h[100..108].copy_from_slice(b"0000644\0");
        h[124..136].copy_from_slice(b"00000000000\0");
        h[156] = b'0';
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[148..156].fill(b' ');
        let sum: u64 = h.iter().map(|b| u64::from(*b)).sum();
        h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        let e = untar(&h[..], &d.path().join("out2")).unwrap_err();
        assert!(
            matches!(e, TarError::Invalid(ref m) if m.contains("..")),
            "{e:?}"
        );
        assert!(!d.path().join("evil").exists());
    }
}
