//! Deploy: one [`DeployPlan`] onto the machine's disks (the agent half of
//! content writing, docs/deploy.md "3. The agent"), and the wipe of a
//! Recycle.
//!
//! For each disk of the plan, before anything is written: the disk's
//! identity is re-checked (serial number / WWN from sysfs), its `layout` is
//! parsed (unknown fields refused) and validated against the target, every
//! index is fetched and checked against its SHA-256 and its slot. Then each
//! disk's old partition table is invalidated (the first write), each
//! content is streamed from the content server into verified writes at its
//! slot ([`stream`]), blank slots get their swap header or filesystem, the
//! cloud-init config drive (when the plan has one) its FAT file system in the
//! partition reserved for it at the end of the OS disk ([`configdrive`]), the
//! partition table is written last and the disk synced. The post-install
//! steps run after every disk is written, through the hook runner the
//! caller passes. On any failure after the first write every disk touched
//! is invalidated again (no partition table: it cannot boot half-written).

mod configdrive;
mod stream;
#[cfg(feature = "swarm")]
mod swarm;
mod wipe;

pub mod agent;
pub mod cli;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anneal_api::agent::{
    DeployPlan, PartitionProgress, PlannedConfigDrive, PlannedDisk, PlannedStep,
};
use anneal_image::format::{ContentIndex, FormatError};
use anneal_image::layout::{self, Layout, LayoutError};
use anneal_image::restore::{RestoreError, Target};
use anneal_image::write::SlotRange;
use serde::Serialize;

pub use wipe::{WipeError, WipeReport, wipe};

use stream::Counters;

/// Errors of a deploy; each names the disk or content and what to check.
#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    /// The plan itself is inconsistent.
    #[error("the deploy plan is invalid: {0}; check the DeployRun's plan")]
    Plan(String),
    /// The disk at the path is not the disk the plan resolved.
    #[error(
        "disk {device}: {what}; the disk names drifted or the hardware changed: re-inspect the Machine"
    )]
    Identity {
        /// device path
        device: String,
        /// what differs
        what: String,
    },
    /// The plan's layout does not parse.
    #[error("disk {device}: the plan's layout is not a valid layout.json")]
    LayoutJson {
        /// device path
        device: String,
        /// cause
        #[source]
        source: serde_json::Error,
    },
    /// The layout does not fit the disk.
    #[error("disk {device}: the layout does not fit the target ({size} bytes)")]
    Layout {
        /// device path
        device: String,
        /// target size
        size: u64,
        /// cause
        #[source]
        source: LayoutError,
    },
    /// Opening the target failed.
    #[error("disk {device}: cannot open the target")]
    Open {
        /// device path
        device: String,
        /// cause
        #[source]
        source: RestoreError,
    },
    /// An HTTP request failed.
    #[error("content {content}: fetching the {what} failed")]
    Fetch {
        /// content name
        content: String,
        /// `index` or `stream`
        what: &'static str,
        /// cause
        #[source]
        source: crate::fetch::FetchError,
    },
    /// Reading the index body failed.
    #[error("content {content}: reading the index from {url} failed")]
    ReadIndex {
        /// content name
        content: String,
        /// URL
        url: String,
        /// cause
        #[source]
        source: std::io::Error,
    },
    /// The index differs from the one the PartitionContent recorded.
    #[error(
        "content {content}: the index at {url} has SHA-256 {got}, the plan expects {want}; refused before any write (the content store holds another index than the PartitionContent's status)"
    )]
    IndexHash {
        /// content name
        content: String,
        /// URL
        url: String,
        /// expected
        want: String,
        /// found
        got: String,
    },
    /// The index does not parse.
    #[error("content {content}: the index is invalid")]
    Index {
        /// content name
        content: String,
        /// cause
        #[source]
        source: FormatError,
    },
    /// A range kept failing.
    #[error(
        "content {content}: piece {piece} (stream bytes {start}..{end}) could not be fetched after {attempts} attempts: {reason}; check the content server"
    )]
    Range {
        /// content name
        content: String,
        /// piece number
        piece: u64,
        /// first stream byte
        start: u64,
        /// end stream byte
        end: u64,
        /// attempts made
        attempts: u32,
        /// last cause
        reason: String,
    },
    /// A piece kept failing its SHA-1.
    #[error(
        "content {content}: piece {piece} (stream bytes {start}..{end}) failed its SHA-1 {attempts} times; the content server serves corrupt data for it: run `anneal-agent store verify` on the content"
    )]
    PieceHash {
        /// content name
        content: String,
        /// piece number
        piece: u64,
        /// first stream byte
        start: u64,
        /// end stream byte
        end: u64,
        /// attempts made
        attempts: u32,
    },
    /// The whole stream's SHA-256 differs.
    #[error("content {content}: the stream's SHA-256 is {got}, the plan expects {want}")]
    StreamHash {
        /// content name
        content: String,
        /// expected
        want: String,
        /// found
        got: String,
    },
    /// Contents, slots and sizes disagree.
    #[error("{0}")]
    Mismatch(String),
    /// A content does not fit its slot, or writing it there failed.
    #[error(transparent)]
    Slot(anneal_image::write::WriteError),
    /// A content of the plan does not fit its slot (checked before the
    /// first write).
    #[error("disk {device}, slot {slot}")]
    SlotOf {
        /// device path
        device: String,
        /// partition number
        slot: u32,
        /// cause
        #[source]
        source: anneal_image::write::WriteError,
    },
    /// A write to the target failed.
    #[error("content {content}: {what}")]
    Write {
        /// content name (or the disk for table writes)
        content: String,
        /// what was written
        what: String,
        /// cause
        #[source]
        source: std::io::Error,
    },
    /// A step on a disk failed (table, swap header, mkfs, sync).
    #[error("disk {device}: {step}")]
    Step {
        /// device path
        device: String,
        /// what failed
        step: String,
        /// cause
        #[source]
        source: std::io::Error,
    },
    /// The content's swarm fetch failed (stalled without HTTP fallback, a
    /// write or the stream check failed).
    #[cfg(feature = "swarm")]
    #[error("content {content}: fetching over BitTorrent failed")]
    Swarm {
        /// the content
        content: String,
        /// cause
        #[source]
        source: crate::swarm::SwarmError,
    },
    /// The progress callback answered abort.
    #[error("aborted by the manager during {phase}")]
    Aborted {
        /// the phase
        phase: &'static str,
    },
    /// The post-install steps failed.
    #[error("post-install: {0}")]
    Hooks(String),
}

