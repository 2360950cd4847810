//! Ingest benchmark (docs/benchmarks.md; docs/images.md): a 1 GiB raw GPT
//! disk image with ~400 MiB used (ESP vfat with a few files, ext4 with
//! ~390 MiB of pseudo-random files) served by our own nginx on 127.0.0.1.
//!
//! - ours: wall time of `anneal-agent ingest --url http://127.0.0.1:PORT/disk.raw`
//!   (download and capture in one pass, publish): the same work as the
//!   reference;
//! - ours with a checksum: the same with `--checksum sha256:…` (the whole
//!   source hashed too, verified before publishing): reported beside, with
//!   its own ratio, not the goal's;
//! - reference: wall time of `curl -s -o /dev/null URL` plus wall time of
//!   `anneal-agent capture` of a local copy of the same file.
//!
//! Both are measured in every run (the order alternates), each followed by
//! `sync` inside its time; the source file is in the page cache for both
//! (nginx serves it from memory, the local copy is read warm). Goal: ours <=
//! 1.2 x reference, median of per-run ratios. Writes target/bench/ingest.json.
//!
//! Run as root after bench/setup.sh:
//! `target/release/ingest-bench` (options: `--runs N` (3), `--size-mib N`
//! (1024), `--data-mib N` (390), `--dir DIR` (/var/tmp/anneal-bench-ingest),
//! `--keep` (reuse/keep the disk image), `--agent PATH`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anneal_bench::{Nginx, agent_bin, median, timed};
use anyhow::{Context as _, bail, ensure};
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    anneal_bench::run(cmd).map(drop)
}

fn sync() -> anyhow::Result<()> {
    run(&mut Command::new("sync"))
}

fn sha256(path: &Path) -> anyhow::Result<String> {
    let out = anneal_bench::run(Command::new("sha256sum").arg(path))?;
    Ok(out
        .split_whitespace()
        .next()
        .context("sha256sum printed nothing")?
        .to_owned())
}

fn fresh_dir(p: &Path) -> anyhow::Result<()> {
    if p.exists() {
        std::fs::remove_dir_all(p)?;
    }
    std::fs::create_dir_all(p)?;
    Ok(())
}

/// Whether two files hold the same bytes.
fn same_file(a: &Path, b: &Path) -> anyhow::Result<bool> {
    use std::io::Read as _;
    let (mut fa, mut fb) = (std::fs::File::open(a)?, std::fs::File::open(b)?);
    if fa.metadata()?.len() != fb.metadata()?.len() {
        return Ok(false);
    }
    let (mut x, mut y) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = fa.read(&mut x)?;
        if n == 0 {
            return Ok(true);
        }
        fb.read_exact(&mut y[..n])?;
        if x[..n] != y[..n] {
            return Ok(false);
        }
    }
}

/// What ingest's `raw source streamed` log line says (seconds from the
/// start of the body; bytes).
#[derive(Clone, Copy, Debug, Default)]
struct Internal {
    download: f64,
    capture: f64,
    mem_peak: u64,
    spilled: u64,
}

/// The fields of a `raw source streamed` log line (ANSI colours removed).
fn internal_of(line: &str) -> Option<Internal> {
    if !line.contains("raw source streamed") {
        return None;
    }
    let mut plain = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    let field = |k: &str| -> Option<&str> {
        plain
            .split_whitespace()
            .find_map(|t| t.strip_prefix(k)?.strip_prefix('='))
    };
    Some(Internal {
        download: field("download_secs")?.parse().ok()?,
        capture: field("capture_secs")?.parse().ok()?,
        mem_peak: field("mem_peak")?.parse().ok()?,
        spilled: field("spilled")?.parse().ok()?,
    })
}

/// What the measurements run against: the source served by nginx at `url`
/// and its local copy, the store, scratch and capture directories.
struct Bench {
    agent: PathBuf,
    url: String,
    /// The source's SHA-256.
    sha: String,
    local: PathBuf,
    store: PathBuf,
    scratch: PathBuf,
    cap: PathBuf,
}

/// One ingest: (wall seconds, [first bytes, download+capture, publish]
/// seconds from its phase lines, its own `raw source streamed` figures).
type Ingested = (f64, [f64; 3], Internal);

