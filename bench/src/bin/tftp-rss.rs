//! bootd TFTP memory figure (docs/bootd.md, "TFTP"): N concurrent TFTP
//! transfers (default 20) of an S MiB file (default 100) from the real `bootd`
//! process on loopback, each with blksize 1468 and windowsize W (default 64,
//! the largest bootd grants: the largest buffer a transfer holds); verifies
//! every result's size and SHA-256 and prints bootd's peak RSS (VmHWM, read
//! after the transfers) against the 64 MiB goal (docs/benchmarks.md), and the
//! throughput. Writes target/bench/tftp-rss.json.
//!
//! Build bootd first, then run:
//! `cargo build --release -p anneal-bootd --bin bootd &&
//!  cargo run --release -p anneal-bench --bin tftp-rss [-- --parallel 20 --size-mib 100 --window 64 --bootd PATH]`
//! (`--bootd` defaults to the `bootd` next to this program).

use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anneal_bench::{ChildGroup, load_average, option_or, write_json};
use anyhow::{Context as _, bail};
use sha2::{Digest as _, Sha256};

const MIB: u64 = 1024 * 1024;
/// The goal for bootd's RSS under this load (docs/benchmarks.md).
const GOAL_MIB: f64 = 64.0;
const BLKSIZE: usize = 1468;