/// The phases of a run, as the agent API names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Phase {
    /// Checking the disks, fetching indexes, invalidating old tables.
    Partitioning,
    /// Streaming contents onto the slots.
    WritingContent,
    /// Blank slots, partition tables, sync.
    Finalizing,
    /// The post-install steps.
    RunningPostHook,
}

impl Phase {
    /// The name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Partitioning => "Partitioning",
            Self::WritingContent => "WritingContent",
            Self::Finalizing => "Finalizing",
            Self::RunningPostHook => "RunningPostHook",
        }
    }
}

/// A progress report.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// Current phase.
    pub phase: Phase,
    /// Per-partition bytes done/total (content slots of every disk).
    pub partitions: Vec<PartitionProgress>,
    /// Bytes fetched over HTTP so far.
    pub http_bytes: u64,
    /// BitTorrent figures (contents with a swarm).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer: Option<anneal_api::agent::SwarmTransfer>,
    /// Lines since the last report (retries).
    pub log_lines: Vec<String>,
}

/// The callback's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Keep going.
    Continue,
    /// Stop, leaving the disks unbootable.
    Abort,
}

/// Settings of a deploy.
#[derive(Debug, Clone)]
pub struct DeployOptions {
    /// Report at least this often.
    pub progress_interval: Duration,
    /// Bytes per HTTP range (rounded down to whole pieces, at least one).
    pub range_bytes: u64,
    /// Retries of one piece (fetch errors or SHA-1 mismatch) after the first.
    pub retries: u32,
    /// The first backoff (doubled on every retry, at most 8 s).
    pub backoff: Duration,
    /// Connect and read-stall timeout.
    pub timeout: Duration,
    /// Allow a regular file as a target (tests, bench); it is created or
    /// extended to the layout's `diskSize`.
    pub allow_files: bool,
    /// Read sysfs under this root for the identity check.
    pub sysfs_root: PathBuf,
}

impl Default for DeployOptions {
    fn default() -> Self {
        Self {
            progress_interval: Duration::from_secs(2),
            range_bytes: 32 << 20,
            retries: 4,
            backoff: Duration::from_millis(500),
            timeout: Duration::from_secs(30),
            allow_files: false,
            sysfs_root: PathBuf::from("/"),
        }
    }
}

