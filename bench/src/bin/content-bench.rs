//! Content server benchmark (docs/benchmarks.md; docs/images.md, "The
//! content store").
//!
//! A content of ~256 MiB (a GPT disk whose ext4 holds `--data-mib` of
//! pseudo-random files plus the filesystem's metadata and journal, ingested from `staged://` and verified with
//! `anneal-agent store verify`) is served by `anneal-agent serve` and by our
//! own nginx (sendfile on, `location /content/` aliased to the store
//! directory, so both serve the same file under the same path).
//!
//! 1. Range throughput: the same client for both servers, `--workers` (4)
//!    threads, each on one keep-alive connection, fetching `--range-mib` (4)
//!    MiB ranges (`Range: bytes=a-b`) that together cover the stream,
//!    `--passes` (8) times per measurement (one pass takes ~0.1 s here).
//!    MiB/s for each, ratio ours / nginx (goal >= 0.9), median of
//!    `--rounds` (3) per-round ratios; the order alternates each round.
//! 2. Memory: `--readers` (50) concurrent readers against `anneal-agent
//!    serve`, each reading the whole stream in ranges; the server's VmRSS is
//!    sampled every 10 ms during the run and VmHWM read after it (goal < 64
//!    MiB).
//!
//! Writes target/bench/content.json. Run after bench/setup.sh:
//! `target/release/content-bench` (options: `--rounds N`, `--workers N`,
//! `--range-mib N`, `--passes N`, `--readers N`, `--data-mib N` (224: a
//! ~256 MiB stream), `--nginx-workers N`
//! (2), `--dir DIR` (/var/tmp/anneal-bench-content), `--keep`, `--agent PATH`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anneal_bench::{ChildGroup, Nginx, agent_bin, median};
use anyhow::{Context as _, bail, ensure};
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::TcpStream;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const NS: &str = "bench";

/// One keep-alive HTTP/1.1 connection of the client.
struct Conn {
    port: u16,
    reader: Option<BufReader<TcpStream>>,
}

impl Conn {
    fn new(port: u16) -> Self {
        Self { port, reader: None }
    }

    /// GET `path` bytes `a..=b`; the body goes to `sink` (or is only
    /// counted when `sink` is None). Returns the body length. A reused
    /// connection the server closed meanwhile is reopened once.
    fn range(
        &mut self,
        path: &str,
        a: u64,
        b: u64,
        sink: Option<&mut Vec<u8>>,
    ) -> anyhow::Result<u64> {
        let reused = self.reader.is_some();
        let keep = sink.is_some();
        let (n, body) = match self.try_range(path, a, b, keep) {
            Err(_) if reused => {
                self.reader = None;
                self.try_range(path, a, b, keep)?
            }
            r => r?,
        };
        if let (Some(s), Some(body)) = (sink, body) {
            *s = body;
        }
        Ok(n)
    }

    fn try_range(
        &mut self,
        path: &str,
        a: u64,
        b: u64,
        keep: bool,
    ) -> anyhow::Result<(u64, Option<Vec<u8>>)> {
        if self.reader.is_none() {
            let s = TcpStream::connect(("127.0.0.1", self.port))?;
            s.set_nodelay(true)?;
            self.reader = Some(BufReader::with_capacity(256 << 10, s));
        }
        let r = self.reader.as_mut().context("no connection")?;
        write!(
            r.get_mut(),
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nRange: bytes={a}-{b}\r\n\r\n"
        )?;
        let mut line = String::new();
        r.read_line(&mut line)?;
        ensure!(!line.is_empty(), "connection closed");
        let status = line.split_whitespace().nth(1).unwrap_or("").to_owned();
        let (mut len, mut close) = (None, false);
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = Some(v.trim().parse::<u64>()?);
                } else if k.eq_ignore_ascii_case("connection")
                    && v.trim().eq_ignore_ascii_case("close")
                {
                    close = true;
                }
            }
        }
        if status != "206" {
            bail!("{path} bytes={a}-{b}: HTTP {status}");
        }
        let len = len.context("no Content-Length")?;
        ensure!(len == b - a + 1, "206 of {len} bytes for bytes={a}-{b}");
        let mut body = keep.then(|| Vec::with_capacity(len as usize));
        let mut left = len;
        while left > 0 {
            let buf = r.fill_buf()?;
            ensure!(!buf.is_empty(), "body cut short: {left} bytes missing");
            let n = buf.len().min(left as usize);
            if let Some(b) = body.as_mut() {
                b.extend_from_slice(&buf[..n]);
            }
            r.consume(n);
            left -= n as u64;
        }
        if close {
            self.reader = None;
        }
        Ok((len, body))
    }
}