impl Bench {
    /// `anneal-agent ingest` of the URL into a fresh store (with
    /// `--checksum` when `checksum`); with `check`, what it published is
    /// compared with the local capture's contents.
    fn ingest(&self, check: bool, checksum: bool) -> anyhow::Result<Ingested> {
        fresh_dir(&self.store)?;
        fresh_dir(&self.scratch)?;
        sync()?;
        let mut lines = Vec::new();
        let mut phases: Vec<(String, f64)> = Vec::new();
        let mut internal = Internal::default();
        let start = Instant::now();
        let t = timed(|| {
            let mut child = Command::new(&self.agent)
                .arg("ingest")
                .arg("--url")
                .arg(&self.url)
                .arg("--store")
                .arg(&self.store)
                .args([
                    "--namespace",
                    "bench",
                    "--import",
                    "disk",
                    "--prefix",
                    "disk",
                ])
                .args(if checksum {
                    vec!["--checksum".to_owned(), format!("sha256:{}", self.sha)]
                } else {
                    Vec::new()
                })
                .arg("--scratch")
                .arg(&self.scratch)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()?;
            let err = child.stderr.take().context("no stderr")?;
            // read to the end (a closed pipe would fail the agent's logging)
            let err_thread = std::thread::spawn(move || {
                let mut found = None;
                for l in BufReader::new(err).lines().map_while(Result::ok) {
                    found = found.or_else(|| internal_of(&l));
                }
                found
            });
            // the time each phase is first announced (a line at each change)
            let out = BufReader::new(child.stdout.take().context("no stdout")?);
            for line in out.lines() {
                let line = line?;
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
                    && let Some(p) = v["phase"].as_str()
                    && !phases.iter().any(|(q, _)| q == p)
                {
                    phases.push((p.to_owned(), start.elapsed().as_secs_f64()));
                }
                lines.push(line);
            }
            let status = child.wait()?;
            internal = err_thread.join().ok().flatten().unwrap_or_default();
            ensure!(
                status.success(),
                "ingest failed ({status}): {}",
                lines.last().map_or("", String::as_str)
            );
            sync()
        })?;
        let stdout = lines.join("\n");
        let result = stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["event"] == "result")
            .context("ingest printed no result line")?;
        // the source's hash is reported only when a checksum asked for it
        let want_sha = if checksum { self.sha.as_str() } else { "" };
        ensure!(
            result["sourceSha256"] == want_sha,
            "ingest result: {result}"
        );
        if check {
            self.check_published(&result)?;
        }
        fresh_dir(&self.store)?;
        fresh_dir(&self.scratch)?;
        let at = |p: &str| phases.iter().find(|(q, _)| q == p).map(|(_, t)| *t);
        let (c, p) = (at("Capturing").unwrap_or(t), at("Publishing").unwrap_or(t));
        Ok((t, [c, p - c, t - p], internal))
    }

    /// What ingest published (its `result` line) is what capture produces
    /// from the file.
    fn check_published(&self, result: &serde_json::Value) -> anyhow::Result<()> {
        let mut compared = 0;
        for c in result["contents"].as_array().into_iter().flatten() {
            let name = c["name"].as_str().unwrap_or_default();
            let n = c["partitionNumber"].as_u64().unwrap_or(0);
            let ours = self.store.join("bench").join(name).join("stream");
            let theirs = self.cap.join(format!("p{n}.stream"));
            if !same_file(&ours, &theirs)? {
                bail!("{} differs from {}", ours.display(), theirs.display());
            }
            compared += 1;
        }
        ensure!(compared > 0, "ingest result names no content: {result}");
        Ok(())
    }

    /// `curl -o /dev/null` of the URL: the reference's download.
    fn curl(&self) -> anyhow::Result<f64> {
        timed(|| {
            run(Command::new("curl")
                .args(["-sf", "-o", "/dev/null"])
                .arg(&self.url))
        })
    }

    /// Diagnostic, not in the ratio: what spooling the source to a local
    /// file costs (curl into a file, then sync).
    fn spool(&self) -> anyhow::Result<f64> {
        fresh_dir(&self.scratch)?;
        let t = timed(|| {
            run(Command::new("curl")
                .args(["-sf", "-o"])
                .arg(self.scratch.join("spool.raw"))
                .arg(&self.url))?;
            sync()
        })?;
        fresh_dir(&self.scratch)?;
        Ok(t)
    }

    /// `anneal-agent capture` of the local copy: the reference's capture.
    fn capture(&self) -> anyhow::Result<f64> {
        fresh_dir(&self.cap)?;
        sync()?;
        timed(|| {
            run(Command::new(&self.agent)
                .arg("capture")
                .arg(&self.local)
                .arg("--out")
                .arg(&self.cap)
                .stderr(Stdio::null()))?;
            sync()
        })
    }
}