/// What the hook runner gets: the written disks.
#[derive(Debug, Clone)]
pub struct HookContext {
    /// The DeployRun.
    pub run_id: String,
    /// The OS disk (none when the plan writes data disks only).
    pub os_disk: Option<PathBuf>,
    /// The OS disk's layout with the final slot sizes (a grown last slot
    /// has its size on this disk, `grow` cleared).
    pub os_layout: Option<Layout>,
    /// The data disks, in plan order.
    pub data_disks: Vec<PathBuf>,
}

/// The post-install runner: runs `steps` on the written disks.
pub type HookRunner<'a> = dyn FnMut(&HookContext, &[PlannedStep]) -> Result<(), String> + 'a;

/// A runner for agent builds without post-install steps: succeeds on an
/// empty list, refuses any step.
pub fn no_hooks(_: &HookContext, steps: &[PlannedStep]) -> Result<(), String> {
    match steps.first() {
        None => Ok(()),
        Some(s) => Err(format!(
            "hook {} step {}: this agent build runs no post-install steps (agent/src/posthook is not wired into deploy)",
            s.hook, s.step
        )),
    }
}

/// Start and end of one phase (milliseconds since the Unix epoch).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PhaseTiming {
    /// The phase.
    pub phase: Phase,
    /// Start.
    pub started_ms: u64,
    /// End.
    pub ended_ms: u64,
}

/// A run that worked.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Finished {
    /// Phase timings.
    pub timings: Vec<PhaseTiming>,
    /// Bytes fetched over HTTP.
    pub http_bytes: u64,
    /// Content bytes written.
    pub content_bytes: u64,
    /// Wall time.
    pub seconds: f64,
    /// BitTorrent figures (contents with a swarm).
    pub transfer: Option<anneal_api::agent::SwarmTransfer>,
}

/// A run that failed.
#[derive(Debug)]
pub struct Failed {
    /// The phase it failed in.
    pub phase: Phase,
    /// Why.
    pub error: DeployError,
    /// Phase timings up to the failure.
    pub timings: Vec<PhaseTiming>,
    /// Whether a disk was written (and then invalidated).
    pub wrote: bool,
}

impl Failed {
    /// The reason for the agent API: the error chain, sanitized and capped.
    pub fn reason(&self) -> String {
        anneal_api::agent::sanitize_reason(&crate::jsonl::chain(&self.error))
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The run's reporting state.
struct Reporter<'a> {
    cb: &'a mut dyn FnMut(&Progress) -> Control,
    interval: Duration,
    last: Instant,
    progress: Progress,
    timings: Vec<PhaseTiming>,
    counters: Arc<Counters>,
}

impl Reporter<'_> {
    fn phase(&mut self, phase: Phase) -> Result<(), DeployError> {
        let now = now_ms();
        if let Some(t) = self.timings.last_mut() {
            t.ended_ms = now;
        }
        self.timings.push(PhaseTiming {
            phase,
            started_ms: now,
            ended_ms: now,
        });
        self.progress.phase = phase;
        self.send(true)
    }

    fn close(&mut self) {
        if let Some(t) = self.timings.last_mut() {
            t.ended_ms = now_ms();
        }
    }

    fn send(&mut self, force: bool) -> Result<(), DeployError> {
        if !force && self.last.elapsed() < self.interval {
            return Ok(());
        }
        self.last = Instant::now();
        self.progress.http_bytes = self.counters.http_bytes.load(Ordering::Relaxed);
        let c = (self.cb)(&self.progress);
        self.progress.log_lines.clear();
        match c {
            Control::Continue => Ok(()),
            Control::Abort => Err(DeployError::Aborted {
                phase: self.progress.phase.as_str(),
            }),
        }
    }
}

/// The writer's tick for one content: its partition's row.
struct ContentTick<'r, 'a> {
    rep: &'r mut Reporter<'a>,
    row: usize,
}

impl stream::Tick for ContentTick<'_, '_> {
    fn tick(&mut self, written: u64, log: Option<String>) -> Result<(), DeployError> {
        if let Some(p) = self.rep.progress.partitions.get_mut(self.row) {
            p.bytes_done = written;
        }
        let force = log.is_some();
        if let Some(l) = log {
            tracing::warn!(line = %l, "deploy");
            self.rep.progress.log_lines.push(l);
        }
        self.rep.send(force)
    }
}

