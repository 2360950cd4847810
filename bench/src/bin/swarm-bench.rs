//! Distribution benchmark (docs/distribution.md): one content to N hosts at
//! once over 100 Mbit/s links, the slowest host's time, for N = 1, 4, 8, 16,
//! in one run, by four methods side by side:
//!
//! - `anneal`: `anneal-agent swarm-fetch` (librqbit, rarest-first) from one
//!   `anneal-agent seed` and the `anneal-agent tracker`, each host writing
//!   the content onto a target file, verified piece by piece;
//! - `anneal-nostripe`: the same without seeder stripes
//!   (`--no-seeder-stripes`: the seeder is asked for any piece no leecher
//!   has, not only the asking leecher's stripe);
//! - `anneal-stock`: the same with librqbit's stock piece order
//!   (`--stock-order`), the order the vendored change replaces;
//! - `aria2c`: aria2c with the same tracker and the same seeder;
//! - `http`: HTTP unicast, curl from nginx on the seeder's host.
//!
//! Every host is a network namespace on one bridge; each host's veth is
//! shaped to `--rate` (default 100mbit) both ways with tbf. Prints one line
//! per (method, N), the table, the ratios (anneal at N against anneal at 1,
//! goal <= 1.3 at 16; anneal against aria2c at every N >= 4, goal < 1) and
//! the share of bytes the seeder sent (counted by the seeder itself, for
//! anneal and aria2c alike); writes target/bench/swarm-bench.json.
//!
//! Needs root (namespaces, tc), aria2c, nginx and curl (bench/setup.sh).
//! Options: `--mib N` (content size, default 256), `--hosts 1,4,8,16`,
//! `--methods anneal,anneal-nostripe,anneal-stock,aria2c,http`, `--rate 100mbit`,
//! `--piece-kib K` (default: the content format's, 1024),
//! `--piece-cache-mib M` (each anneal leecher's piece cache; default: the
//! agent's, sized from memory), `--max-connections N` (each anneal
//! leecher's peer connections; default: the agent's), `--request-window N`
//! (each anneal leecher's chunk requests outstanding per peer; default: the
//! agent's),
//! `--keep-work` (keep the work directory and every round's logs, and
//! print each anneal round second by second: bytes received and uploaded
//! by all hosts, pieces written),
//! `--agent PATH`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anneal_image::ContentIndex;
use anneal_image::capture::{Options, capture_region};
use anneal_image::torrent::Metainfo;
use anneal_testinfra::{ChildGroup, Netns};
use anyhow::{Context, Result, bail};

const NS: &str = "bench";
const NAME: &str = "disk";
const SEEDER_IP: &str = "10.77.0.2";
const PEER_PORT: u16 = 6881;
const TRACKER_PORT: u16 = 6969;
const HTTP_PORT: u16 = 8080;
/// A round that takes longer than this is reported as failed.
const ROUND_LIMIT: Duration = Duration::from_secs(1800);

fn host_ip(i: usize) -> String {
    format!("10.77.0.{}", 10 + i)
}

/// Shapes `dev` (egress) in `ns` to `rate` with tbf.
fn shape(ns: &Netns, dev: &str, rate: &str) -> Result<()> {
    anneal_testinfra::run(ns.exec("tc").args([
        "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency",
        "100ms",
    ]))
    .map(|_| ())
}

/// The namespaces; dropped after every process started in them (declared
/// before them in `main`), deleting every veth with them.
struct Lab {
    _hub: Netns,
    seeder_host: Netns,
    hosts: Vec<Netns>,
}

impl Lab {
    fn new(n: usize, rate: &str) -> Result<Self> {
        let hub = Netns::create("swb")?;
        let seeder_host = Netns::bare("sws")?;
        hub.add_veth_to_bridge(&seeder_host, "vs", "eth0", &format!("{SEEDER_IP}/24"))?;
        shape(&hub, "vs", rate)?;
        shape(&seeder_host, "eth0", rate)?;
        let mut hosts = Vec::new();
        for i in 0..n {
            let h = Netns::bare("swh")?;
            let v = format!("vh{i}");
            hub.add_veth_to_bridge(&h, &v, "eth0", &format!("{}/24", host_ip(i)))?;
            shape(&hub, &v, rate)?;
            shape(&h, "eth0", rate)?;
            hosts.push(h);
        }
        Ok(Self {
            _hub: hub,
            seeder_host,
            hosts,
        })
    }
}

