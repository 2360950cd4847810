//! bootd HTTP load figure: N parallel downloads (default 50) of an initrd of S
//! MiB (default 64) from the real `bootd` process on loopback; prints its peak
//! RSS (VmHWM, read after the downloads) against the 128 MiB budget
//! (docs/bootd.md, "HTTP"), the throughput, and whether every body was
//! byte-identical. Writes target/bench/bootd-http.json.
//!
//! Build bootd first, then run:
//! `cargo build --release -p anneal-bootd --bin bootd &&
//!  cargo run --release -p anneal-bench --bin bootd-http-load [-- --parallel 50 --size-mib 64 --bootd PATH]`
//! (`--bootd` defaults to the `bootd` next to this program).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anneal_bench::{ChildGroup, load_average, option, write_json};
use anyhow::bail;

const MIB: u64 = 1024 * 1024;
/// The budget for bootd's RSS under this load (docs/bootd.md, "HTTP").
const BUDGET_MIB: f64 = 128.0;

/// Deterministic incompressible-looking content (xorshift).
fn content(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Starts bootd (HTTP on 127.0.0.1 port 0, DHCP on an ephemeral port, no
/// TFTP/PXE) serving `file` as the initrd; its address from its
/// "bootd serving" line.
fn start_bootd(
    bootd: &Path,
    dir: &Path,
    file: &Path,
    log: &Path,
) -> anyhow::Result<(ChildGroup, SocketAddr)> {
    let cfg = dir.join("bootd.yaml");
    std::fs::write(
        &cfg,
        format!(
            "subnet: bench/http\nserverIP: 127.0.0.1\ncidr: 127.0.0.0/8\n\
             dhcp: {{mode: proxy, leaseTime: 10m}}\n\
             api: {{url: \"https://127.0.0.1:8443\", caSha256: \"ab12\"}}\n\
             artifacts: {{kernel: {f}, initrd: {f}}}\nfiles: {{}}\nmachines: []\n",
            f = file.display()
        ),
    )?;
    let mut cmd = Command::new(bootd);
    cmd.arg("--config")
        .arg(&cfg)
        .args(["--listen-ip", "127.0.0.1", "--http-port", "0"])
        .args(["--dhcp-port", "0", "--pxe-port", "0", "--tftp-port", "0"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null());
    let child = ChildGroup::spawn_logged("bootd", &mut cmd, log)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(addr) = text
            .lines()
            .filter(|l| l.contains("bootd serving"))
            .find_map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("http_addr="))
            })
        {
            return Ok((child, addr.parse()?));
        }
        if Instant::now() > deadline {
            bail!(
                "bootd did not print \"bootd serving\" within 30 s; its log: {}",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One download of `/boot/initrd`, compared with `want` as it arrives.
fn download(addr: SocketAddr, want: &[u8]) -> anyhow::Result<()> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    s.write_all(b"GET /boot/initrd HTTP/1.1\r\nHost: bootd\r\nConnection: close\r\n\r\n")?;
    let mut r = BufReader::with_capacity(256 * 1024, s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    if !line.starts_with("HTTP/1.1 200") {
        bail!("status line {line:?}");
    }
    loop {
        line.clear();
        r.read_line(&mut line)?;
        if line.trim_end().is_empty() {
            break;
        }
    }
    let mut buf = vec![0u8; 256 * 1024];
    let mut at = 0usize;
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        if want.get(at..at + n) != Some(&buf[..n]) {
            bail!("body differs from the file within bytes {at}..{}", at + n);
        }
        at += n;
    }
    if at != want.len() {
        bail!("body ended after {at} of {} bytes", want.len());
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    if anneal_bench::flag("--help") {
        println!(
            "bootd-http-load [--parallel N (50)] [--size-mib S (64)] [--bootd PATH]\n\
             N parallel downloads of an S MiB initrd from the bootd process; prints its \
             peak RSS against {BUDGET_MIB} MiB; writes target/bench/bootd-http.json"
        );
        return Ok(());
    }
    let parallel: usize = option("--parallel").map_or(Ok(50), |v| v.parse())?;
    let size_mib: u64 = option("--size-mib").map_or(Ok(64), |v| v.parse())?;
    let bootd = anneal_bench::sibling_bin("bootd", "--bootd", "anneal-bootd")?;
    let dir = tempfile::Builder::new()
        .prefix("bootd-http-load-")
        .tempdir()?;
    let file = dir.path().join("initrd.img");
    let want = Arc::new(content(usize::try_from(size_mib * MIB)?));
    std::fs::write(&file, want.as_slice())?;
    let (child, addr) = start_bootd(&bootd, dir.path(), &file, &dir.path().join("bootd.log"))?;
    let idle_mib = anneal_bench::peak_rss_mib(child.pid())?;
    let start = Instant::now();
    let threads: Vec<_> = (0..parallel)
        .map(|_| {
            let want = want.clone();
            std::thread::spawn(move || download(addr, &want))
        })
        .collect();
    let mut failed = Vec::new();
    for t in threads {
        match t.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failed.push(format!("{e:#}")),
            Err(_) => failed.push("download thread panicked".into()),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let rss_mib = anneal_bench::peak_rss_mib(child.pid())?;
    drop(child);
    let total_mib = (parallel as u64 * size_mib) as f64;
    println!(
        "bootd HTTP: {parallel} parallel downloads of {size_mib} MiB in {secs:.2} s \
         ({:.0} MiB/s), {} byte-identical",
        total_mib / secs,
        parallel - failed.len()
    );
    println!(
        "bootd peak RSS (VmHWM): {rss_mib:.1} MiB (idle {idle_mib:.1} MiB) / budget {BUDGET_MIB} MiB = {:.2} ({})",
        rss_mib / BUDGET_MIB,
        if rss_mib < BUDGET_MIB {
            "met"
        } else {
            "NOT met"
        }
    );
    for f in failed.iter().take(5) {
        println!("  failed: {f}");
    }
    write_json(
        "bootd-http",
        &serde_json::json!({
            "parallel": parallel,
            "size_mib": size_mib,
            "seconds": secs,
            "mib_per_s": total_mib / secs,
            "identical": parallel - failed.len(),
            "failed": failed,
            "peak_rss_mib": rss_mib,
            "idle_rss_mib": idle_mib,
            "budget_mib": BUDGET_MIB,
            "load_average": load_average(),
        }),
    )?;
    if !failed.is_empty() {
        bail!("{} of {parallel} downloads failed", failed.len());
    }
    Ok(())
}
