//! Torrents for contents and the Site tracker against a real BitTorrent
//! client, on loopback: a content captured and verified in a content store
//! (`anneal-agent capture`, `store verify`: its result names the info hash),
//! its torrent fetched from `anneal-agent serve --tracker` (the info hash
//! cross-checked with `aria2c --show-files`), `anneal-agent tracker` with an
//! allow-list holding that hash; one aria2c seeds the stream, a second one
//! downloads it through our tracker only (DHT, local discovery and peer
//! exchange off) and its file is byte-identical to the stream; the tracker's
//! `/stats` saw both peers. The running tracker also refuses hostile
//! requests with a bencoded `failure reason`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anneal_image::format::ContentIndex;
use anneal_image::torrent::{Metainfo, Value, decode};
use anneal_testinfra::{ChildGroup, free_port};
use anneal_tests::artifacts;
use anneal_tests::images::noise;
use anneal_tests::wait::{eventually_blocking, file_contains};

const NS: &str = "swarm";
const CONTENT: &str = "disk-p1";
const WAIT: Duration = Duration::from_secs(180);

/// One request, `Connection: close`; (status, body).
fn get(addr: SocketAddr, target: &str) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    // a refusal may reset the connection after the answer: keep what came
    let _ = s.read_to_end(&mut raw);
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head from {addr}{target}: {raw:?}"));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (code, raw[end + 4..].to_vec())
}

/// The `addr=` of the line containing `ready` in a log.
fn logged_addr(log: &Path, ready: &str) -> SocketAddr {
    let text = file_contains(log, ready, WAIT);
    let line = text.lines().find(|l| l.contains(ready)).unwrap();
    let addr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("addr="))
        .unwrap_or_else(|| panic!("no addr= in {line:?}"));
    addr.parse().unwrap()
}

fn failure(body: &[u8]) -> String {
    let v = decode(body)
        .unwrap_or_else(|e| panic!("not bencoding ({e}): {:?}", String::from_utf8_lossy(body)));
    String::from_utf8(
        v.get("failure reason")
            .and_then(Value::as_bytes)
            .unwrap_or_else(|| panic!("no failure reason in {v:?}"))
            .to_vec(),
    )
    .unwrap()
}

fn pct(b: &[u8]) -> String {
    b.iter().map(|c| format!("%{c:02x}")).collect()
}

