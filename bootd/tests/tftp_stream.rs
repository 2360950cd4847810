//! bootd's TFTP (docs/bootd.md, "TFTP") streams from disk and bounds what it
//! sends to a client that never answers, against the real `bootd` process on
//! loopback (TFTP on a free port of 127.0.0.1, HTTP on port 0, DHCP on an
//! ephemeral port, PXE off):
//!
//! - a file larger than the old whole-file cache limit (64 MiB) arrives
//!   byte-identical over a windowed transfer, and bootd's peak RSS stays
//!   far below the file's size (it was read whole per transfer before);
//! - a file rewritten in place during a transfer ends the transfer with
//!   ERROR 0 "file changed during the transfer", never with a file mixing
//!   both versions; a file renamed over a running transfer's is served
//!   whole from the old one;
//! - a request whose sender never acknowledges (a forged source) gets its
//!   first reply (OACK, or DATA 1 without options) at most 3 times, and
//!   nothing else: no window, no ERROR.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

mod common;

use common::process::BootdProcess;
use std::io::{Seek, SeekFrom, Write};
use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

const MIB: u64 = 1024 * 1024;

/// A running `bootd` serving TFTP on `tftp`.
struct Bootd {
    process: BootdProcess,
    tftp: SocketAddr,
}

impl std::ops::Deref for Bootd {
    type Target = BootdProcess;
    fn deref(&self) -> &BootdProcess {
        &self.process
    }
}

impl Bootd {
    /// Starts bootd serving `file` as TFTP file `f`, waits for its
    /// "bootd serving" line.
    fn start(dir: &Path, file: &Path) -> Bootd {
        let cfg = dir.join("bootd.yaml");
        std::fs::write(
            &cfg,
            format!(
                "subnet: lab/tftp\nserverIP: 127.0.0.1\ncidr: 127.0.0.0/8\n\
                 dhcp: {{mode: proxy, leaseTime: 10m}}\n\
                 api: {{url: \"https://127.0.0.1:8443\", caSha256: \"ab12\"}}\n\
                 files: {{f: {f}}}\nmachines: []\n",
                f = file.display()
            ),
        )
        .unwrap();
        // a free UDP port (port 0 turns TFTP off)
        let tftp = UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let process = BootdProcess::spawn(
            Command::new(env!("CARGO_BIN_EXE_bootd"))
                .arg("--config")
                .arg(&cfg)
                .args(["--listen-ip", "127.0.0.1", "--http-port", "0"])
                .args(["--dhcp-port", "0", "--pxe-port", "0"])
                .args(["--tftp-port", &tftp.port().to_string()]),
        );
        Bootd { process, tftp }
    }
}

/// The byte at offset `i` of the test files (a version byte mixed in).
fn byte_at(i: u64, version: u8) -> u8 {
    ((i.wrapping_mul(2_654_435_761) >> 13) as u8) ^ ((i / 4093) as u8) ^ version
}

/// Writes a `len`-byte test file one MiB at a time (the test holds no
/// more), its mtime set in the past (so a later write changes it however
/// coarse the file system's clock).
fn write_file(path: &Path, len: u64, version: u8) {
    let mut f = std::fs::File::create(path).unwrap();
    let mut off = 0;
    let mut chunk = Vec::with_capacity(MIB as usize);
    while off < len {
        let n = (len - off).min(MIB);
        chunk.clear();
        chunk.extend((off..off + n).map(|i| byte_at(i, version)));
        f.write_all(&chunk).unwrap();
        off += n;
    }
    f.sync_all().unwrap();
    f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000))
        .unwrap();
}

fn rrq(name: &str, opts: &[(&str, &str)]) -> Vec<u8> {
    let mut p = vec![0, 1];
    for s in [name, "octet"]
        .into_iter()
        .chain(opts.iter().flat_map(|(k, v)| [*k, *v]))
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

/// A client socket on `ip`, reads timing out after `timeout` (a bound on
/// a hung test only).
fn client(ip: [u8; 4], timeout: Duration) -> UdpSocket {
    let c = UdpSocket::bind(SocketAddr::from((ip, 0))).unwrap();
    c.set_read_timeout(Some(timeout)).unwrap();
    c
}

/// How a windowed transfer ended.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// Every block came: the byte count; each byte was checked against
    /// `byte_at(_, version)` as it came.
    Done(u64),
    /// An ERROR came after `u64` bytes: its code and message.
    Error(u64, u16, String),
}

