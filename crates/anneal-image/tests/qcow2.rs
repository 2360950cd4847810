//! The native qcow2 reader (`anneal_image::qcow2`, through
//! `source::qcow2_to_raw` as capture calls it) against the real `qemu-img`
//! (Debian's qemu-utils, installed by tests/setup.sh): images qemu-img
//! writes from a raw disk with data and holes, in every layout the reader
//! supports, convert to the same bytes as `qemu-img convert -O raw`, into a
//! sparse file; images with a backing file, an external data file or
//! encryption are refused with the reason. qemu-img builds the inputs and
//! the reference only; the product never runs it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use anneal_image::qcow2::{self, Image};
use anneal_image::source::{self, SourceError};
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

/// 40 MiB + 12 KiB: not a multiple of 64 KiB nor 2 MiB clusters, so the
/// last cluster is partial.
const DISK: u64 = (40 << 20) + (12 << 10);

fn qemu_img() -> &'static str {
    let ok = Command::new("qemu-img")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ok,
        "qemu-img is not on PATH: run tests/setup.sh (it installs Debian's qemu-utils) \
         before these tests"
    );
    "qemu-img"
}

fn run(args: &[&str]) {
    run_prog(qemu_img(), args);
}

fn run_prog(prog: &str, args: &[&str]) {
    let o = Command::new(prog).args(args).output().unwrap_or_else(|e| {
        panic!("{prog}: {e}: run tests/setup.sh (it installs Debian's qemu-utils)")
    });
    assert!(
        o.status.success(),
        "{prog} {args:?}: {}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// xorshift64*: the same bytes every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A sparse raw disk: scattered writes of random (incompressible) and
/// text-like (compressible) bytes at odd offsets and lengths, the first and
/// last bytes of the disk, and an explicit run of zeros inside data.
fn raw_disk(dir: &Path) -> PathBuf {
    let p = dir.join("disk.raw");
    let f = File::create(&p).unwrap();
    f.set_len(DISK).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let write = |off: u64, data: &[u8]| f.write_all_at(data, off).unwrap();
    let text: Vec<u8> = b"anneal qcow2 native reader, not qemu-img. "
        .iter()
        .copied()
        .cycle()
        .take(300 << 10)
        .collect();
    for i in 0..80u64 {
        let len = 1 + rng.below(if i % 4 == 0 { 300 << 10 } else { 20 << 10 });
        let off = rng.below(DISK - len);
        let off = if i % 3 == 0 { off & !511 } else { off };
        let data: Vec<u8> = if i % 2 == 0 {
            (0..len).map(|_| rng.next() as u8).collect()
        } else {
            let start = rng.below(1000) as usize;
            text[start..start + len as usize].to_vec()
        };
        write(off, &data);
    }
    // a partition-table-like start, the very end, zeros inside data
    write(0, &[0xeb; 4096]);
    write(DISK - 700, &[0xfe; 700]);
    write(8 << 20, &vec![0x3c; 3 << 20]);
    write((9 << 20) + 4096, &vec![0; 1 << 20]);
    p
}

fn read_all(p: &Path) -> Vec<u8> {
    let mut v = Vec::new();
    File::open(p).unwrap().read_to_end(&mut v).unwrap();
    v
}

/// Our conversion, as capture runs it, against qemu-img's; returns ours.
fn check_same(dir: &Path, img: &Path, what: &str) -> Vec<u8> {
    let reference = dir.join(format!("{what}.qemu.raw"));
    run(&["convert", "-f", "qcow2", "-O", "raw", s(img), s(&reference)]);
    let ours = dir.join(format!("{what}.ours.raw"));
    source::qcow2_to_raw(img, &ours).unwrap_or_else(|e| panic!("{what}: {}", chain(&e)));
    let (a, b) = (read_all(&ours), read_all(&reference));
    assert_eq!(a.len(), b.len(), "{what}: length");
    if let Some(i) = a.iter().zip(&b).position(|(x, y)| x != y) {
        panic!("{what}: first difference at byte {i}");
    }
    // sparse: the holes of the source are holes in ours
    let data = b.chunks(4096).filter(|c| c.iter().any(|&x| x != 0)).count() as u64 * 4096;
    let allocated = std::fs::metadata(&ours).unwrap().blocks() * 512;
    assert!(
        allocated <= data + (1 << 20),
        "{what}: {allocated} bytes allocated for {data} bytes of data"
    );
    a
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn qcow2_error(e: &SourceError) -> &qcow2::Qcow2Error {
    match e {
        SourceError::Qcow2 { source, .. } => source,
        e => panic!("not a qcow2 error: {}", chain(e)),
    }
}

/// Each layout qemu-img writes from the same raw disk reads back as that
/// disk, byte for byte, as qemu-img reads it.
#[test]
fn layouts_convert_like_qemu_img() {
    let d = tempfile::tempdir().unwrap();
    let raw = raw_disk(d.path());
    let want = read_all(&raw);
    let cases: &[(&str, &[&str])] = &[
        ("v3", &[]),
        ("v2", &["-o", "compat=0.10"]),
        ("zlib", &["-c"]),
        ("zstd", &["-c", "-o", "compression_type=zstd"]),
        ("c512", &["-o", "cluster_size=512"]),
        ("c512-zlib", &["-c", "-o", "cluster_size=512"]),
        ("c2m", &["-o", "cluster_size=2M"]),
        (
            "c2m-zstd",
            &["-c", "-o", "cluster_size=2M,compression_type=zstd"],
        ),
        ("extl2", &["-o", "extended_l2=on"]),
        (
            "extl2-zlib",
            &["-c", "-o", "extended_l2=on,cluster_size=16K"],
        ),
        ("v2-zlib", &["-c", "-o", "compat=0.10"]),
        ("prealloc", &["-o", "preallocation=metadata"]),
    ];
    for (what, opts) in cases {
        let img = d.path().join(format!("{what}.qcow2"));
        let mut args = vec!["convert", "-f", "raw", "-O", "qcow2"];
        args.extend_from_slice(opts);
        args.extend_from_slice(&[s(&raw), s(&img)]);
        run(&args);
        let h = Image::open(&read_all(&img)[..]).unwrap();
        let h = h.header();
        match *what {
            "v2" | "v2-zlib" => assert_eq!(h.version, 2, "{what}"),
            "c512" | "c512-zlib" => assert_eq!(h.cluster_bits, 9, "{what}"),
            "c2m" | "c2m-zstd" => assert_eq!(h.cluster_bits, 21, "{what}"),
            "extl2" | "extl2-zlib" => assert!(h.extended_l2, "{what}"),
            _ => assert_eq!(h.version, 3, "{what}"),
        }
        if what.ends_with("zstd") {
            assert_eq!(h.compression, qcow2::Compression::Zstd, "{what}");
        }
        let ours = check_same(d.path(), &img, what);
        assert!(ours == want, "{what}: not the source disk");
        std::fs::remove_file(d.path().join(format!("{what}.ours.raw"))).unwrap();
        std::fs::remove_file(d.path().join(format!("{what}.qemu.raw"))).unwrap();
    }
}

/// Images written in place by qemu-io: zero clusters (v3 flag, over
/// allocated and unallocated clusters), discards, rewrites, partial-cluster
/// writes and, with extended L2 entries, subclusters allocated, zeroed and
/// left unallocated inside one cluster; a dirty image (lazy refcounts, the
/// writer killed) reads too.
#[test]
fn in_place_writes_convert_like_qemu_img() {
    let d = tempfile::tempdir().unwrap();
    let io_cmds: &[&str] = &[
        "write -P 0x11 0 1M",
        "write -z 64k 128k",
        "write -P 0x22 300k 3k",
        "write -z 2M 1M",
        "write -P 0x33 5M 2k",
        "discard 768k 128k",
        "write -P 0x44 7M 65k",
        "write -z -u 7M 32k",
        "write -P 0x55 1022k 1k",
    ];
    for (what, create) in [
        ("io-v3", "compat=1.1"),
        ("io-v2", "compat=0.10"),
        ("io-extl2", "extended_l2=on"),
        ("io-extl2-32k", "extended_l2=on,cluster_size=32K"),
        ("io-c4k", "cluster_size=4K"),
    ] {
        let img = d.path().join(format!("{what}.qcow2"));
        run(&["create", "-f", "qcow2", "-o", create, s(&img), "8M"]);
        let mut args = Vec::new();
        for c in io_cmds {
            args.extend_from_slice(&["-c", c]);
        }
        args.push(s(&img));
        run_prog("qemu-io", &args);
        check_same(d.path(), &img, what);
    }
    // dirty: lazy refcounts and the writer killed before it cleaned up
    let img = d.path().join("dirty.qcow2");
    run(&[
        "create",
        "-f",
        "qcow2",
        "-o",
        "lazy_refcounts=on",
        s(&img),
        "4M",
    ]);
    let o = Command::new("qemu-io")
        .args(["-c", "write -P 0x77 64k 1M", "-c", "sigraise 9", s(&img)])
        .output()
        .unwrap();
    assert!(!o.status.success(), "qemu-io was to be killed");
    assert!(Image::open(&read_all(&img)[..]).unwrap().header().dirty());
    check_same(d.path(), &img, "dirty");
}

/// What QEMU does where the spec leaves room: a virtual size that is not
/// a whole number of sectors is rounded down; a zero flag in a version 2
/// image is corruption (qemu-img fails the read; so do we).
#[test]
fn hand_edited_headers_read_like_qemu_img() {
    let d = tempfile::tempdir().unwrap();
    let img = d.path().join("v2.qcow2");
    run(&["create", "-f", "qcow2", "-o", "compat=0.10", s(&img), "4M"]);
    run_prog(
        "qemu-io",
        &[
            "-c",
            "write -P 0x61 0 256k",
            "-c",
            "write -P 0x62 3M 64k",
            s(&img),
        ],
    );
    // 4 MiB + 300 bytes
    let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    f.write_all_at(&((4u64 << 20) + 300).to_be_bytes(), 24)
        .unwrap();
    let out = check_same(d.path(), &img, "size");
    assert_eq!(out.len(), 4 << 20);
    assert!(out[..256 << 10].iter().all(|&b| b == 0x61));

    // the second cluster's L2 entry gets the zero flag
    let bytes = read_all(&img);
    let h = Image::open(&bytes[..]).unwrap().header().clone();
    let l1 = u64::from_be_bytes(bytes[h.l1_table_offset as usize..][..8].try_into().unwrap());
    let l2 = (l1 & 0x00ff_ffff_ffff_fe00) as usize;
    let e = u64::from_be_bytes(bytes[l2 + 8..l2 + 16].try_into().unwrap());
    assert_ne!(e & 0x00ff_ffff_ffff_fe00, 0);
    f.write_all_at(&(e | 1).to_be_bytes(), l2 as u64 + 8)
        .unwrap();
    drop(f);
    let o = Command::new(qemu_img())
        .args(["convert", "-f", "qcow2", "-O", "raw", s(&img)])
        .arg(d.path().join("zero.qemu.raw"))
        .output()
        .unwrap();
    assert!(!o.status.success(), "qemu-img read a v2 zero flag");
    let e = source::qcow2_to_raw(&img, &d.path().join("zero.ours.raw")).expect_err("refused");
    assert!(
        matches!(
            qcow2_error(&e),
            qcow2::Qcow2Error::Cluster { guest: 65536, .. }
        ),
        "{}",
        chain(&e)
    );
}

/// A qcow2 that reaches outside its own file is refused, with the reason,
/// and leaves no output behind.
#[test]
fn backing_data_file_and_encryption_refused() {
    let d = tempfile::tempdir().unwrap();
    let base = d.path().join("base.raw");
    File::create(&base)
        .unwrap()
        .write_all(&[0x5a; 1 << 20])
        .unwrap();
    let img = |n: &str| d.path().join(n);
    let out = d.path().join("out.raw");
    let refuse = |p: &Path| -> (String, SourceError) {
        let e = source::qcow2_to_raw(p, &out).expect_err("refused");
        assert!(!out.exists(), "output left behind");
        (chain(&e), e)
    };

    run(&[
        "create",
        "-f",
        "qcow2",
        "-b",
        s(&base),
        "-F",
        "raw",
        s(&img("backing.qcow2")),
    ]);
    let (msg, e) = refuse(&img("backing.qcow2"));
    assert!(
        matches!(qcow2_error(&e), qcow2::Qcow2Error::BackingFile(Some(n)) if n == s(&base)),
        "{msg}"
    );
    assert!(msg.contains("has a backing file (\""), "{msg}");
    assert!(
        msg.contains("flatten it with `qemu-img convert -O qcow2`"),
        "{msg}"
    );
    // a URL, not checked at creation (-u)
    run(&[
        "create",
        "-f",
        "qcow2",
        "-u",
        "-b",
        "http://169.254.169.254/latest/x",
        "-F",
        "raw",
        s(&img("url.qcow2")),
        "1M",
    ]);
    let (msg, _) = refuse(&img("url.qcow2"));
    assert!(msg.contains("\"http://169.254.169.254/latest/x\""), "{msg}");
    // a qcow2 backing chain
    run(&[
        "convert",
        "-f",
        "raw",
        "-O",
        "qcow2",
        s(&base),
        s(&img("base.qcow2")),
    ]);
    run(&[
        "create",
        "-f",
        "qcow2",
        "-b",
        s(&img("base.qcow2")),
        "-F",
        "qcow2",
        s(&img("overlay.qcow2")),
    ]);
    let (_, e) = refuse(&img("overlay.qcow2"));
    assert!(matches!(qcow2_error(&e), qcow2::Qcow2Error::BackingFile(_)));

    let data = img("data.raw");
    let data2 = img("data2.raw");
    for (n, opts) in [
        ("data.qcow2", format!("data_file={}", s(&data))),
        (
            "data-raw.qcow2",
            format!("data_file={},data_file_raw=on", s(&data2)),
        ),
    ] {
        run(&["create", "-f", "qcow2", "-o", &opts, s(&img(n)), "4M"]);
        let (msg, e) = refuse(&img(n));
        assert!(
            matches!(qcow2_error(&e), qcow2::Qcow2Error::DataFile(Some(_))),
            "{msg}"
        );
        assert!(msg.contains("external data file"), "{msg}");
    }

    for (n, fmt) in [("luks.qcow2", "luks"), ("aes.qcow2", "aes")] {
        // iter-time only matters to LUKS; 100 ms (10 is refused by
        // qemu-img: "Unable to get accurate CPU usage")
        let mut o = format!("encrypt.format={fmt},encrypt.key-secret=s0");
        if fmt == "luks" {
            o.push_str(",encrypt.iter-time=100");
        }
        let path = img(n);
        let args = [
            "create",
            "-f",
            "qcow2",
            "--object",
            "secret,id=s0,data=x",
            "-o",
            &o,
            s(&path),
            "4M",
        ];
        // QEMU's LUKS key-slot benchmark (qcrypto_pbkdf2_count_iters) fails
        // with "Unable to get accurate CPU usage" when its first round of
        // PBKDF2 takes less than one tick of the thread's CPU clock: a matter
        // of luck per attempt, so that one refusal is tried again (bounded)
        let mut attempt = 0;
        loop {
            let o = Command::new(qemu_img()).args(args).output().unwrap();
            let err = String::from_utf8_lossy(&o.stderr).into_owned();
            if o.status.success() {
                break;
            }
            attempt += 1;
            assert!(
                attempt < 20 && err.contains("Unable to get accurate CPU usage"),
                "qemu-img {args:?}: {}\n{err}",
                o.status
            );
        }
        let (msg, e) = refuse(&img(n));
        assert!(
            matches!(qcow2_error(&e), qcow2::Qcow2Error::Encrypted(_)),
            "{msg}"
        );
        assert!(msg.contains(&format!("is encrypted ({fmt})")), "{msg}");
    }

    // not qcow2 at all
    let (msg, e) = refuse(&base);
    assert!(
        matches!(qcow2_error(&e), qcow2::Qcow2Error::Magic { .. }),
        "{msg}"
    );
}