/// The seconds of every run.
#[derive(Debug, Default)]
struct Runs {
    ours: Vec<f64>,
    ours_ck: Vec<f64>,
    t_curl: Vec<f64>,
    t_cap: Vec<f64>,
    ph_fetch: Vec<f64>,
    ph_cap: Vec<f64>,
    ph_pub: Vec<f64>,
    t_spool: Vec<f64>,
    internals: Vec<Internal>,
}

/// `runs` runs of ingest, ingest with a checksum and the reference (curl,
/// capture), the order alternating, and the spooling diagnostic.
fn measure(b: &Bench, runs: usize) -> anyhow::Result<Runs> {
    let mut m = Runs::default();
    for r in 0..runs {
        let mut ours_run = || -> anyhow::Result<()> {
            let (t, [f, c, p], i) = b.ingest(false, false)?;
            m.ours.push(t);
            m.ph_fetch.push(f);
            m.ph_cap.push(c);
            m.ph_pub.push(p);
            m.internals.push(i);
            Ok(())
        };
        if r % 2 == 0 {
            ours_run()?;
            m.ours_ck.push(b.ingest(false, true)?.0);
            m.t_curl.push(b.curl()?);
            m.t_cap.push(b.capture()?);
        } else {
            m.t_curl.push(b.curl()?);
            m.t_cap.push(b.capture()?);
            m.ours_ck.push(b.ingest(false, true)?.0);
            ours_run()?;
        }
        m.t_spool.push(b.spool()?);
        eprintln!(
            "run {r}: ingest {:.2}s (first bytes {:.2}s, download+capture {:.2}s, publish {:.2}s), with --checksum {:.2}s | curl {:.2}s + capture {:.2}s = {:.2}s | diagnostic: curl to a file + sync {:.2}s",
            m.ours[r],
            m.ph_fetch[r],
            m.ph_cap[r],
            m.ph_pub[r],
            m.ours_ck[r],
            m.t_curl[r],
            m.t_cap[r],
            m.t_curl[r] + m.t_cap[r],
            m.t_spool[r]
        );
        let i = &m.internals[r];
        eprintln!(
            "run {r}: inside ingest: body read at {:.2}s, capture returned at {:.2}s; spool memory peak {} MiB, spilled {} MiB",
            i.download,
            i.capture,
            i.mem_peak >> 20,
            i.spilled >> 20
        );
    }
    Ok(m)
}

