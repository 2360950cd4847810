//! `anneal_agent::swarm` on loopback: an ext4 partition captured into a
//! content (64 KiB pieces), seeded by `Seeder` from its stream, fetched by
//! leechers onto a slot of a target file. What lands in the used blocks is
//! the source's bytes (a direct restore's), the stream's SHA-256 is checked,
//! a peer that serves corrupt pieces changes nothing on the target, and a
//! swarm with no peer fails with a reason instead of hanging. A raw content
//! (a partition no probe recognises, `FLAG_GAPS_ZERO`) fetched onto a
//! target full of 0xFF makes the slot equal the source partition, gaps
//! zeroed; into a slot smaller than it, it is refused before any write.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::net::SocketAddr;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anneal_agent::swarm::{Seeder, SwarmConfig, SwarmError, fetch_to_slot};
use anneal_image::capture::{Options, capture_region};
use anneal_image::format::{ContentIndex, FLAG_GAPS_ZERO};
use anneal_image::torrent::Metainfo;

const PIECE: u32 = 64 << 10;
const PART: u64 = 48 << 20;
const SLOT: u64 = 1 << 20;

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

struct Content {
    _dir: tempfile::TempDir,
    part: PathBuf,
    stream: PathBuf,
    index: ContentIndex,
    torrent: Vec<u8>,
}

/// An ext4 partition holding ~7 MiB of pseudo-random files (three of ten
/// removed), captured.
fn content() -> Content {
    // RUST_LOG=librqbit=debug shows the swarm.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let dir = tempfile::tempdir().unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for f in 0..10 {
        let mut data = Vec::with_capacity(1 << 20);
        while data.len() < (1 << 20) + f * 4097 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            data.extend_from_slice(&x.to_le_bytes());
        }
        std::fs::write(files.join(format!("f{f}")), data).unwrap();
    }
    let part = dir.path().join("part.img");
    std::fs::File::create(&part).unwrap().set_len(PART).unwrap();
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096", "-d"])
        .arg(&files)
        .arg(&part));
    // Files removed from the middle leave free blocks between used ones:
    // the content has several extents and the slot has gaps.
    for f in ["f2", "f5", "f7"] {
        run(Command::new("debugfs")
            .args(["-w", "-R", &format!("rm {f}")])
            .arg(&part));
    }
    captured(dir, part, PART)
}

/// The partition `part` (`len` bytes, in `dir`) captured.
fn captured(dir: tempfile::TempDir, part: PathBuf, len: u64) -> Content {
    let index_path = dir.path().join("c.index");
    let stream = dir.path().join("c.stream");
    let (index, _) = capture_region(
        &std::fs::File::open(&part).unwrap(),
        0,
        len,
        &index_path,
        &stream,
        Options {
            piece_length: PIECE,
        },
    )
    .unwrap();
    assert!(
        index.extents.len() > 1,
        "the partition leaves gaps: {:?}",
        index.extents.len()
    );
    let torrent = Metainfo::from_index(&index, "root", None).to_bytes();
    Content {
        _dir: dir,
        part,
        stream,
        index,
        torrent,
    }
}

/// Size of the raw partition of [`raw_content`].
const RAW_PART: u64 = 8 << 20;