/// `workers` threads fetch the ranges of `range` bytes covering `size`
/// bytes (worker w takes ranges w, w + workers, ...), each `passes` times.
/// Returns (bytes, seconds).
fn fetch(
    port: u16,
    path: &str,
    size: u64,
    workers: usize,
    range: u64,
    passes: u32,
) -> anyhow::Result<(u64, f64)> {
    let n_ranges = size.div_ceil(range);
    let t = Instant::now();
    let total = std::thread::scope(|s| -> anyhow::Result<u64> {
        let handles: Vec<_> = (0..workers as u64)
            .map(|w| {
                s.spawn(move || -> anyhow::Result<u64> {
                    let mut c = Conn::new(port);
                    let mut got = 0;
                    for _ in 0..passes {
                        let mut i = w;
                        while i < n_ranges {
                            let a = i * range;
                            let b = (a + range).min(size) - 1;
                            got += c.range(path, a, b, None)?;
                            i += workers as u64;
                        }
                    }
                    Ok(got)
                })
            })
            .collect();
        let mut total = 0;
        for h in handles {
            total += h
                .join()
                .map_err(|_| anyhow::anyhow!("client thread panicked"))??;
        }
        Ok(total)
    })?;
    let secs = t.elapsed().as_secs_f64();
    ensure!(
        total == size * u64::from(passes),
        "fetched {total} bytes, expected {}",
        size * u64::from(passes)
    );
    Ok((total, secs))
}

