//! bootd's HTTP server under load and abuse, against the real `bootd`
//! process on loopback (HTTP on port 0, the bound address read from its
//! "bootd serving" line; DHCP on an ephemeral port, TFTP and PXE off):
//!
//! - 50 parallel downloads of a 64 MiB initrd are byte-identical and keep
//!   bootd's peak RSS (VmHWM) under 128 MiB: files are streamed from disk,
//!   not read whole per request;
//! - Range requests: 206 with Content-Range, suffix ranges, 416 with
//!   `bytes */LEN`, HEAD;
//! - 100 connections sending a request head byte by byte are closed at the
//!   header deadline; over the connection cap a request waits for a slot
//!   (it is answered only once the slow heads are gone);
//! - a client that stops reading a download is closed at the stall deadline;
//! - accept errors (EMFILE under a low RLIMIT_NOFILE) back off, not spin.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

mod common;

use common::process::BootdProcess;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1024 * 1024;

/// A running `bootd` serving HTTP on `addr`.
struct Bootd {
    process: BootdProcess,
    addr: SocketAddr,
}

impl std::ops::Deref for Bootd {
    type Target = BootdProcess;
    fn deref(&self) -> &BootdProcess {
        &self.process
    }
}

impl Bootd {
    /// Starts bootd serving `file` as kernel, initrd and `/files/f`, with
    /// `extra` arguments, and waits for its "bootd serving" line.
    fn start(dir: &Path, file: &Path, extra: &[&str]) -> Bootd {
        Bootd::start_with_fd_limit(dir, file, extra, None)
    }