/// The tracker's numbers for one torrent, if it tracks it.
fn swarm_stats(tracker: SocketAddr, info_hash: &str) -> Option<serde_json::Value> {
    let (code, body) = get(tracker, "/stats");
    assert_eq!(code, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    v["torrents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["infoHash"] == info_hash)
        .cloned()
}

fn aria2c(dir: &Path, port: u16, log: &Path, torrent: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new("aria2c");
    c.arg("--no-conf=true")
        .arg(format!("--dir={}", dir.display()))
        .arg(format!("--listen-port={port}"))
        .arg(format!("--log={}", log.display()))
        .args([
            "--log-level=info",
            "--console-log-level=notice",
            "--summary-interval=0",
            "--enable-dht=false",
            "--enable-dht6=false",
            "--bt-enable-lpd=false",
            "--enable-peer-exchange=false",
            "--disable-ipv6=true",
            "--file-allocation=none",
            "--check-integrity=true",
        ])
        .args(extra)
        .arg(torrent);
    c
}

#[test]
fn aria2c_swarm_through_our_tracker() {
    let agent = artifacts::agent_host();
    let work = tempfile::tempdir().unwrap();
    let w = work.path();

    // a content: a 6 MiB partition of noise in 256 KiB pieces (24 pieces)
    let part = w.join("part.img");
    std::fs::write(&part, noise(14, 6 << 20)).unwrap();
    let cap = w.join("cap");
    let out = Command::new(&agent)
        .arg("capture")
        .arg(&part)
        .args(["--format", "partition", "--piece-length", "262144", "--out"])
        .arg(&cap)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "capture: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stream = std::fs::read(cap.join("p1.stream")).unwrap();
    let index = ContentIndex::parse(&std::fs::read(cap.join("p1.index")).unwrap()).unwrap();
    assert_eq!(index.piece_count(), 24);

    // into a content store, verified: the result names the info hash
    let store = w.join("store");
    let cdir = store.join(NS).join(CONTENT);
    std::fs::create_dir_all(&cdir).unwrap();
    std::fs::copy(cap.join("p1.stream"), cdir.join("stream")).unwrap();
    std::fs::copy(cap.join("p1.index"), cdir.join("index")).unwrap();
    let out = Command::new(&agent)
        .args(["store", "verify", "--store"])
        .arg(&store)
        .args(["--namespace", NS, "--content", CONTENT])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "store verify: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let result: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let info_hash = result["infoHash"]
        .as_str()
        .unwrap_or_else(|| panic!("no infoHash in {result}"))
        .to_string();
    assert_eq!(
        info_hash,
        Metainfo::from_index(&index, CONTENT, None).info_hash_hex()
    );

    // the tracker, tracking that content only
    let allow = w.join("allow");
    std::fs::write(&allow, format!("# published contents\n{info_hash}\n")).unwrap();
    let tracker_log = w.join("tracker.log");
    let _tracker = ChildGroup::spawn_logged(
        "tracker",
        Command::new(&agent)
            .args([
                "tracker",
                "--listen",
                "127.0.0.1:0",
                "--interval",
                "30",
                "--allow-file",
            ])
            .arg(&allow)
            .env("RUST_LOG", "info"),
        &tracker_log,
    )
    .unwrap();
    let tracker = logged_addr(&tracker_log, "tracker listening");
    let announce = format!("http://{tracker}/announce");

    // the content server hands out the torrent, announce included
    let serve_log = w.join("serve.log");
    let _serve = ChildGroup::spawn_logged(
        "serve",
        Command::new(&agent)
            .arg("serve")
            .arg("--content-dir")
            .arg(&store)
            .args(["--listen", "127.0.0.1:0", "--tracker", &announce])
            .env("RUST_LOG", "info"),
        &serve_log,
    )
    .unwrap();
    let server = logged_addr(&serve_log, "serving the content store");
    let (code, body) = get(server, &format!("/content/{NS}/{CONTENT}/torrent"));
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let meta = Metainfo::parse(&body).unwrap();
    assert_eq!(meta.announce.as_deref(), Some(announce.as_str()));
    assert_eq!(meta.name, format!("{CONTENT}.stream"));
    assert_eq!(meta.length, stream.len() as u64);
    assert_eq!(meta.info_hash_hex(), info_hash);
    let torrent = w.join("content.torrent");
    std::fs::write(&torrent, &body).unwrap();
    let (code, _) = get(server, &format!("/content/{NS}/absent/torrent"));
    assert_eq!(code, 404);

    // an independent reading of our torrent
    let shown = Command::new("aria2c")
        .arg("--show-files=true")
        .arg(&torrent)
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
    assert!(
        shown
            .to_ascii_lowercase()
            .contains(&format!("info hash: {info_hash}")),
        "aria2c --show-files: {shown}"
    );
    assert!(shown.contains(&announce), "{shown}");

    // hostile and refused announces get a bencoded failure reason
    let peer = pct(b"-XX0001-hostile00000");
    let good_hash = pct(&hex::decode(&info_hash).unwrap());
    let q = |hash: &str| {
        format!(
            "/announce?info_hash={hash}&peer_id={peer}&port=1&uploaded=0&downloaded=0&left=1&compact=1"
        )
    };
    let (code, body) = get(tracker, &q(&good_hash[..good_hash.len() - 3]));
    assert_eq!(code, 200);
    assert!(failure(&body).contains("info_hash"), "{}", failure(&body));
    let (code, body) = get(tracker, &q(&pct(&[7; 20])));
    assert_eq!(code, 200);
    assert!(
        failure(&body).contains("not tracked here"),
        "{}",
        failure(&body)
    );
    let huge = format!("{}&pad={}", q(&good_hash), "a".repeat(9000));
    let (code, body) = get(tracker, &huge);
    assert_eq!(code, 431);
    assert!(failure(&body).contains("too large"), "{}", failure(&body));

    // the seeder: aria2c over a copy of the stream, checked, then seeding
    let seed_dir = w.join("seed");
    std::fs::create_dir_all(&seed_dir).unwrap();
    std::fs::write(seed_dir.join(&meta.name), &stream).unwrap();
    let seed_log = w.join("seed.log");
    let _seeder = ChildGroup::spawn_logged(
        "aria2c seeder",
        &mut aria2c(
            &seed_dir,
            free_port().unwrap(),
            &seed_log,
            &torrent,
            &["--seed-ratio=0.0", "--bt-seed-unverified=false"],
        ),
        &w.join("seed.out"),
    )
    .unwrap();
    eventually_blocking("the seeder announced to our tracker", WAIT, || {
        swarm_stats(tracker, &info_hash).filter(|s| s["seeders"] == 1)
    });

    // the leecher: through our tracker only, done once it has every piece
    let leech_dir = w.join("leech");
    std::fs::create_dir_all(&leech_dir).unwrap();
    let mut leecher = ChildGroup::spawn_logged(
        "aria2c leecher",
        &mut aria2c(
            &leech_dir,
            free_port().unwrap(),
            &w.join("leech.log"),
            &torrent,
            &["--seed-time=0"],
        ),
        &w.join("leech.out"),
    )
    .unwrap();
    let status = eventually_blocking("the leecher to finish", WAIT, || leecher.try_exit());
    let leech_out = std::fs::read_to_string(w.join("leech.out")).unwrap_or_default();
    assert!(status.success(), "aria2c leecher {status}: {leech_out}");
    let got = std::fs::read(leech_dir.join(&meta.name)).unwrap();
    assert!(
        got == stream,
        "downloaded {} bytes differ from the {}-byte stream",
        got.len(),
        stream.len()
    );

    // the tracker saw both peers start; the leecher's `stopped` (aria2c
    // with --seed-time=0 stops once complete) removed it, the seeder stays
    let s = eventually_blocking("the leecher's stopped announce", WAIT, || {
        swarm_stats(tracker, &info_hash)
            .filter(|s| s["stopped"] == 1)
            .ok_or("not yet")
    });
    assert_eq!(s["started"], 2, "{s}");
    assert_eq!(
        (&s["seeders"], &s["leechers"]),
        (&1.into(), &0.into()),
        "{s}"
    );
    eprintln!("tracker after the download: {s}");
}