/// A disk checked and ready to write.
struct Prepared<'p> {
    disk: &'p PlannedDisk,
    target: Target,
    layout: Layout,
    sizes: Vec<u64>,
    /// Per slot: the content (plan entry, index, progress row).
    contents: Vec<Option<(&'p anneal_api::agent::PlannedContent, ContentIndex, usize)>>,
    /// The config drive (OS disk only): its partition is the layout's last
    /// slot.
    config_drive: Option<&'p PlannedConfigDrive>,
    wrote: bool,
}

/// Runs `plan`: see the module documentation. `report` is called at least
/// every `opts.progress_interval` and on every phase change and retry;
/// `hooks` runs the post-install steps after every disk is written.
pub fn run_plan(
    plan: &DeployPlan,
    opts: &DeployOptions,
    report: &mut dyn FnMut(&Progress) -> Control,
    hooks: &mut HookRunner<'_>,
) -> Result<Finished, Box<Failed>> {
    let started = Instant::now();
    let mut rep = Reporter {
        cb: report,
        interval: opts.progress_interval.max(Duration::from_millis(100)),
        last: Instant::now(),
        progress: Progress {
            phase: Phase::Partitioning,
            partitions: Vec::new(),
            http_bytes: 0,
            transfer: None,
            log_lines: Vec::new(),
        },
        timings: Vec::new(),
        counters: Arc::new(Counters::default()),
    };
    let mut disks: Vec<Prepared<'_>> = Vec::new();
    let res = run_inner(plan, opts, &mut rep, &mut disks, hooks);
    rep.close();
    match res {
        Ok(content_bytes) => Ok(Finished {
            timings: rep.timings,
            http_bytes: rep.counters.http_bytes.load(Ordering::Relaxed),
            content_bytes,
            seconds: started.elapsed().as_secs_f64(),
            transfer: rep.progress.transfer.clone(),
        }),
        Err(error) => {
            let mut wrote = false;
            for d in &disks {
                if !d.wrote {
                    continue;
                }
                wrote = true;
                let size = d.target.size();
                let mut f = d.target.file();
                let inv = layout::invalidate(&mut f, existing_len(&d.target, size))
                    .and_then(|()| d.target.sync());
                match inv {
                    Ok(()) => {
                        tracing::error!(disk = %d.disk.device_name, error = %crate::jsonl::chain(&error), "deploy failed; the disk's partition table was invalidated");
                    }
                    Err(e) => {
                        tracing::error!(disk = %d.disk.device_name, error = %e, "invalidating the disk after a failed deploy failed too");
                    }
                }
            }
            Err(Box::new(Failed {
                phase: rep.progress.phase,
                error,
                timings: rep.timings,
                wrote,
            }))
        }
    }
}

/// The bytes of a target that exist now (a file still to be grown at sync
/// only has its current length).
fn existing_len(t: &Target, size: u64) -> u64 {
    t.file().metadata().map_or(size, |m| {
        if t.is_block_device() {
            size
        } else {
            m.len().min(size)
        }
    })
}

