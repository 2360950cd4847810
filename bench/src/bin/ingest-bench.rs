//! Ingest benchmark (issue 12, "Images into the cluster"): a 1 GiB raw GPT
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
    let url = format!("http://127.0.0.1:{}/disk.raw", nginx.port);
    let store = dir.join("store");
    let scratch = dir.join("scratch");
    let cap = dir.join("capture");

    let ingest = |check: bool, checksum: bool| -> anyhow::Result<(f64, [f64; 3], Internal)> {
        fresh_dir(&store)?;
        fresh_dir(&scratch)?;
        sync()?;
        let mut lines = Vec::new();
        let mut phases: Vec<(String, f64)> = Vec::new();
        let mut internal = Internal::default();
        let start = Instant::now();
        let t = timed(|| {
            let mut child = Command::new(&agent)
                .arg("ingest")
                .arg("--url")
                .arg(&url)
                .arg("--store")
                .arg(&store)
                .args([
                    "--namespace",
                    "bench",
                    "--import",
                    "disk",
                    "--prefix",
                    "disk",
                ])
                .args(if checksum {
                    vec!["--checksum".to_owned(), format!("sha256:{sha}")]
                } else {
                    Vec::new()
                })
                .arg("--scratch")
                .arg(&scratch)
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
        let want_sha = if checksum { sha.as_str() } else { "" };
        ensure!(
            result["sourceSha256"] == want_sha,
            "ingest result: {result}"
        );
        if check {
            // what ingest published is what capture produces from the file
            let mut compared = 0;
            for c in result["contents"].as_array().into_iter().flatten() {
                let name = c["name"].as_str().unwrap_or_default();
                let n = c["partitionNumber"].as_u64().unwrap_or(0);
                let ours = store.join("bench").join(name).join("stream");
                let theirs = cap.join(format!("p{n}.stream"));
                if !same_file(&ours, &theirs)? {
                    bail!("{} differs from {}", ours.display(), theirs.display());
                }
                compared += 1;
            }
            ensure!(compared > 0, "ingest result names no content: {result}");
        }
        fresh_dir(&store)?;
        fresh_dir(&scratch)?;
        let at = |p: &str| phases.iter().find(|(q, _)| q == p).map(|(_, t)| *t);
        let (c, p) = (at("Capturing").unwrap_or(t), at("Publishing").unwrap_or(t));
        Ok((t, [c, p - c, t - p], internal))
    };
    let curl = || -> anyhow::Result<f64> {
        timed(|| {
            run(Command::new("curl")
                .args(["-sf", "-o", "/dev/null"])
                .arg(&url))
        })
    };
    // diagnostic, not in the ratio: what spooling the source to a local
    // file costs (curl into a file, then sync)
    let spool = || -> anyhow::Result<f64> {
        fresh_dir(&scratch)?;
        let t = timed(|| {
            run(Command::new("curl")
                .args(["-sf", "-o"])
                .arg(scratch.join("spool.raw"))
                .arg(&url))?;
            sync()
        })?;
        fresh_dir(&scratch)?;
        Ok(t)
    };
    let capture = || -> anyhow::Result<f64> {
        fresh_dir(&cap)?;
        sync()?;
        timed(|| {
            run(Command::new(&agent)
                .arg("capture")
                .arg(&local)
                .arg("--out")
                .arg(&cap)
                .stderr(Stdio::null()))?;
            sync()
        })
    };

    // warm-up: the source into the page cache, both binaries loaded; the
    // contents compared once
    eprintln!("warm-up and check (ingest output == capture output)...");
    curl()?;
    capture()?;
    ingest(true, false)?;
    ingest(true, true)?;

    let (mut ours, mut t_curl, mut t_cap) = (Vec::new(), Vec::new(), Vec::new());
    let mut ours_ck = Vec::new();
    let (mut ph_fetch, mut ph_cap, mut ph_pub, mut t_spool) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut internals: Vec<Internal> = Vec::new();
    for r in 0..runs {
        let mut ours_run = || -> anyhow::Result<()> {
            let (t, [f, c, p], i) = ingest(false, false)?;
            ours.push(t);
            ph_fetch.push(f);
            ph_cap.push(c);
            ph_pub.push(p);
            internals.push(i);
            Ok(())
        };
        if r % 2 == 0 {
            ours_run()?;
            ours_ck.push(ingest(false, true)?.0);
            t_curl.push(curl()?);
            t_cap.push(capture()?);
        } else {
            t_curl.push(curl()?);
            t_cap.push(capture()?);
            ours_ck.push(ingest(false, true)?.0);
            ours_run()?;
        }
        t_spool.push(spool()?);
        eprintln!(
            "run {r}: ingest {:.2}s (first bytes {:.2}s, download+capture {:.2}s, publish {:.2}s), with --checksum {:.2}s | curl {:.2}s + capture {:.2}s = {:.2}s | diagnostic: curl to a file + sync {:.2}s",
            ours[r],
            ph_fetch[r],
            ph_cap[r],
            ph_pub[r],
            ours_ck[r],
            t_curl[r],
            t_cap[r],
            t_curl[r] + t_cap[r],
            t_spool[r]
        );
        let i = &internals[r];
        eprintln!(
            "run {r}: inside ingest: body read at {:.2}s, capture returned at {:.2}s; spool memory peak {} MiB, spilled {} MiB",
            i.download,
            i.capture,
            i.mem_peak >> 20,
            i.spilled >> 20
        );
    }
    drop(nginx);
    let reference: Vec<f64> = t_curl.iter().zip(&t_cap).map(|(a, b)| a + b).collect();
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
    let _ = std::fs::remove_file(&local);
    for d in [&store, &scratch, &cap] {
        let _ = std::fs::remove_dir_all(d);
    }
    if !keep {
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(())
}