/// A partition no probe of anneal recognises (pseudo-random runs of 12-28
/// KiB at the start of every 64 KiB, zeros between them), captured: a raw
/// content whose gaps must read as zero on the target (`FLAG_GAPS_ZERO`).
fn raw_content() -> Content {
    let dir = tempfile::tempdir().unwrap();
    let mut data = vec![0u8; RAW_PART as usize];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for (k, chunk) in data.chunks_mut(64 << 10).enumerate() {
        for b in &mut chunk[..(12 + 4 * (k % 5)) << 10] {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
    }
    let part = dir.path().join("raw.img");
    std::fs::write(&part, &data).unwrap();
    let c = captured(dir, part, RAW_PART);
    assert_eq!(c.index.header.fs_type, "raw");
    assert_ne!(c.index.header.flags & FLAG_GAPS_ZERO, 0);
    c
}

/// A target of `len` bytes of 0xFF: a disk that held data.
fn filled_target(dir: &Path, name: &str, len: u64) -> PathBuf {
    let t = dir.join(name);
    std::fs::write(&t, vec![0xFFu8; len as usize]).unwrap();
    t
}

fn target(dir: &Path, name: &str) -> PathBuf {
    let t = dir.join(name);
    std::fs::File::create(&t)
        .unwrap()
        .set_len(SLOT + PART)
        .unwrap();
    t
}

fn config(peers: Vec<SocketAddr>, seeders: Vec<SocketAddr>, listen_port: u16) -> SwarmConfig {
    SwarmConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], listen_port)),
        peers,
        seeders,
        trackers: Vec::new(),
        rarest_first: true,
        seeder_stripes: true,
        stall_timeout: Duration::from_secs(60),
        http_fallback: None,
        piece_cache: None,
        peer_limit: None,
        max_uploads: None,
        request_window: None,
    }
}

/// The used blocks of the target's slot are the source partition's.
fn assert_used_blocks_equal(c: &Content, target: &Path) {
    let src = std::fs::File::open(&c.part).unwrap();
    let dst = std::fs::File::open(target).unwrap();
    let mut a = vec![0u8; 1 << 20];
    let mut b = vec![0u8; 1 << 20];
    for e in &c.index.extents {
        let mut off = 0u64;
        while off < e.len {
            let n = (e.len - off).min(a.len() as u64) as usize;
            src.read_exact_at(&mut a[..n], e.offset + off).unwrap();
            dst.read_exact_at(&mut b[..n], SLOT + e.offset + off)
                .unwrap();
            assert!(
                a[..n] == b[..n],
                "{}: used bytes at partition offset {} differ from the source",
                target.display(),
                e.offset + off
            );
            off += n as u64;
        }
    }
}

/// A free loopback port for a leecher that others must know in advance.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A seeder of `c`'s stream on 127.0.0.`host` (any port), sending at most
/// `upload_bps` (none: no cap).
fn seeder(c: &Content, stream: &Path, host: u8, upload_bps: Option<u32>) -> Seeder {
    Seeder::start(
        SocketAddr::from(([127, 0, 0, host], 0)),
        &[(c.torrent.clone(), stream.to_path_buf())],
        &[],
        upload_bps,
    )
    .unwrap()
}