fn run_inner<'p>(
    plan: &'p DeployPlan,
    opts: &DeployOptions,
    rep: &mut Reporter<'_>,
    disks: &mut Vec<Prepared<'p>>,
    hooks: &mut HookRunner<'_>,
) -> Result<u64, DeployError> {
    rep.phase(Phase::Partitioning)?;
    if plan.disks.is_empty() {
        return Err(DeployError::Plan(format!(
            "run {} has no disk to write",
            plan.run_id
        )));
    }
    if plan.disks.iter().filter(|d| d.os).count() > 1 {
        return Err(DeployError::Plan(format!(
            "run {} has more than one OS disk",
            plan.run_id
        )));
    }
    if plan.config_drive.is_some() && !plan.disks.iter().any(|d| d.os) {
        return Err(DeployError::Plan(format!(
            "run {} has a config drive but no OS disk to put it on",
            plan.run_id
        )));
    }
    let tls = if plan
        .disks
        .iter()
        .flat_map(|d| &d.contents)
        .any(|c| c.index_url.starts_with("https:") || c.stream_url.starts_with("https:"))
    {
        Some(
            crate::fetch::tls_config(None).map_err(|source| DeployError::Fetch {
                content: "(all)".into(),
                what: "TLS configuration",
                source,
            })?,
        )
    } else {
        None
    };
    // check everything before the first write
    for (i, d) in plan.disks.iter().enumerate() {
        if plan.disks[..i]
            .iter()
            .any(|o| same_path(&o.device_name, &d.device_name))
        {
            return Err(DeployError::Plan(format!(
                "disk {} appears twice",
                d.device_name
            )));
        }
        let cd = plan.config_drive.as_ref().filter(|_| d.os);
        disks.push(prepare(d, cd, opts, rep, tls.as_ref())?);
    }
    for d in disks.iter_mut() {
        let size = d.target.size();
        let mut f = d.target.file();
        d.wrote = true;
        layout::invalidate(&mut f, existing_len(&d.target, size)).map_err(|source| {
            DeployError::Step {
                device: d.disk.device_name.clone(),
                step: "clearing the old partition table".into(),
                source,
            }
        })?;
    }
    rep.phase(Phase::WritingContent)?;
    let mut content_bytes = 0u64;
    #[cfg(feature = "swarm")]
    let mut swarms = swarm::Swarms::default();
    for d in disks.iter_mut() {
        for (si, slot) in d.layout.slots.iter().enumerate() {
            let Some((c, index, row)) = &d.contents[si] else {
                continue;
            };
            tracing::info!(disk = %d.disk.device_name, slot = slot.number, content = %c.name, bytes = c.stream_bytes, "writing content");
            let at = SlotRange {
                offset: slot.start_bytes,
                size: d.sizes[si],
            };
            #[cfg(feature = "swarm")]
            if let Some(sw) = &c.swarm
                && swarms.fetch((d.target.file(), at), c, sw, index, rep, *row)?
            {
                content_bytes += c.stream_bytes;
                continue;
            }
            #[cfg(not(feature = "swarm"))]
            if c.swarm.is_some() {
                let line = format!(
                    "content {}: this agent was built without BitTorrent; fetching it over HTTP",
                    c.name
                );
                tracing::warn!(line = %line, "deploy");
                rep.progress.log_lines.push(line);
            }
            let counters = rep.counters.clone();
            let mut tick = ContentTick {
                rep: &mut *rep,
                row: *row,
            };
            let src = stream::HttpSource {
                c,
                index,
                opts,
                tls: tls.as_ref(),
                counters: &counters,
            };
            stream::write_content(&mut d.target, at, &src, &mut tick)?;
            content_bytes += c.stream_bytes;
        }
    }
    rep.phase(Phase::Finalizing)?;
    for d in disks.iter_mut() {
        let line = finalize(d)?;
        if let Some(l) = line {
            tracing::info!(disk = %d.disk.device_name, line = %l, "deploy");
            rep.progress.log_lines.push(l);
        }
        rep.send(false)?;
    }
    // The run's other machines fetch from this one until the seed policy
    // ends it; the post-install steps may change what it serves.
    #[cfg(feature = "swarm")]
    swarms.linger(plan.seeding, rep)?;
    rep.phase(Phase::RunningPostHook)?;
    let ctx = HookContext {
        run_id: plan.run_id.clone(),
        os_disk: disks
            .iter()
            .find(|d| d.disk.os)
            .map(|d| PathBuf::from(&d.disk.device_name)),
        os_layout: disks.iter().find(|d| d.disk.os).map(|d| {
            let mut l = d.layout.clone();
            for (s, size) in l.slots.iter_mut().zip(&d.sizes) {
                s.size_bytes = *size;
                s.grow = false;
            }
            l
        }),
        data_disks: disks
            .iter()
            .filter(|d| !d.disk.os)
            .map(|d| PathBuf::from(&d.disk.device_name))
            .collect(),
    };
    hooks(&ctx, &plan.steps).map_err(DeployError::Hooks)?;
    rep.send(true)?;
    Ok(content_bytes)
}

fn same_path(a: &str, b: &str) -> bool {
    let canon = |p: &str| std::fs::canonicalize(p).unwrap_or_else(|_| PathBuf::from(p));
    a == b || canon(a) == canon(b)
}