/// Starts bootd serving `file` as TFTP file `f` on 127.0.0.1:`port` (HTTP
/// on port 0, DHCP on an ephemeral port, PXE off); waits for its
/// "bootd serving" line.
fn start_bootd(
    bootd: &Path,
    dir: &Path,
    file: &Path,
    port: u16,
) -> anyhow::Result<(ChildGroup, std::path::PathBuf)> {
    let cfg = dir.join("bootd.yaml");
    let log = dir.join("bootd.log");
    std::fs::write(
        &cfg,
        format!(
            "subnet: bench/tftp\nserverIP: 127.0.0.1\ncidr: 127.0.0.0/8\n\
             dhcp: {{mode: proxy, leaseTime: 10m}}\n\
             api: {{url: \"https://127.0.0.1:8443\", caSha256: \"ab12\"}}\n\
             files: {{f: {f}}}\nmachines: []\n",
            f = file.display()
        ),
    )?;
    let mut cmd = Command::new(bootd);
    cmd.arg("--config")
        .arg(&cfg)
        .args(["--listen-ip", "127.0.0.1", "--http-port", "0"])
        .args(["--dhcp-port", "0", "--pxe-port", "0"])
        .args(["--tftp-port", &port.to_string()])
        // a transfer's deadline well above what 20 of them take here
        .args(["--tftp-deadline-secs", "600"])
        .args(["--tftp-per-source", "64"])
        .env("RUST_LOG", "warn,anneal_bootd=info")
        .stdin(Stdio::null());
    let child = ChildGroup::spawn_logged("bootd", &mut cmd, &log)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("bootd serving")
    {
        if Instant::now() > deadline {
            bail!(
                "bootd did not print \"bootd serving\" within 30 s; its log: {}",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((child, log))
}

fn rrq(opts: &[(&str, String)]) -> Vec<u8> {
    let mut p = vec![0, 1];
    for s in ["f", "octet"]
        .into_iter()
        .chain(opts.iter().flat_map(|(k, v)| [*k, v.as_str()]))
    {
        p.extend_from_slice(s.as_bytes());
        p.push(0);
    }
    p
}

fn ack(n: u16) -> [u8; 4] {
    let a = n.to_be_bytes();
    [0, 4, a[0], a[1]]
}

/// One windowed RRQ/ACK transfer of `f`: its size and SHA-256 (hex).
fn fetch(server: SocketAddr, window: u16) -> anyhow::Result<(u64, String)> {
    let c = UdpSocket::bind("127.0.0.1:0")?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    let req = rrq(&[
        ("blksize", BLKSIZE.to_string()),
        ("windowsize", window.to_string()),
    ]);
    c.send_to(&req, server)?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 2048];
    let (mut next, mut size, mut in_window) = (1u64, 0u64, 0u16);
    loop {
        let (n, from) = c.recv_from(&mut buf).context("waiting for the server")?;
        let p = &buf[..n];
        if n < 4 {
            bail!("short packet {p:?}");
        }
        match u16::from_be_bytes([p[0], p[1]]) {
            6 => {
                c.send_to(&ack(0), from)?;
            }
            3 => {
                let block = u16::from_be_bytes([p[2], p[3]]);
                if block != next as u16 {
                    // out of order (RFC 7440): ACK what we have
                    c.send_to(&ack((next - 1) as u16), from)?;
                    in_window = 0;
                    continue;
                }
                hash.update(&p[4..]);
                size += (n - 4) as u64;
                next += 1;
                in_window += 1;
                let last = n - 4 < BLKSIZE;
                if last || in_window == window {
                    c.send_to(&ack(block), from)?;
                    in_window = 0;
                }
                if last {
                    return Ok((size, hex(&hash.finalize())));
                }
            }
            5 => bail!(
                "server error {}: {}",
                u16::from_be_bytes([p[2], p[3]]),
                String::from_utf8_lossy(&p[4..n.saturating_sub(1)])
            ),
            op => bail!("unexpected opcode {op}"),
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn main() -> anyhow::Result<()> {
    if anneal_bench::flag("--help") {
        println!(
            "tftp-rss [--parallel N (20)] [--size-mib S (100)] [--window W (64)] [--bootd PATH]\n\
             N concurrent TFTP transfers of an S MiB file from the bootd process; prints its \
             peak RSS against {GOAL_MIB} MiB; writes target/bench/tftp-rss.json"
        );
        return Ok(());
    }
    let parallel: usize = option_or("--parallel", 20)?;
    let size_mib: u64 = option_or("--size-mib", 100)?;
    let window: u16 = option_or("--window", 64)?;
    let bootd = anneal_bench::sibling_bin("bootd", "--bootd", "anneal-bootd")?;
    let dir = tempfile::Builder::new().prefix("tftp-rss-").tempdir()?;
    let file = dir.path().join("big.img");
    let want_len = size_mib * MIB;
    let want_sha = {
        let content = anneal_bench::noise(41, usize::try_from(want_len)?);
        std::fs::write(&file, &content)?;
        hex(&Sha256::digest(&content))
    };
    let port = UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port();
    let (child, log) = start_bootd(&bootd, dir.path(), &file, port)?;
    let server = SocketAddr::from(([127, 0, 0, 1], port));
    let idle_mib = anneal_bench::peak_rss_mib(child.pid())?;
    let start = Instant::now();
    let threads: Vec<_> = (0..parallel)
        .map(|_| std::thread::spawn(move || fetch(server, window)))
        .collect();
    let mut failed = Vec::new();
    for t in threads {
        match t.join() {
            Ok(Ok((len, sha))) if len == want_len && sha == want_sha => {}
            Ok(Ok((len, sha))) => failed.push(format!("{len} bytes, sha256 {sha}")),
            Ok(Err(e)) => failed.push(format!("{e:#}")),
            Err(_) => failed.push("transfer thread panicked".into()),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let rss_mib = anneal_bench::peak_rss_mib(child.pid())?;
    drop(child);
    let total_mib = (parallel as u64 * size_mib) as f64;
    println!(
        "bootd TFTP: {parallel} concurrent transfers of {size_mib} MiB (blksize {BLKSIZE}, \
         windowsize {window}) in {secs:.2} s ({:.0} MiB/s), {} of {parallel} with the file's \
         size and sha256",
        total_mib / secs,
        parallel - failed.len()
    );
    let met = rss_mib < GOAL_MIB;
    println!(
        "bootd peak RSS (VmHWM): {rss_mib:.1} MiB (idle {idle_mib:.1} MiB) / goal {GOAL_MIB} MiB = {:.2} ({})",
        rss_mib / GOAL_MIB,
        if met { "met" } else { "NOT met" }
    );
    for f in failed.iter().take(5) {
        println!("  failed: {f}");
    }
    write_json(
        "tftp-rss",
        &serde_json::json!({
            "parallel": parallel,
            "size_mib": size_mib,
            "blksize": BLKSIZE,
            "windowsize": window,
            "seconds": secs,
            "mib_per_s": total_mib / secs,
            "identical": parallel - failed.len(),
            "failed": failed,
            "peak_rss_mib": rss_mib,
            "idle_rss_mib": idle_mib,
            "goal_mib": GOAL_MIB,
            "goal_met": met,
            "load_average": load_average(),
        }),
    )?;
    if !failed.is_empty() {
        bail!(
            "{} of {parallel} transfers failed (bootd's log: {})",
            failed.len(),
            log.display()
        );
    }
    Ok(())
}