    /// [`Bootd::start`] with RLIMIT_NOFILE set to `nofile` (through the
    /// shell's `ulimit -n`, then `exec`: the PID is bootd's).
    fn start_with_fd_limit(dir: &Path, file: &Path, extra: &[&str], nofile: Option<u32>) -> Bootd {
        let cfg = dir.join("bootd.yaml");
        std::fs::write(
            &cfg,
            format!(
                r#"subnet: lab/http
serverIP: 127.0.0.1
cidr: 127.0.0.0/8
dhcp:
  mode: proxy
  leaseTime: 10m
api: {{url: "https://127.0.0.1:8443", caSha256: "ab12"}}
artifacts: {{kernel: {f}, initrd: {f}}}
files: {{f: {f}}}
machines:
  - name: lab/m1
    mac: "52:54:00:00:00:01"
    address: 127.0.0.50
    token: "tok-secret-1"
"#,
                f = file.display()
            ),
        )
        .unwrap();
        let mut cmd = match nofile {
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(env!("CARGO_BIN_EXE_bootd"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_bootd")),
        };
        let process = BootdProcess::spawn(
            cmd.arg("--config")
                .arg(&cfg)
                .args([
                    "--listen-ip",
                    "127.0.0.1",
                    "--http-port",
                    "0",
                    "--dhcp-port",
                    "0",
                    "--pxe-port",
                    "0",
                    "--tftp-port",
                    "0",
                ])
                .args(extra),
        );
        let addr = process
            .serving
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http_addr="))
            .unwrap_or_else(|| panic!("no http_addr in {:?}", process.serving))
            .parse()
            .unwrap();
        Bootd { process, addr }
    }

    fn metrics(&self) -> String {
        let (code, _, body) = get(self.addr, "GET", "/metrics", &[]);
        assert_eq!(code, 200);
        String::from_utf8(body).unwrap()
    }

    /// Waits (up to 30 s) until `/metrics` holds `line`.
    fn wait_metric(&self, line: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let m = self.metrics();
            if m.lines().any(|l| l == line) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "bootd's /metrics never held {line:?}; last:\n{m}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

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

fn workdir(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix(&format!("bootd-http-{name}-"))
        .tempdir()
        .unwrap();
    let file = dir.path().join("initrd.img");
    (dir, file)
}

/// Reads a response head: status code and headers (names lowercased).
fn read_head(r: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut status = String::new();
    r.read_line(&mut status).unwrap();
    let code = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP status line: {status:?}"));
    let mut headers = Vec::new();
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        let l = l.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').unwrap();
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    (code, headers)
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// One request on a new connection (`Connection: close`): status, headers, body.
fn get(
    addr: SocketAddr,
    method: &str,
    path: &str,
    extra: &[(&str, &str)],
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: bootd\r\nConnection: close\r\n");
    for (k, v) in extra {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let (code, headers) = read_head(&mut r);
    let mut body = Vec::new();
    if method != "HEAD" {
        r.read_to_end(&mut body).unwrap();
    }
    (code, headers, body)
}

/// Downloads `path` and compares it, chunk by chunk, with `want` (the test
/// holds one copy of the file, not one per download).
fn download_and_compare(addr: SocketAddr, path: &str, want: &[u8]) -> Result<(), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(60))).ok();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: bootd\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .map_err(|e| format!("send: {e}"))?;
    let mut r = BufReader::with_capacity(256 * 1024, s);
    let (code, headers) = read_head(&mut r);
    if code != 200 {
        return Err(format!("status {code}"));
    }
    let len: usize = header(&headers, "content-length")
        .and_then(|v| v.parse().ok())
        .ok_or("no content-length")?;
    if len != want.len() {
        return Err(format!("content-length {len}, file is {}", want.len()));
    }
    let mut buf = vec![0u8; 256 * 1024];
    let mut at = 0;
    loop {
        let n = r.read(&mut buf).map_err(|e| format!("read at {at}: {e}"))?;
        if n == 0 {
            break;
        }
        if at + n > want.len() {
            return Err(format!("body longer than {} bytes", want.len()));
        }
        if buf[..n] != want[at..at + n] {
            return Err(format!(
                "body differs from the file within bytes {at}..{}",
                at + n
            ));
        }
        at += n;
    }
    if at != want.len() {
        return Err(format!("body ended after {at} of {} bytes", want.len()));
    }
    Ok(())
}

#[test]
fn parallel_downloads_stream_from_disk_and_ranges() {
    let (dir, file) = workdir("load");
    let want = Arc::new(content(64 * MIB));
    std::fs::write(&file, want.as_slice()).unwrap();
    let bootd = Bootd::start(dir.path(), &file, &[]);
    let started = Instant::now();
    let threads: Vec<_> = (0..50)
        .map(|i| {
            let want = want.clone();
            let addr = bootd.addr;
            let path = if i % 2 == 0 {
                "/boot/initrd"
            } else {
                "/files/f"
            };
            std::thread::spawn(move || download_and_compare(addr, path, &want))
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let took = started.elapsed();
    let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "downloads failed: {failed:?}");
    let rss = bootd.peak_rss();
    eprintln!(
        "50 parallel 64 MiB downloads in {:.1} s; bootd VmHWM {:.1} MiB",
        took.as_secs_f64(),
        rss as f64 / MIB as f64
    );
    assert!(
        rss < 128 * MIB as u64,
        "bootd's peak RSS after 50 parallel 64 MiB downloads is {:.1} MiB, over 128 MiB: \
         files must be streamed, not read whole per request",
        rss as f64 / MIB as f64
    );

    let len = want.len();
    // a range in the middle
    let (code, h, body) = get(
        bootd.addr,
        "GET",
        "/boot/initrd",
        &[("Range", "bytes=60000000-60065535")],
    );
    assert_eq!(code, 206);
    assert_eq!(
        header(&h, "content-range"),
        Some(format!("bytes 60000000-60065535/{len}").as_str())
    );
    assert_eq!(header(&h, "content-length"), Some("65536"));
    assert!(body == want[60_000_000..60_065_536], "range body differs");
    // open-ended and suffix ranges
    let (code, h, body) = get(
        bootd.addr,
        "GET",
        "/files/f",
        &[("Range", "bytes=67108000-")],
    );
    assert_eq!(code, 206);
    assert_eq!(
        header(&h, "content-range"),
        Some(format!("bytes 67108000-{}/{len}", len - 1).as_str())
    );
    assert!(body == want[67_108_000..], "open-ended range body differs");
    let (code, h, body) = get(
        bootd.addr,
        "GET",
        "/boot/kernel",
        &[("Range", "bytes=-100")],
    );
    assert_eq!(code, 206);
    assert_eq!(
        header(&h, "content-range"),
        Some(format!("bytes {}-{}/{len}", len - 100, len - 1).as_str())
    );
    assert!(body == want[len - 100..], "suffix range body differs");
    // unsatisfiable
    for r in [
        format!("bytes={len}-"),
        "bytes=-0".to_string(),
        "bytes=9-3".into(),
    ] {
        let (code, h, body) = get(bootd.addr, "GET", "/boot/initrd", &[("Range", &r)]);
        assert_eq!(code, 416, "{r}");
        assert_eq!(
            header(&h, "content-range"),
            Some(format!("bytes */{len}").as_str()),
            "{r}"
        );
        assert!(body.is_empty(), "{r}");
    }
    // HEAD: the length, no body
    let (code, h, _) = get(bootd.addr, "HEAD", "/boot/initrd", &[]);
    assert_eq!(code, 200);
    assert_eq!(header(&h, "content-length"), Some(len.to_string().as_str()));
    assert_eq!(header(&h, "accept-ranges"), Some("bytes"));
    // a missing file is 404, not a hang
    std::fs::remove_file(&file).unwrap();
    let (code, _, _) = get(bootd.addr, "GET", "/boot/initrd", &[]);
    assert_eq!(code, 404);
}

/// Sends `GET / HTTP/1.1\r\nHost: x` one byte every 200 ms, never the end
/// of the head; returns how long after `start` bootd closed the connection.
fn slow_head(addr: SocketAddr, start: Instant, give_up: Duration) -> Result<Duration, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_millis(200))).ok();
    let head = b"GET /healthz HTTP/1.1\r\nHost: bootd\r\nX-Slow: ";
    let mut sent = 0;
    loop {
        let byte = [head.get(sent).copied().unwrap_or(b'a')];
        sent += 1;
        if s.write_all(&byte).is_err() {
            return Ok(start.elapsed()); // reset by the server
        }
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(0) => return Ok(start.elapsed()),
            Ok(_) => {} // a 408 or similar before the close
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Ok(start.elapsed()),
        }
        if start.elapsed() > give_up {
            return Err(format!(
                "still open after {:.1} s ({sent} bytes sent)",
                start.elapsed().as_secs_f64()
            ));
        }
    }
}