/// The medians and ratios of `m`: written to target/bench/ingest.json and
/// printed.
fn report(
    m: &Runs,
    disk_bytes: u64,
    data_mib: u64,
    load_before: Option<String>,
) -> anyhow::Result<()> {
    let Runs {
        ours,
        ours_ck,
        t_curl,
        t_cap,
        ph_fetch,
        ph_cap,
        ph_pub,
        t_spool,
        internals,
    } = m;
    let runs = ours.len();
    let reference: Vec<f64> = t_curl.iter().zip(t_cap).map(|(a, b)| a + b).collect();
    let mut per_run: Vec<f64> = ours
        .iter()
        .zip(&reference)
        .filter_map(|(o, r)| anneal_bench::ratio(*o, *r))
        .collect();
    let ratio = median(&mut per_run);
    let mut per_run_ck: Vec<f64> = ours_ck
        .iter()
        .zip(&reference)
        .filter_map(|(o, r)| anneal_bench::ratio(*o, *r))
        .collect();
    let ratio_ck = median(&mut per_run_ck);
    let mo_ck = median(&mut ours_ck.clone());
    let (mo, mc, mp, mr) = (
        median(&mut ours.clone()),
        median(&mut t_curl.clone()),
        median(&mut t_cap.clone()),
        median(&mut reference.clone()),
    );
    let pass = ratio <= 1.2;
    let report = serde_json::json!({
        "benchmark": "ingest",
        "diskBytes": disk_bytes,
        "dataMiB": data_mib,
        "runs": runs,
        "seconds": { "ingest": mo, "curl": mc, "capture": mp, "reference": mr },
        "ratio (median of per-run ingest / (curl + capture))": ratio,
        "goal": "<= 1.2",
        "withChecksum (ingest --checksum: the whole source hashed as well; not the goal's figure)": {
            "seconds": mo_ck,
            "ratio": ratio_ck,
        },
        "pass": pass,
        "ingestPhasesSeconds (median; from the phase lines on stdout)": {
            "firstBytes": median(&mut ph_fetch.clone()),
            "downloadHashCapture": median(&mut ph_cap.clone()),
            "publishAndSync": median(&mut ph_pub.clone()),
        },
        "diagnosticCurlToFileAndSyncSeconds": median(&mut t_spool.clone()),
        "insideIngestSeconds (median; from its 'raw source streamed' log line, from the start of the body)": {
            "bodyRead": median(&mut internals.iter().map(|i| i.download).collect::<Vec<_>>()),
            "captureReturned": median(&mut internals.iter().map(|i| i.capture).collect::<Vec<_>>()),
        },
        "spoolMemoryPeakBytes": internals.iter().map(|i| i.mem_peak).max(),
        "spoolSpilledBytes": internals.iter().map(|i| i.spilled).max(),
        "allRuns": {
            "ingest": ours, "ingestWithChecksum": ours_ck, "curl": t_curl, "capture": t_cap,
            "ingestFetch": ph_fetch, "ingestCapture": ph_cap, "ingestPublish": ph_pub,
            "curlToFileAndSync": t_spool,
        },
        "loadAverage": { "before": load_before, "after": anneal_bench::load_average() },
    });
    anneal_bench::write_json("ingest", &report)?;
    println!(
        "ingest phases (median): first bytes {:.2}s, download+capture {:.2}s, publish+sync {:.2}s; diagnostic curl to a file + sync {:.2}s",
        median(&mut ph_fetch.clone()),
        median(&mut ph_cap.clone()),
        median(&mut ph_pub.clone()),
        median(&mut t_spool.clone())
    );
    println!(
        "ingest: {mo:.2}s / (curl {mc:.2}s + capture {mp:.2}s = {mr:.2}s) = {ratio:.2} (goal <= 1.2) {}",
        if pass { "PASS" } else { "FAIL" }
    );
    println!(
        "ingest --checksum (the whole source hashed as well): {mo_ck:.2}s / {mr:.2}s = {ratio_ck:.2} (beside the goal)"
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let runs: usize = anneal_bench::option_or("--runs", 3)?;
    let size_mib: u64 = anneal_bench::option_or("--size-mib", 1024)?;
    let data_mib: u64 = anneal_bench::option_or("--data-mib", 390)?;
    let keep = anneal_bench::flag("--keep");
    let dir = PathBuf::from(
        anneal_bench::option("--dir").unwrap_or_else(|| "/var/tmp/anneal-bench-ingest".into()),
    );
    let agent = agent_bin()?;
    let load_before = anneal_bench::load_average();

    let src_dir = dir.join("src");
    std::fs::create_dir_all(&src_dir)?;
    let disk = src_dir.join("disk.raw");
    if !(keep && disk.is_file()) {
        eprintln!("building a {size_mib} MiB GPT disk image with {data_mib} MiB of ext4 files...");
        anneal_bench::gpt_disk(&src_dir, size_mib, data_mib)?;
    }
    let disk_bytes = std::fs::metadata(&disk)?.len();
    let sha = sha256(&disk)?;
    let local = dir.join("local.raw");
    run(Command::new("cp")
        .arg("--sparse=always")
        .arg(&disk)
        .arg(&local))?;

    let nginx = Nginx::start(&dir.join("nginx"), &src_dir, 1, None)?;
    let b = Bench {
        agent,
        url: format!("http://127.0.0.1:{}/disk.raw", nginx.port),
        sha,
        local,
        store: dir.join("store"),
        scratch: dir.join("scratch"),
        cap: dir.join("capture"),
    };

    // warm-up: the source into the page cache, both binaries loaded; the
    // contents compared once
    eprintln!("warm-up and check (ingest output == capture output)...");
    b.curl()?;
    b.capture()?;
    b.ingest(true, false)?;
    b.ingest(true, true)?;

    let m = measure(&b, runs)?;
    drop(nginx);
    report(&m, disk_bytes, data_mib, load_before)?;
    let _ = std::fs::remove_file(&b.local);
    for d in [&b.store, &b.scratch, &b.cap] {
        let _ = std::fs::remove_dir_all(d);
    }
    if !keep {
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(())
}