/// Fetches `f` with blksize `bs` and windowsize `win`, comparing each byte
/// with version `version` as it arrives (nothing is kept). `after(bytes)`
/// runs once after each acknowledged window.
fn fetch(bootd: &Bootd, bs: usize, win: u16, version: u8, mut after: impl FnMut(u64)) -> Outcome {
    let c = client([127, 0, 0, 1], Duration::from_secs(30));
    let (bs_s, win_s) = (bs.to_string(), win.to_string());
    c.send_to(
        &rrq("f", &[("blksize", &bs_s), ("windowsize", &win_s)]),
        bootd.tftp,
    )
    .unwrap();
    let mut buf = vec![0u8; 70_000];
    let mut next: u64 = 1;
    let mut got: u64 = 0;
    let mut in_window = 0;
    loop {
        let (n, from) = c.recv_from(&mut buf).unwrap();
        let p = &buf[..n];
        match u16::from_be_bytes([p[0], p[1]]) {
            6 => c.send_to(&ack(0), from).map(drop).unwrap(),
            3 => {
                let block = u16::from_be_bytes([p[2], p[3]]);
                if block != next as u16 {
                    // out of order (RFC 7440): ACK what we have
                    c.send_to(&ack((next - 1) as u16), from).unwrap();
                    in_window = 0;
                    continue;
                }
                for (k, b) in p[4..].iter().enumerate() {
                    let at = got + k as u64;
                    assert_eq!(*b, byte_at(at, version), "byte {at} differs");
                }
                got += (n - 4) as u64;
                next += 1;
                in_window += 1;
                let last = n - 4 < bs;
                if last || in_window == win {
                    c.send_to(&ack(block), from).unwrap();
                    in_window = 0;
                    after(got);
                }
                if last {
                    return Outcome::Done(got);
                }
            }
            5 => {
                let code = u16::from_be_bytes([p[2], p[3]]);
                let msg = String::from_utf8_lossy(&p[4..n - 1]).into_owned();
                return Outcome::Error(got, code, msg);
            }
            op => panic!("opcode {op}: {p:?}"),
        }
    }
}

/// 66 MiB and change (above the old 64 MiB cache limit, which made every
/// transfer of such a file read it whole): byte-identical, and bootd's peak
/// RSS stays under 32 MiB (a whole read alone would be 66).
#[test]
fn a_file_above_the_old_limit_streams_byte_identical_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("big");
    let len = 66 * MIB + 777;
    write_file(&file, len, 0);
    let bootd = Bootd::start(dir.path(), &file);
    let before = bootd.peak_rss();
    assert_eq!(fetch(&bootd, 1468, 64, 0, |_| {}), Outcome::Done(len));
    let peak = bootd.peak_rss();
    eprintln!(
        "bootd peak RSS: {} MiB before, {} MiB after",
        before / MIB,
        peak / MIB
    );
    assert!(
        peak < 32 * MIB,
        "bootd's peak RSS {} MiB after a {} MiB transfer (before: {} MiB): the file was held whole",
        peak / MIB,
        len / MIB,
        before / MIB
    );
}