#[test]
fn slow_heads_closed_at_the_header_deadline() {
    let (dir, file) = workdir("slow");
    std::fs::write(&file, content(MIB)).unwrap();
    let bootd = Bootd::start(dir.path(), &file, &["--http-header-timeout-secs", "2"]);
    let deadline = Duration::from_secs(2);
    let slack = Duration::from_secs(5);
    let start = Instant::now();
    let threads: Vec<_> = (0..100)
        .map(|_| {
            let addr = bootd.addr;
            std::thread::spawn(move || slow_head(addr, start, deadline + slack))
        })
        .collect();
    let closed: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let open: Vec<_> = closed.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        open.is_empty(),
        "{} of 100 slow request heads were not closed within the 2 s header deadline (+5 s): {:?}",
        open.len(),
        open.first()
    );
    for c in closed.iter().flatten() {
        assert!(
            *c >= deadline,
            "a slow head was closed after {c:?}, before the 2 s deadline"
        );
    }
    bootd.wait_metric("bootd_http_closed_total{reason=\"header_deadline\"} 100");
    // a well-behaved client is still served
    let (code, _, body) = get(bootd.addr, "GET", "/healthz", &[]);
    assert_eq!((code, body.as_slice()), (200, b"ok\n".as_slice()));
}

#[test]
fn over_the_connection_cap_a_request_waits_for_a_slot() {
    let (dir, file) = workdir("cap");
    std::fs::write(&file, content(MIB)).unwrap();
    let header_deadline = Duration::from_secs(2);
    let bootd = Bootd::start(
        dir.path(),
        &file,
        &[
            "--http-max-connections",
            "2",
            "--http-header-timeout-secs",
            "2",
        ],
    );
    let start = Instant::now();
    // two connections that never send anything hold both slots...
    let idle: Vec<_> = (0..2)
        .map(|_| TcpStream::connect(bootd.addr).unwrap())
        .collect();
    // ...so a third request is answered only once the header deadline has
    // closed one of them (it cannot be earlier than 2 s after the start).
    let (code, _, body) = get(bootd.addr, "GET", "/healthz", &[]);
    let answered = start.elapsed();
    assert_eq!((code, body.as_slice()), (200, b"ok\n".as_slice()));
    assert!(
        answered >= header_deadline,
        "a third connection was served after {answered:?} while two idle connections held \
         the cap of 2 (their header deadline is 2 s)"
    );
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut buf = [0u8; 64];
        assert!(
            matches!(s.read(&mut buf), Ok(0) | Err(_)),
            "an idle connection was not closed"
        );
    }
}

#[test]
fn a_client_that_stops_reading_is_closed_at_the_stall_deadline() {
    let (dir, file) = workdir("stall");
    let want = content(64 * MIB);
    std::fs::write(&file, &want).unwrap();
    let bootd = Bootd::start(dir.path(), &file, &["--http-stall-timeout-secs", "1"]);
    let mut s = TcpStream::connect(bootd.addr).unwrap();
    s.write_all(b"GET /boot/initrd HTTP/1.1\r\nHost: bootd\r\nConnection: close\r\n\r\n")
        .unwrap();
    // not reading: the socket buffers fill, then nothing moves
    bootd.wait_metric("bootd_http_closed_total{reason=\"stall\"} 1");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(
        got.len() < want.len(),
        "the stalled download was not cut ({} bytes read)",
        got.len()
    );
    // only the connection of the /metrics request itself is left open
    bootd.wait_metric("bootd_http_connections 1");
}

#[test]
fn accept_errors_back_off_instead_of_spinning() {
    let (dir, file) = workdir("emfile");
    std::fs::write(&file, content(MIB)).unwrap();
    // 48 descriptors: the runtime, the sockets and the log leave room for a
    // few dozen connections, then accept fails with EMFILE
    let bootd = Bootd::start_with_fd_limit(dir.path(), &file, &[], Some(48));
    let mut held = Vec::new();
    for _ in 0..64 {
        held.push(TcpStream::connect(bootd.addr).unwrap());
    }
    // the accept error is logged once per attempt: with the back-off ten
    // attempts take at least 9 pauses of 100 ms, spinning takes microseconds
    let deadline = Instant::now() + Duration::from_secs(60);
    let span = anneal_testinfra::accept_failure_span(
        || {
            bootd
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .ok()
        },
        "http accept failed",
    )
    .unwrap();
    assert!(
        span >= Duration::from_millis(900),
        "ten accept retries after EMFILE took {span:?}: the accept loop spins (it must pause \
         100 ms after each)"
    );
    // once descriptors are free again, bootd serves
    drop(held);
    let (code, _, body) = get(bootd.addr, "GET", "/healthz", &[]);
    assert_eq!((code, body.as_slice()), (200, b"ok\n".as_slice()));
}