/// Identity, layout, target and indexes of one disk; writes nothing.
fn prepare<'p>(
    d: &'p PlannedDisk,
    config_drive: Option<&'p PlannedConfigDrive>,
    opts: &DeployOptions,
    rep: &mut Reporter<'_>,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Prepared<'p>, DeployError> {
    let dev = d.device_name.as_str();
    let layout: Layout =
        serde_json::from_value(d.layout.clone()).map_err(|source| DeployError::LayoutJson {
            device: dev.to_string(),
            source,
        })?;
    let path = Path::new(dev);
    let meta = std::fs::metadata(path);
    let is_blk = meta.as_ref().is_ok_and(|m| {
        use std::os::unix::fs::FileTypeExt as _;
        m.file_type().is_block_device()
    });
    if is_blk {
        check_identity(d, opts)?;
    } else if !opts.allow_files {
        return Err(DeployError::Identity {
            device: dev.to_string(),
            what: match meta {
                Ok(_) => "not a block device".into(),
                Err(e) => format!("not found ({e})"),
            },
        });
    } else if meta.as_ref().is_ok_and(|m| !m.is_file()) {
        return Err(DeployError::Identity {
            device: dev.to_string(),
            what: "neither a block device nor a regular file".into(),
        });
    }
    let min = (!is_blk).then_some(layout.disk_size);
    let target = Target::open(path, min).map_err(|source| DeployError::Open {
        device: dev.to_string(),
        source,
    })?;
    let size = target.size();
    let layout = with_config_drive(layout, size, config_drive, dev)?;
    layout::validate(&layout, size).map_err(|source| DeployError::Layout {
        device: dev.to_string(),
        size,
        source,
    })?;
    let sizes = layout::final_sizes(&layout, size);
    let mut contents = Vec::new();
    for c in &d.contents {
        if !layout
            .slots
            .iter()
            .any(|s| s.content_ref.as_deref() == Some(c.name.as_str()))
        {
            return Err(DeployError::Plan(format!(
                "content {} of disk {dev} is named by no slot's contentRef",
                c.name
            )));
        }
    }
    for (slot, slot_size) in layout.slots.iter().zip(&sizes) {
        let Some(name) = slot.content_ref.as_deref() else {
            if slot.fs_type.as_deref() == Some("swap")
                && *slot_size < 2 * anneal_image::fs::SWAP_PAGE
            {
                return Err(DeployError::Mismatch(format!(
                    "disk {dev}: swap slot {} is too small",
                    slot.number
                )));
            }
            contents.push(None);
            continue;
        };
        let c = d.contents.iter().find(|c| c.name == name).ok_or_else(|| {
            DeployError::Plan(format!(
                "disk {dev}: slot {} names content {name}, which the plan does not carry",
                slot.number
            ))
        })?;
        if c.slot != slot.number {
            return Err(DeployError::Plan(format!(
                "content {name} is planned for partition {} but the layout puts it in slot {}",
                c.slot, slot.number
            )));
        }
        let index = stream::fetch_index(c, opts, tls, &rep.counters)?;
        let at = SlotRange {
            offset: slot.start_bytes,
            size: *slot_size,
        };
        anneal_image::write::check_slot(name, &index, at, size).map_err(|source| {
            DeployError::SlotOf {
                device: dev.to_string(),
                slot: slot.number,
                source,
            }
        })?;
        let row = rep.progress.partitions.len();
        rep.progress.partitions.push(PartitionProgress {
            number: slot.number,
            bytes_done: 0,
            bytes_total: c.stream_bytes,
        });
        contents.push(Some((c, index, row)));
        rep.send(false)?;
    }
    Ok(Prepared {
        disk: d,
        target,
        layout,
        sizes,
        contents,
        config_drive,
        wrote: false,
    })
}

/// The layout with the config drive's partition reserved at the end of a
/// `size`-byte disk, its label, names and sizes checked (nothing written).
fn with_config_drive(
    layout: Layout,
    size: u64,
    config_drive: Option<&PlannedConfigDrive>,
    dev: &str,
) -> Result<Layout, DeployError> {
    let Some(cd) = config_drive else {
        return Ok(layout);
    };
    let l = configdrive::reserve(&layout, size, cd).map_err(|source| DeployError::Layout {
        device: dev.to_string(),
        size,
        source,
    })?;
    let part = l.slots.last().map_or(0, |s| s.size_bytes);
    configdrive::check(cd, part).map_err(|e| DeployError::Plan(format!("disk {dev}: {e}")))?;
    Ok(l)
}