/// A rewrite in place during a transfer ends it with an ERROR naming the
/// change (the client never completes a mix of two versions); the next
/// request gets the new content whole. A rename over the file does not
/// touch the open one: that transfer finishes with the old content.
#[test]
fn a_file_changed_during_a_transfer_ends_it_instead_of_mixing_versions() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    let len = 4 * MIB + 11;
    write_file(&file, len, 0);
    let bootd = Bootd::start(dir.path(), &file);

    // in place: the second half rewritten once 1 MiB has arrived
    let mut changed = false;
    let out = fetch(&bootd, 1024, 4, 0, |got| {
        if !changed && got >= MIB {
            changed = true;
            let mut f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
            f.seek(SeekFrom::Start(2 * MIB)).unwrap();
            let new: Vec<u8> = (2 * MIB..3 * MIB).map(|i| byte_at(i, 0x5a)).collect();
            f.write_all(&new).unwrap();
        }
    });
    match out {
        Outcome::Error(got, 0, msg) => {
            assert_eq!(msg, "file changed during the transfer: request it again");
            assert!(got < 2 * MIB + 4096, "{got} bytes arrived before the error");
        }
        other => panic!("the transfer did not end on the change: {other:?}"),
    }
    bootd.wait_lines(&["tftp read abandoned", "changed during the transfer"], 1);

    // the next request: the file as it is now, whole (version 0 outside
    // the rewritten MiB): write it fully as version 1 to compare simply
    write_file(&file, len, 1);
    assert_eq!(fetch(&bootd, 1468, 8, 1, |_| {}), Outcome::Done(len));

    // renamed over mid-transfer: the running transfer keeps the old file
    let mut renamed = false;
    let tmp = dir.path().join("f.new");
    let out = fetch(&bootd, 1468, 8, 1, |got| {
        if !renamed && got >= MIB {
            renamed = true;
            write_file(&tmp, len, 2);
            std::fs::rename(&tmp, &file).unwrap();
        }
    });
    assert!(renamed);
    assert_eq!(out, Outcome::Done(len));
    assert_eq!(fetch(&bootd, 1468, 8, 2, |_| {}), Outcome::Done(len));
}

/// Two requests whose senders never acknowledge anything (as when the
/// source address is forged): one with options (answered by an OACK), one
/// without (answered by DATA 1 of 512 bytes). Each gets its first reply at
/// most 3 times in all and nothing else, then bootd ends the transfer
/// (its log says so). Fails fast on the 4th copy.
#[test]
fn a_request_never_acknowledged_gets_at_most_three_times_its_first_reply() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    write_file(&file, 5 * MIB, 0);
    let bootd = Bootd::start(dir.path(), &file);
    let slice = Duration::from_millis(50);
    let with_opts = client([127, 0, 0, 2], slice);
    let plain = client([127, 0, 0, 3], slice);
    with_opts
        .send_to(
            &rrq(
                "f",
                &[
                    ("blksize", "1468"),
                    ("windowsize", "64"),
                    ("tsize", "0"),
                    ("timeout", "1"),
                ],
            ),
            bootd.tftp,
        )
        .unwrap();
    plain.send_to(&rrq("f", &[]), bootd.tftp).unwrap();
    // (socket, first packet, bytes, packets)
    let mut got: Vec<(&UdpSocket, Vec<u8>, usize, usize)> =
        vec![(&with_opts, Vec::new(), 0, 0), (&plain, Vec::new(), 0, 0)];
    let mut buf = vec![0u8; 70_000];
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut ended = 0;
    loop {
        for (sock, first, bytes, packets) in &mut got {
            while let Ok((n, _)) = sock.recv_from(&mut buf) {
                if first.is_empty() {
                    first.extend_from_slice(&buf[..n]);
                }
                assert_eq!(&buf[..n], &first[..], "not a copy of the first reply");
                *bytes += n;
                *packets += 1;
                assert!(
                    *bytes <= 3 * first.len(),
                    "{} bytes ({} packets) sent for a first reply of {} bytes",
                    bytes,
                    packets,
                    first.len()
                );
            }
        }
        if ended == 2 {
            break;
        }
        // the transfers' end, as bootd logs it (polled between reads)
        while let Ok(line) = bootd.lines.try_recv() {
            if line.contains("tftp read abandoned") && line.contains("never acknowledged") {
                ended += 1;
            }
        }
        assert!(Instant::now() < deadline, "transfers still running");
    }
    let (oack, data1) = (&got[0], &got[1]);
    assert_eq!(&oack.1[..2], &[0, 6], "{:?}", oack.1);
    assert_eq!(
        oack.1,
        b"\0\x06blksize\x001468\0timeout\x001\0tsize\x005242880\0windowsize\x0064\0".to_vec()
    );
    assert_eq!(&data1.1[..4], &[0, 3, 0, 1]);
    assert_eq!(data1.1.len(), 516);
    for (_, first, bytes, packets) in &got {
        assert_eq!(*packets, 3, "first reply {first:?}");
        assert_eq!(*bytes, 3 * first.len());
    }
}