/// Polls `done` until it reports a time for every host or the limit passes.
fn wait_all(
    n: usize,
    start: Instant,
    mut done: impl FnMut(usize) -> Result<bool>,
) -> Result<Vec<f64>> {
    let mut times = vec![None; n];
    while times.iter().any(Option::is_none) {
        if start.elapsed() > ROUND_LIMIT {
            bail!("not every host finished in {} s", ROUND_LIMIT.as_secs());
        }
        for (i, t) in times.iter_mut().enumerate() {
            if t.is_none() && done(i)? {
                *t = Some(start.elapsed().as_secs_f64());
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(times.into_iter().flatten().collect())
}

/// The slowest host's time; prints every host's (sorted) to stderr, to see
/// the spread.
fn slowest(times: &[f64]) -> f64 {
    let mut t = times.to_vec();
    t.sort_by(f64::total_cmp);
    let list: Vec<String> = t.iter().map(|x| format!("{x:.1}")).collect();
    eprintln!("  hosts done at (s): {}", list.join(" "));
    t.last().copied().unwrap_or(0.0)
}

/// The seeder's `uploaded` lines so far and the last one's byte count.
fn seeder_uploaded(work: &Path) -> (usize, u64) {
    let text = std::fs::read_to_string(work.join("seed.log")).unwrap_or_default();
    let mut lines = 0;
    let mut bytes = 0;
    for l in text.lines() {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(l)
            && v["event"] == "uploaded"
        {
            lines += 1;
            bytes = v["bytes"].as_u64().unwrap_or(0);
        }
    }
    (lines, bytes)
}

/// What the seeder sent during a round, as a share of what the `n` hosts
/// received (`n` copies of `size` bytes): the seeder's count before the
/// round (`before`) against its first report after every host finished
/// (the seeder prints one a second; nothing is asked of it once all have
/// the content).
fn seeder_share(work: &Path, before: (usize, u64), n: usize, size: u64) -> Result<f64> {
    let (seen, _) = seeder_uploaded(work);
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let (lines, bytes) = seeder_uploaded(work);
        if lines > seen {
            return Ok(bytes.saturating_sub(before.1) as f64 / (n as f64 * size as f64));
        }
        if Instant::now() > until {
            bail!("the seeder printed no upload count in 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Round {
    slowest: f64,
    seeder_share: Option<f64>,
}

fn round_agent(
    lab: &Lab,
    n: usize,
    agent: &Path,
    store: &Path,
    work: &Path,
    extra: &[&str],
    size: u64,
) -> Result<Round> {
    let index = store.join(NS).join(NAME).join("index");
    let mut procs = Vec::new();
    let mut logs = Vec::new();
    let before = seeder_uploaded(work);
    let start = Instant::now();
    for (i, h) in lab.hosts.iter().take(n).enumerate() {
        let target = work.join(format!("target{i}"));
        std::fs::File::create(&target)?.set_len(size)?;
        let log = work.join(format!("fetch{i}.log"));
        let mut cmd = h.exec(&agent.display().to_string());
        cmd.arg("swarm-fetch")
            .arg("--index")
            .arg(&index)
            .args(["--name", NAME, "--target"])
            .arg(&target)
            .args(["--listen", &format!("{}:{PEER_PORT}", host_ip(i))])
            .args(["--seeder", &format!("{SEEDER_IP}:{PEER_PORT}")])
            .args([
                "--tracker",
                &format!("http://{SEEDER_IP}:{TRACKER_PORT}/announce"),
            ])
            .args(["--stall-timeout", "120", "--seed-after", "3600"]);
        cmd.args(extra);
        if let Some(m) = anneal_bench::option("--piece-cache-mib") {
            cmd.args(["--piece-cache-mib", &m]);
        }
        if let Some(m) = anneal_bench::option("--max-connections") {
            cmd.args(["--max-connections", &m]);
        }
        if let Some(m) = anneal_bench::option("--request-window") {
            cmd.args(["--request-window", &m]);
        }
        if anneal_bench::flag("--keep-work") {
            // The kept logs tell how each host's fetch went, second by second.
            cmd.args(["--report-ms", "500"]);
        }
        procs.push(ChildGroup::spawn_logged("swarm-fetch", &mut cmd, &log)?);
        logs.push(log);
    }
    let times = wait_all(n, start, |i| {
        let text = std::fs::read_to_string(&logs[i]).unwrap_or_default();
        for line in text.lines() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(line)
                && v["event"] == "written"
            {
                return Ok(true);
            }
        }
        if procs[i].try_exit().is_some() {
            bail!(
                "swarm-fetch on host {i} exited before writing: {}",
                text.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
            );
        }
        Ok(false)
    })?;
    let share = seeder_share(work, before, n, size)?;
    if anneal_bench::flag("--keep-work") {
        print_timeline(&logs);
    }
    drop(procs);
    for i in 0..n {
        let _ = std::fs::remove_file(work.join(format!("target{i}")));
    }
    Ok(Round {
        slowest: slowest(&times),
        seeder_share: Some(share),
    })
}

/// One host's figures at a moment of its fetch (`--report-ms`).
#[derive(Clone, Copy, Default)]
struct Sample {
    ms: u64,
    received: u64,
    uploaded: u64,
    pieces: u64,
}

/// The `progress` and `written` lines of a swarm-fetch log.
fn samples(log: &Path) -> Vec<Sample> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut out: Vec<Sample> = Vec::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let s = &v["stats"];
        let n = |k: &str| s[k].as_u64().unwrap_or(0);
        let ms = match v["event"].as_str() {
            Some("progress") => v["ms"].as_u64().unwrap_or(0),
            Some("written") => (s["seconds"].as_f64().unwrap_or(0.0) * 1000.0) as u64,
            _ => continue,
        };
        out.push(Sample {
            ms,
            received: n("bytesFromSeeders") + n("bytesFromPeers") + n("bytesOverHttp"),
            uploaded: n("bytesUploaded"),
            pieces: n("pieces"),
        });
    }
    out
}

/// With `--keep-work`: the round second by second, all hosts together
/// (bytes received and uploaded, pieces written), from each host's
/// `--report-ms` lines. Where the swarm waits shows here.
fn print_timeline(logs: &[std::path::PathBuf]) {
    let hosts: Vec<Vec<Sample>> = logs.iter().map(|l| samples(l)).collect();
    let end = hosts
        .iter()
        .filter_map(|h| h.last().map(|s| s.ms))
        .max()
        .unwrap_or(0);
    let at = |h: &[Sample], ms: u64| -> Sample {
        h.iter()
            .take_while(|s| s.ms <= ms)
            .last()
            .copied()
            .unwrap_or_default()
    };
    println!("      second  received MB/s  uploaded MB/s  pieces written (all hosts)");
    let mut prev = (0u64, 0u64);
    for sec in 1..=end.div_ceil(1000) {
        let now = hosts.iter().fold((0, 0, 0), |(r, u, p), h| {
            let s = at(h, sec * 1000);
            (r + s.received, u + s.uploaded, p + s.pieces)
        });
        println!(
            "      {sec:>6}  {:>13.1}  {:>13.1}  {:>5}",
            now.0.saturating_sub(prev.0) as f64 / 1e6,
            now.1.saturating_sub(prev.1) as f64 / 1e6,
            now.2
        );
        prev = (now.0, now.1);
    }
}

fn round_aria2c(lab: &Lab, n: usize, torrent: &Path, work: &Path, size: u64) -> Result<Round> {
    let mut procs = Vec::new();
    let before = seeder_uploaded(work);
    let hook = work.join("aria2-done.sh");
    std::fs::write(&hook, "#!/bin/sh\ntouch \"$ARIA_DONE\"\n")?;
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let start = Instant::now();
    let mut marks = Vec::new();
    for (i, h) in lab.hosts.iter().take(n).enumerate() {
        let dir = work.join(format!("aria{i}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let mark = work.join(format!("aria{i}.done"));
        let _ = std::fs::remove_file(&mark);
        let mut cmd = h.exec("aria2c");
        cmd.env("ARIA_DONE", &mark)
            .arg(format!("--dir={}", dir.display()))
            .args([
                "--enable-dht=false",
                "--enable-dht6=false",
                "--bt-enable-lpd=false",
                "--enable-peer-exchange=true",
                "--seed-time=60",
                "--file-allocation=none",
                "--summary-interval=0",
                "--console-log-level=warn",
                &format!("--listen-port={PEER_PORT}"),
                &format!("--bt-tracker=http://{SEEDER_IP}:{TRACKER_PORT}/announce"),
                &format!("--on-bt-download-complete={}", hook.display()),
            ])
            .arg(torrent);
        procs.push(ChildGroup::spawn_logged(
            "aria2c",
            &mut cmd,
            &work.join(format!("aria{i}.log")),
        )?);
        marks.push(mark);
    }
    let times = wait_all(n, start, |i| Ok(marks[i].exists()))?;
    let share = seeder_share(work, before, n, size)?;
    drop(procs);
    for i in 0..n {
        let _ = std::fs::remove_dir_all(work.join(format!("aria{i}")));
    }
    Ok(Round {
        slowest: slowest(&times),
        seeder_share: Some(share),
    })
}

fn round_http(lab: &Lab, n: usize, work: &Path) -> Result<Round> {
    let url = format!("http://{SEEDER_IP}:{HTTP_PORT}/{NS}/{NAME}/stream");
    let mut procs = Vec::new();
    let start = Instant::now();
    for (i, h) in lab.hosts.iter().take(n).enumerate() {
        let out = work.join(format!("http{i}"));
        let mut cmd = h.exec("curl");
        cmd.args(["-sSf", "-o"]).arg(&out).arg(&url);
        procs.push(ChildGroup::spawn_logged(
            "curl",
            &mut cmd,
            &work.join(format!("curl{i}.log")),
        )?);
    }
    let times = wait_all(n, start, |i| match procs[i].try_exit() {
        Some(s) if s.success() => Ok(true),
        Some(s) => bail!("curl on host {i}: {s}"),
        None => Ok(false),
    })?;
    for i in 0..n {
        let _ = std::fs::remove_file(work.join(format!("http{i}")));
    }
    Ok(Round {
        slowest: slowest(&times),
        seeder_share: Some(1.0),
    })
}

fn nginx(ns: &Netns, store: &Path, dir: &Path) -> Result<ChildGroup> {
    let bin = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .context("nginx not installed: run bench/setup.sh")?;
    std::fs::create_dir_all(dir.join("logs"))?;
    let d = dir.display();
    let conf = format!(
        "worker_processes 2;\npid {d}/nginx.pid;\nerror_log {d}/logs/error.log warn;\n\
         events {{ worker_connections 1024; }}\n\
         http {{ access_log off; sendfile on; tcp_nopush on; default_type application/octet-stream;\n\
         client_body_temp_path {d}/tb; proxy_temp_path {d}/tp; fastcgi_temp_path {d}/tf;\n\
         uwsgi_temp_path {d}/tu; scgi_temp_path {d}/ts;\n\
         server {{ listen {SEEDER_IP}:{HTTP_PORT}; root {}; }} }}\n",
        store.display()
    );
    std::fs::write(dir.join("nginx.conf"), conf)?;
    ChildGroup::spawn_logged(
        "nginx",
        ns.exec(bin)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .arg("-p")
            .arg(dir)
            .args(["-g", "daemon off;"]),
        &dir.join("logs/stdout.log"),
    )
}

/// Waits for a line of `log` containing `needle`.
fn wait_log(log: &Path, needle: &str, secs: u64) -> Result<String> {
    let until = Instant::now() + Duration::from_secs(secs);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(l) = text.lines().find(|l| l.contains(needle)) {
            return Ok(l.to_string());
        }
        if Instant::now() > until {
            bail!("no {needle:?} in {} after {secs} s: {text}", log.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A content of `mib` MiB of noise captured as a raw partition (every
/// byte used) into `<work>/store`: its index and the store.
fn noise_content(work: &Path, mib: u64, piece_kib: u32) -> Result<(ContentIndex, PathBuf)> {
    let raw = work.join("part.raw");
    let size = mib << 20;
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&raw)?;
        for i in 0..mib {
            f.write_all(&anneal_bench::noise(i, 1 << 20))?;
        }
    }
    let store = work.join("store");
    let cdir = store.join(NS).join(NAME);
    std::fs::create_dir_all(&cdir)?;
    let (index, _) = capture_region(
        &std::fs::File::open(&raw)?,
        0,
        size,
        &cdir.join("index"),
        &cdir.join("stream"),
        Options {
            piece_length: piece_kib << 10,
        },
    )?;
    std::fs::remove_file(&raw)?;
    Ok((index, store))
}

/// Prints the slowest host's time per method and host count as a Markdown
/// table.
fn print_table(
    hosts: &[usize],
    methods: &[String],
    table: &BTreeMap<(String, usize), (f64, Option<f64>)>,
) {
    println!(
        "\n| method | {} |",
        hosts
            .iter()
            .map(|n| format!("N={n}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|{}", "---|".repeat(hosts.len()));
    for m in methods {
        let cells: Vec<String> = hosts
            .iter()
            .map(|n| {
                table
                    .get(&(m.clone(), *n))
                    .map(|(t, _)| format!("{t:.1} s"))
                    .unwrap_or_default()
            })
            .collect();
        println!("| {m} | {} |", cells.join(" | "));
    }
}

fn main() -> Result<()> {
    let mib: u64 = anneal_bench::option_or("--mib", 256)?;
    let piece_kib: u32 = anneal_bench::option_or(
        "--piece-kib",
        anneal_image::format::DEFAULT_PIECE_LENGTH >> 10,
    )?;
    let rate = anneal_bench::option("--rate").unwrap_or_else(|| "100mbit".into());
    let hosts: Vec<usize> = anneal_bench::option("--hosts")
        .unwrap_or_else(|| "1,4,8,16".into())
        .split(',')
        .map(|s| s.trim().parse().context("--hosts: numbers"))
        .collect::<Result<_>>()?;
    let methods: Vec<String> = anneal_bench::option("--methods")
        .unwrap_or_else(|| "anneal,anneal-nostripe,anneal-stock,aria2c,http".into())
        .split(',')
        .map(str::to_string)
        .collect();
    let agent = anneal_bench::agent_bin()?;
    let max_n = hosts.iter().copied().max().unwrap_or(1);

    let mut work = tempfile::Builder::new()
        .prefix("swarm-bench-")
        .tempdir_in("/var/tmp")?;
    if anneal_bench::flag("--keep-work") {
        // Every round's logs stay for a look afterwards.
        work.disable_cleanup(true);
        eprintln!("work directory kept: {}", work.path().display());
    }
    // The content: noise captured as a raw partition (every byte used).
    let size = mib << 20;
    let (index, store) = noise_content(work.path(), mib, piece_kib)?;
    let tracker_url = format!("http://{SEEDER_IP}:{TRACKER_PORT}/announce");
    let torrent = work.path().join("content.torrent");
    std::fs::write(
        &torrent,
        Metainfo::from_index(&index, NAME, Some(&tracker_url)).to_bytes(),
    )?;
    // The lab's namespaces inherit this host's TCP congestion control, and
    // the swarm's times depend on it (docs/bench/distribution.md).
    let congestion = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    println!(
        "content: {} MiB stream, {} pieces of {} KiB; links {rate}; TCP congestion control {congestion}; hosts {hosts:?}",
        index.header.used_bytes >> 20,
        index.piece_count(),
        piece_kib
    );

    let lab = Lab::new(max_n, &rate)?;
    let a = agent.display().to_string();
    let _tracker = ChildGroup::spawn_logged(
        "tracker",
        lab.seeder_host.exec(&a).args([
            "tracker",
            "--listen",
            &format!("{SEEDER_IP}:{TRACKER_PORT}"),
            "--interval",
            "5",
        ]),
        &work.path().join("tracker.log"),
    )?;
    let seed_log = work.path().join("seed.log");
    let _seeder = ChildGroup::spawn_logged(
        "seed",
        lab.seeder_host
            .exec(&a)
            .args(["seed", "--content-dir"])
            .arg(&store)
            .args(["--content", &format!("{NS}/{NAME}")])
            .args(["--listen", &format!("{SEEDER_IP}:{PEER_PORT}")])
            .args(["--tracker", &tracker_url])
            .args(["--report-uploads-secs", "1"])
            .stdin(Stdio::null()),
        &seed_log,
    )?;
    wait_log(&seed_log, "\"seeding\"", 600)?;
    let _nginx = nginx(&lab.seeder_host, &store, &work.path().join("nginx"))?;

    let mut table: BTreeMap<(String, usize), (f64, Option<f64>)> = BTreeMap::new();
    for &n in &hosts {
        for m in &methods {
            let r = match m.as_str() {
                "anneal" => round_agent(&lab, n, &agent, &store, work.path(), &[], size),
                "anneal-nostripe" => round_agent(
                    &lab,
                    n,
                    &agent,
                    &store,
                    work.path(),
                    &["--no-seeder-stripes"],
                    size,
                ),
                "anneal-stock" => round_agent(
                    &lab,
                    n,
                    &agent,
                    &store,
                    work.path(),
                    &["--stock-order"],
                    size,
                ),
                "aria2c" => round_aria2c(&lab, n, &torrent, work.path(), size),
                "http" => round_http(&lab, n, work.path()),
                other => bail!("unknown method {other}"),
            }
            .with_context(|| format!("{m} with {n} hosts"))?;
            println!(
                "{m:>12} N={n:<2} slowest {:7.1} s{}",
                r.slowest,
                r.seeder_share
                    .map(|s| format!(
                        ", seeder sent {:.0} % ({:.2} copies)",
                        s * 100.0,
                        s * n as f64
                    ))
                    .unwrap_or_default()
            );
            table.insert((m.clone(), n), (r.slowest, r.seeder_share));
            // Let the tracker forget this round's peers (2 intervals).
            std::thread::sleep(Duration::from_secs(11));
        }
    }

    print_table(&hosts, &methods, &table);
    let get = |m: &str, n: usize| table.get(&(m.to_string(), n)).map(|(t, _)| *t);
    let mut json = serde_json::json!({
        "mib": mib, "pieceKiB": piece_kib, "rate": rate, "hosts": hosts,
        "load": anneal_bench::load_average(), "tcpCongestionControl": congestion,
        "results": table.iter().map(|((m, n), (t, s))| serde_json::json!({"method": m, "hosts": n, "slowestSeconds": t, "seederShare": s})).collect::<Vec<_>>(),
    });
    if let (Some(one), Some(big)) = (get("anneal", 1), get("anneal", max_n)) {
        let r = big / one;
        println!("\nanneal N={max_n} / anneal N=1: {r:.2} (goal <= 1.3)");
        json["scaling"] = serde_json::json!(r);
    }
    for &n in hosts.iter().filter(|n| **n >= 4) {
        if let (Some(a), Some(b)) = (get("anneal", n), get("aria2c", n)) {
            println!("anneal / aria2c at N={n}: {:.2} (goal < 1)", a / b);
        }
    }
    let path = anneal_bench::write_json("swarm-bench", &json)?;
    println!("wrote {}", path.display());
    Ok(())
}