/// The serial number / WWN the plan resolved, against sysfs.
fn check_identity(d: &PlannedDisk, opts: &DeployOptions) -> Result<(), DeployError> {
    if d.serial_number.is_none() && d.wwn.is_none() {
        return Ok(());
    }
    let dev = d.device_name.as_str();
    let real = std::fs::canonicalize(dev).unwrap_or_else(|_| PathBuf::from(dev));
    let kname = real
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let hw = crate::inventory::Root::new(&opts.sysfs_root)
        .collect(crate::inventory::Options {
            include_removable: true,
            probe_filesystems: false,
        })
        .map_err(|e| DeployError::Identity {
            device: dev.to_string(),
            what: format!("reading sysfs failed: {}", crate::jsonl::chain(&e)),
        })?;
    let Some(found) = hw.disks.iter().find(|x| x.device_name == kname) else {
        return Err(DeployError::Identity {
            device: dev.to_string(),
            what: format!("no disk {kname} in sysfs to compare its serial number / WWN with"),
        });
    };
    if let Some(want) = &d.serial_number
        && found.serial_number.as_deref() != Some(want.as_str())
    {
        return Err(DeployError::Identity {
            device: dev.to_string(),
            what: format!(
                "serial number is {:?}, the plan expects {want:?}",
                found.serial_number.as_deref().unwrap_or("")
            ),
        });
    }
    if let Some(want) = &d.wwn
        && !found
            .wwn
            .as_deref()
            .is_some_and(|w| w.eq_ignore_ascii_case(want))
    {
        return Err(DeployError::Identity {
            device: dev.to_string(),
            what: format!(
                "WWN is {:?}, the plan expects {want:?}",
                found.wwn.as_deref().unwrap_or("")
            ),
        });
    }
    Ok(())
}

/// Blank slots, the config drive, flush, the partition table last, flush.
/// Returns the config drive's log line (names and sizes only).
fn finalize(d: &mut Prepared<'_>) -> Result<Option<String>, DeployError> {
    let dev = d.disk.device_name.clone();
    let step = |step: String| {
        let device = dev.clone();
        move |source| DeployError::Step {
            device,
            step,
            source,
        }
    };
    for ((slot, size), c) in d.layout.slots.iter().zip(&d.sizes).zip(&d.contents) {
        if c.is_some() {
            continue;
        }
        if slot.fs_type.as_deref() == Some("swap") {
            let uuid = slot
                .uuid
                .as_deref()
                .and_then(anneal_image::format::parse_uuid_string)
                .unwrap_or_default();
            let hdr =
                anneal_image::fs::swap_header(*size, &uuid, slot.label.as_deref().unwrap_or(""));
            d.target
                .write_at(&hdr, slot.start_bytes)
                .map_err(step(format!(
                    "writing the swap header of slot {}",
                    slot.number
                )))?;
        } else if let Some(fs) = slot.fs_type.as_deref() {
            d.target
                .sync()
                .map_err(step("flushing before mkfs".into()))?;
            anneal_image::restore::mkfs(
                Path::new(&dev),
                fs,
                slot.start_bytes,
                *size,
                slot.label.as_deref(),
            )
            .map_err(step(format!("mkfs {fs} on slot {}", slot.number)))?;
        }
    }
    let mut line = None;
    if let Some(cd) = d.config_drive {
        let what = format!("writing the config drive (partition {})", cd.partition);
        d.target.sync().map_err(step(what.clone()))?;
        let (slot, size) = d
            .layout
            .slots
            .iter()
            .zip(&d.sizes)
            .find(|(s, _)| s.number == cd.partition)
            .ok_or_else(|| DeployError::Plan(format!("{what}: no such slot")))?;
        let w =
            configdrive::write(d.target.file(), slot.start_bytes, *size, cd).map_err(step(what))?;
        line = Some(configdrive::summary(cd, *size, &w));
    }
    d.target
        .sync()
        .map_err(step("flushing the contents".into()))?;
    let size = d.target.size();
    let mut f = d.target.file();
    layout::write_table(&d.layout, &mut f, size)
        .map_err(|e| step("writing the partition table".into())(std::io::Error::other(e)))?;
    d.target
        .sync()
        .map_err(step("flushing the partition table".into()))?;
    if d.target.is_block_device() {
        // let the kernel see the new partitions (hooks need them)
        if let Err(e) = wipe::reread_partitions(d.target.file()) {
            tracing::warn!(disk = %dev, error = %e, "re-reading the partition table failed");
        }
    }
    Ok(line)
}