#[test]
fn leechers_write_the_used_blocks_of_a_direct_restore() {
    let c = content();
    let seeder = seeder(&c, &c.stream, 1, None);
    let work = tempfile::tempdir().unwrap();
    let ports = [free_port(), free_port()];
    let addrs: Vec<SocketAddr> = ports
        .iter()
        .map(|p| SocketAddr::from(([127, 0, 0, 1], *p)))
        .collect();
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let t = target(work.path(), &format!("t{i}"));
                let mut peers = vec![seeder.addr(), addrs[1 - i]];
                peers.dedup();
                let mut cfg = config(peers, vec![seeder.addr()], ports[i]);
                // One leecher serves its peer from the target, the other
                // from its piece cache.
                if i == 0 {
                    cfg.piece_cache = Some(0);
                }
                let c = &c;
                s.spawn(move || {
                    (
                        t.clone(),
                        fetch_to_slot(&c.torrent, &c.index, &t, SLOT, PART, &cfg),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (t, r) in results {
        let stats = r.unwrap_or_else(|e| panic!("{}: {e}", t.display())).stats;
        assert_eq!(stats.pieces, c.index.piece_count(), "{stats:?}");
        assert_eq!(stats.bytes_written, c.index.header.used_bytes, "{stats:?}");
        assert!(
            stats.bytes_from_seeders + stats.bytes_from_peers >= c.index.header.used_bytes,
            "{stats:?}"
        );
        assert_used_blocks_equal(&c, &t);
    }
}

/// Upload slots (`max_uploads`, the claim's `spec.transfer.maxUploads`).
/// A leecher that has finished keeps seeding; a second one knows only it.
/// Without slots and with one slot the second gets every byte from the
/// first; with none (`Some(0)`) the first never unchokes it: nothing
/// arrives and the second fails on its stall timeout, naming the stall.
#[test]
fn upload_slots_decide_whether_a_finished_leecher_serves_its_peer() {
    let c = content();
    let seeder = seeder(&c, &c.stream, 1, None);
    let work = tempfile::tempdir().unwrap();
    for (case, slots) in [(0, None), (1, Some(1)), (2, Some(0))] {
        let port = free_port();
        let mut first_cfg = config(vec![seeder.addr()], vec![seeder.addr()], port);
        first_cfg.max_uploads = slots;
        let first_t = target(work.path(), &format!("first{case}"));
        let first = fetch_to_slot(&c.torrent, &c.index, &first_t, SLOT, PART, &first_cfg).unwrap();
        let first_addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut cfg = config(vec![first_addr], Vec::new(), 0);
        let t = target(work.path(), &format!("second{case}"));
        if slots == Some(0) {
            // never unchoked: the stall is the outcome, however long we wait
            cfg.stall_timeout = Duration::from_secs(3);
            let Err(e) = fetch_to_slot(&c.torrent, &c.index, &t, SLOT, PART, &cfg) else {
                panic!("a leecher without slots uploaded");
            };
            assert!(e.to_string().contains("stall"), "{e}");
        } else {
            let st = fetch_to_slot(&c.torrent, &c.index, &t, SLOT, PART, &cfg)
                .unwrap_or_else(|e| panic!("slots {slots:?}: {e}"))
                .stats;
            assert_eq!(st.pieces, c.index.piece_count(), "{st:?}");
            assert!(st.bytes_from_peers >= c.index.header.used_bytes, "{st:?}");
            assert_used_blocks_equal(&c, &t);
        }
        drop(first);
    }
}

#[test]
fn a_peer_serving_corrupt_pieces_changes_nothing_on_the_target() {
    let c = content();
    // The bad peer checks a true copy at start, then serves what the copy
    // holds from then on: every byte flipped.
    let work = tempfile::tempdir().unwrap();
    let bad_stream = work.path().join("bad.stream");
    std::fs::copy(&c.stream, &bad_stream).unwrap();
    // On its own loopback address: the stats tell seeders by address.
    let bad = seeder(&c, &bad_stream, 2, None);
    let flipped: Vec<u8> = std::fs::read(&bad_stream)
        .unwrap()
        .iter()
        .map(|b| !b)
        .collect();
    std::fs::File::options()
        .write(true)
        .open(&bad_stream)
        .unwrap()
        .write_all_at(&flipped, 0)
        .unwrap();
    // The good seeder sends 2 MiB/s: the bad peer is surely asked for
    // pieces before the good one has sent them all.
    let good = seeder(&c, &c.stream, 1, Some(2 << 20));
    let t = target(work.path(), "t");
    // The bad peer first: it is asked before the good one is even known.
    let cfg = config(vec![bad.addr(), good.addr()], vec![good.addr()], 0);
    let stats = fetch_to_slot(&c.torrent, &c.index, &t, SLOT, PART, &cfg)
        .unwrap()
        .stats;
    assert_eq!(stats.pieces, c.index.piece_count(), "{stats:?}");
    assert_eq!(stats.bytes_written, c.index.header.used_bytes, "{stats:?}");
    // The bad peer did send (corrupt) bytes; none of them reached the target.
    assert!(
        stats.bytes_from_peers > 0,
        "the bad peer was never asked: {stats:?}"
    );
    assert_used_blocks_equal(&c, &t);
}

/// The content in a store (`lab/root`), verified, served over HTTP by
/// `anneal-agent serve`'s server on 127.0.0.1; returns the stream URL.
fn content_server(c: &Content, store: &Path) -> String {
    let dir = anneal_agent::store::content_dir(store, "lab", "root");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(c.stream.with_file_name("c.index"), dir.join("index")).unwrap();
    std::fs::copy(&c.stream, dir.join("stream")).unwrap();
    anneal_agent::store::verify(store, "lab", "root", &anneal_agent::jsonl::Out::new()).unwrap();
    let server = anneal_agent::serve::Server::bind(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        anneal_agent::serve::ServeConfig::new(store),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    std::thread::spawn(move || server.run());
    format!("http://{addr}/content/lab/root/stream")
}

#[test]
fn the_seeder_killed_at_30_percent_the_http_fallback_finishes() {
    let c = content();
    let work = tempfile::tempdir().unwrap();
    let url = content_server(&c, &work.path().join("store"));
    // 2 MiB/s: the leecher is still fetching when the seeder dies.
    let seeder = seeder(&c, &c.stream, 1, Some(2 << 20));
    let t = target(work.path(), "t");
    let mut cfg = config(vec![seeder.addr()], vec![seeder.addr()], 0);
    cfg.stall_timeout = Duration::from_secs(2);
    cfg.http_fallback = Some(url);
    let used = c.index.header.used_bytes;
    let stats = std::thread::scope(|s| {
        let fetch = s.spawn(|| fetch_to_slot(&c.torrent, &c.index, &t, SLOT, PART, &cfg));
        // Killed once it has sent 30 % of the stream.
        while seeder.uploaded_bytes() < used * 3 / 10 {
            assert!(
                !fetch.is_finished(),
                "the fetch ended before the seeder was killed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(seeder);
        fetch.join().unwrap().unwrap().stats
    });
    assert_eq!(stats.pieces, c.index.piece_count(), "{stats:?}");
    assert!(
        stats.bytes_from_seeders >= used * 3 / 10 - u64::from(PIECE),
        "{stats:?}"
    );
    assert!(stats.bytes_over_http > 0, "{stats:?}");
    let reason = stats.fallback_reason.clone().unwrap_or_default();
    assert!(reason.contains("stalled"), "{stats:?}");
    assert_used_blocks_equal(&c, &t);
}

#[test]
fn a_swarm_with_no_peer_fails_with_a_reason() {
    let c = content();
    let work = tempfile::tempdir().unwrap();
    let t = target(work.path(), "t");
    // A port nobody listens on.
    let nobody = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut cfg = config(vec![nobody], Vec::new(), 0);
    cfg.stall_timeout = Duration::from_secs(2);
    let err = fetch_to_slot(&c.torrent, &c.index, &t, SLOT, PART, &cfg).unwrap_err();
    assert!(matches!(err, SwarmError::Stalled { have: 0, .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("stalled") && msg.contains(&format!("0 of {}", c.index.piece_count())),
        "{msg}"
    );
    // Nothing was written: the slot is still all zeroes.
    let data = std::fs::read(&t).unwrap();
    assert!(data.iter().all(|b| *b == 0), "the target was written");
}

#[test]
fn a_torrent_of_another_content_is_refused_before_anything_is_written() {
    let c = content();
    let work = tempfile::tempdir().unwrap();
    let t = target(work.path(), "t");
    // The same content's torrent with one piece hash changed: librqbit would
    // accept pieces that are not the index's.
    let mut other = Metainfo::parse(&c.torrent).unwrap();
    other.pieces[1][0] ^= 1;
    let seeder = seeder(&c, &c.stream, 1, None);
    let cfg = config(vec![seeder.addr()], vec![seeder.addr()], 0);
    let err = fetch_to_slot(&other.to_bytes(), &c.index, &t, SLOT, PART, &cfg).unwrap_err();
    assert!(matches!(err, SwarmError::Torrent(_)), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("does not match the content's index"), "{msg}");
    let data = std::fs::read(&t).unwrap();
    assert!(data.iter().all(|b| *b == 0), "the target was written");
}

/// The stream's SHA-256 is checked over the pieces written, in order: an
/// index whose piece hashes match the content but whose stream SHA-256 does
/// not fails the fetch after the last piece, naming both hashes.
#[test]
fn a_stream_that_does_not_hash_to_the_index_fails_the_fetch() {
    let c = content();
    let seeder = seeder(&c, &c.stream, 1, None);
    let work = tempfile::tempdir().unwrap();
    let mut index = c.index.clone();
    index.header.stream_sha256[0] ^= 0xff;
    for cache in [None, Some(0)] {
        let t = target(work.path(), "t");
        let mut cfg = config(vec![seeder.addr()], vec![seeder.addr()], free_port());
        cfg.piece_cache = cache;
        let err = fetch_to_slot(&c.torrent, &index, &t, SLOT, PART, &cfg)
            .err()
            .unwrap_or_else(|| panic!("piece cache {cache:?}: the fetch succeeded"));
        match &err {
            SwarmError::StreamHash { want, got } => {
                assert_eq!(want, &hex::encode(index.header.stream_sha256));
                assert_eq!(got, &hex::encode(c.index.header.stream_sha256));
            }
            other => panic!("piece cache {cache:?}: {other}"),
        }
    }
}

/// A raw content (`FLAG_GAPS_ZERO`) fetched from the swarm onto a target
/// full of 0xFF (a disk that held data): the slot equals the source
/// partition byte for byte, the gaps between the extents zeroed, and
/// nothing outside the slot changes.
#[test]
fn a_raw_content_from_the_swarm_zeroes_the_gaps_of_its_slot() {
    let c = raw_content();
    let seeder = seeder(&c, &c.stream, 1, None);
    let work = tempfile::tempdir().unwrap();
    let t = filled_target(work.path(), "t", SLOT + RAW_PART + SLOT);
    let cfg = config(vec![seeder.addr()], vec![seeder.addr()], 0);
    let stats = fetch_to_slot(&c.torrent, &c.index, &t, SLOT, RAW_PART, &cfg)
        .unwrap()
        .stats;
    assert_eq!(stats.pieces, c.index.piece_count(), "{stats:?}");
    let got = std::fs::read(&t).unwrap();
    let part = std::fs::read(&c.part).unwrap();
    let (a, b) = (SLOT as usize, (SLOT + RAW_PART) as usize);
    assert!(got[..a].iter().all(|x| *x == 0xFF), "before the slot");
    assert!(
        got[a..b] == part[..],
        "the slot differs from the source partition (first at partition offset {:?})",
        got[a..b].iter().zip(&part).position(|(x, y)| x != y)
    );
    assert!(got[b..].iter().all(|x| *x == 0xFF), "after the slot");
}

/// A content larger than its slot is refused before anything is written:
/// the target stays all 0xFF.
#[test]
fn a_content_larger_than_its_slot_is_refused_before_the_swarm_writes() {
    let c = raw_content();
    let seeder = seeder(&c, &c.stream, 1, None);
    let work = tempfile::tempdir().unwrap();
    let t = filled_target(work.path(), "t", SLOT + RAW_PART + SLOT);
    let cfg = config(vec![seeder.addr()], vec![seeder.addr()], 0);
    let err = fetch_to_slot(&c.torrent, &c.index, &t, SLOT, RAW_PART - 4096, &cfg).unwrap_err();
    assert!(err.to_string().contains("larger than its slot"), "{err}");
    let got = std::fs::read(&t).unwrap();
    assert!(got.iter().all(|x| *x == 0xFF), "the target was written");
}