/// A `/proc/PID/status` field in KiB.
fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find_map(|l| l.strip_prefix(field)).and_then(|v| {
        v.trim_start_matches(':')
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

/// The benchmark's content: the one kept in `store` (with `keep`), else a
/// GPT disk with `data_mib` MiB of ext4 files ingested from staged:// and
/// verified; its name and stream file.
fn prepare_content(
    dir: &Path,
    store: &Path,
    agent: &Path,
    data_mib: u64,
    keep: bool,
) -> anyhow::Result<(String, PathBuf)> {
    Ok(match find_content(store)? {
        Some(c) if keep => c,
        _ => {
            if store.exists() {
                std::fs::remove_dir_all(store)?;
            }
            let staged = store.join(NS).join(".staged");
            std::fs::create_dir_all(&staged)?;
            let size_mib = data_mib + data_mib / 4 + 64;
            eprintln!("building a {size_mib} MiB disk with {data_mib} MiB of ext4 files...");
            let build = dir.join("build");
            std::fs::create_dir_all(&build)?;
            let disk = anneal_bench::gpt_disk(&build, size_mib, data_mib)?;
            std::fs::rename(&disk, staged.join("disk.raw"))?;
            std::fs::remove_dir_all(&build)?;
            anneal_bench::run(
                Command::new(agent)
                    .arg("ingest")
                    .args(["--url", "staged://disk.raw", "--store"])
                    .arg(store)
                    .args(["--namespace", NS, "--import", "disk", "--prefix", "disk"])
                    .stderr(Stdio::null()),
            )?;
            std::fs::remove_dir_all(&staged)?;
            let (name, stream) = find_content(store)?.context("ingest published no content")?;
            anneal_bench::run(
                Command::new(agent)
                    .args(["store", "verify", "--store"])
                    .arg(store)
                    .args(["--namespace", NS, "--content", &name])
                    .stderr(Stdio::null()),
            )?;
            (name, stream)
        }
    })
}

/// Checks that the servers on `ports` serve `stream`'s bytes (a few ranges
/// of `path`).
fn same_ranges(ports: &[u16], path: &str, stream: &Path, size: u64) -> anyhow::Result<()> {
    let file = std::fs::File::open(stream)?;
    for &p in ports {
        let mut c = Conn::new(p);
        for a in [0, size / 3, size - (1 << 20)] {
            let b = (a + (1 << 20)).min(size) - 1;
            let mut body = Vec::new();
            c.range(path, a, b, Some(&mut body))?;
            let mut want = vec![0u8; body.len()];
            file.read_exact_at(&mut want, a)?;
            ensure!(body == want, "port {p}: bytes {a}-{b} differ from the file");
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let rounds: usize = anneal_bench::option_or("--rounds", 3)?;
    let workers: usize = anneal_bench::option_or("--workers", 4)?;
    let range_mib: u64 = anneal_bench::option_or("--range-mib", 4)?;
    let readers: usize = anneal_bench::option_or("--readers", 50)?;
    let data_mib: u64 = anneal_bench::option_or("--data-mib", 224)?;
    let passes: u32 = anneal_bench::option_or("--passes", 8)?;
    let nginx_workers: u32 = anneal_bench::option_or("--nginx-workers", 2)?;
    let keep = anneal_bench::flag("--keep");
    let dir = PathBuf::from(
        anneal_bench::option("--dir").unwrap_or_else(|| "/var/tmp/anneal-bench-content".into()),
    );
    let agent = agent_bin()?;
    let load_before = anneal_bench::load_average();
    let range = range_mib << 20;

    // the content: ingest a disk from staged://, verify the biggest content
    let store = dir.join("store");
    let (name, stream) = prepare_content(&dir, &store, &agent, data_mib, keep)?;
    let size = std::fs::metadata(&stream)?.len();
    let path = format!("/content/{NS}/{name}/stream");
    eprintln!("content {name}: stream of {:.1} MiB", mib(size));

    // the servers
    let port = anneal_bench::free_port()?;
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    let serve = ChildGroup::spawn_logged(
        "anneal-agent serve",
        Command::new(&agent)
            .arg("serve")
            .arg("--content-dir")
            .arg(&store)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .args(["--max-connections", &(readers + 16).to_string()]),
        &logs.join("serve.log"),
    )?;
    anneal_bench::wait_listening(port, 10)?;
    let nginx = Nginx::start(&dir.join("nginx"), &store, nginx_workers, Some("content"))?;

    // both serve the file's bytes (a few ranges compared)
    same_ranges(&[port, nginx.port], &path, &stream, size)?;
    // warm-up: the stream into the page cache, connections paths exercised
    fetch(port, &path, size, workers, range, 1)?;
    fetch(nginx.port, &path, size, workers, range, 1)?;

    // 1. throughput
    let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let go = |p: u16| -> anyhow::Result<f64> {
            let (bytes, secs) = fetch(p, &path, size, workers, range, passes)?;
            Ok(mib(bytes) / secs)
        };
        let (o, n) = if r % 2 == 0 {
            let o = go(port)?;
            (o, go(nginx.port)?)
        } else {
            let n = go(nginx.port)?;
            (go(port)?, n)
        };
        eprintln!(
            "round {r}: anneal-agent serve {o:.0} MiB/s, nginx {n:.0} MiB/s, ratio {:.2}",
            o / n
        );
        ours.push(o);
        theirs.push(n);
        ratios.push(o / n);
    }
    let ratio = median(&mut ratios.clone());
    let (mo, mn) = (median(&mut ours.clone()), median(&mut theirs.clone()));
    let tp_pass = ratio >= 0.9;

    // 2. memory under `readers` concurrent whole-stream readers
    let pid = serve.pid();
    let rss_before = status_kib(pid, "VmRSS").unwrap_or(0);
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let samples = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, peak, samples) = (stop.clone(), peak.clone(), samples.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if let Some(k) = status_kib(pid, "VmRSS") {
                    peak.fetch_max(k, Ordering::SeqCst);
                    samples.fetch_add(1, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let mem_run = fetch_readers(port, &path, size, readers, range);
    stop.store(true, Ordering::SeqCst);
    sampler
        .join()
        .map_err(|_| anyhow::anyhow!("sampler panicked"))?;
    let (mem_bytes, mem_secs) = mem_run?;
    let hwm = status_kib(pid, "VmHWM").context("no VmHWM for the server")?;
    let rss_peak = peak.load(Ordering::SeqCst);
    let mem_pass = hwm < 64 << 10;
    drop(nginx);
    drop(serve);

    let report = serde_json::json!({
        "benchmark": "content",
        "content": name,
        "streamBytes": size,
        "throughput": {
            "workers": workers,
            "rangeBytes": range,
            "rounds": rounds,
            "passesPerRound": passes,
            "mibPerSecond": { "anneal": mo, "nginx": mn },
            "nginxWorkerProcesses": nginx_workers,
            "ratio (median of per-round anneal / nginx)": ratio,
            "goal": ">= 0.9",
            "pass": tp_pass,
            "allRounds": { "anneal": ours, "nginx": theirs, "ratio": ratios },
        },
        "memory": {
            "readers": readers,
            "bytesServed": mem_bytes,
            "seconds": mem_secs,
            "mibPerSecond": mib(mem_bytes) / mem_secs,
            "vmRssKiBBefore": rss_before,
            "vmRssKiBPeakSampled": rss_peak,
            "rssSamples": samples.load(Ordering::SeqCst),
            "vmHwmKiBAfter": hwm,
            "goal": "VmHWM < 64 MiB",
            "pass": mem_pass,
        },
        "loadAverage": { "before": load_before, "after": anneal_bench::load_average() },
    });
    anneal_bench::write_json("content", &report)?;
    println!(
        "content range throughput ({workers} workers, {range_mib} MiB ranges, {:.0} MiB stream): anneal {mo:.0} MiB/s / nginx {mn:.0} MiB/s = {ratio:.2} (goal >= 0.9) {}",
        mib(size),
        if tp_pass { "PASS" } else { "FAIL" }
    );
    println!(
        "content server memory ({readers} concurrent whole-stream readers, {:.0} MiB/s): VmHWM {:.1} MiB, peak sampled VmRSS {:.1} MiB (goal < 64 MiB) {}",
        mib(mem_bytes) / mem_secs,
        hwm as f64 / 1024.0,
        rss_peak as f64 / 1024.0,
        if mem_pass { "PASS" } else { "FAIL" }
    );
    if !keep {
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(())
}

/// `readers` threads, each on its own connection reading the whole stream
/// in ranges, all at once. Returns (bytes, seconds).
fn fetch_readers(
    port: u16,
    path: &str,
    size: u64,
    readers: usize,
    range: u64,
) -> anyhow::Result<(u64, f64)> {
    let t = Instant::now();
    let total = std::thread::scope(|s| -> anyhow::Result<u64> {
        let handles: Vec<_> = (0..readers)
            .map(|_| {
                s.spawn(move || -> anyhow::Result<u64> {
                    let mut c = Conn::new(port);
                    let mut got = 0;
                    let mut a = 0;
                    while a < size {
                        let b = (a + range).min(size) - 1;
                        got += c.range(path, a, b, None)?;
                        a = b + 1;
                    }
                    Ok(got)
                })
            })
            .collect();
        let mut total = 0;
        for h in handles {
            total += h
                .join()
                .map_err(|_| anyhow::anyhow!("reader thread panicked"))??;
        }
        Ok(total)
    })?;
    ensure!(
        total == size * readers as u64,
        "readers fetched {total} bytes"
    );
    Ok((total, t.elapsed().as_secs_f64()))
}

/// The content with the biggest stream under `<store>/bench/`: (name, stream path).
fn find_content(store: &Path) -> anyhow::Result<Option<(String, PathBuf)>> {
    let ns = store.join(NS);
    if !ns.is_dir() {
        return Ok(None);
    }
    let mut best: Option<(u64, String, PathBuf)> = None;
    for e in std::fs::read_dir(&ns)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let stream = e.path().join("stream");
        if name.starts_with('.') || !stream.is_file() {
            continue;
        }
        let len = std::fs::metadata(&stream)?.len();
        if best.as_ref().is_none_or(|b| len > b.0) {
            best = Some((len, name, stream));
        }
    }
    Ok(best.map(|(_, n, s)| (n, s)))
}
