//! The tracker (`anneal_agent::tracker`) over HTTP on loopback: announces
//! answered with compact and non-compact peers, `/stats`, and the bounds
//! (the connection cap answers 503, a request head that does not arrive in
//! time closes the connection, refusals are bencoded).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anneal_agent::tracker::{Stopper, Tracker, TrackerConfig};
use anneal_image::torrent::{Value, decode};

struct Running {
    addr: SocketAddr,
    stopper: Stopper,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stopper.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn start(tune: impl FnOnce(&mut TrackerConfig)) -> Running {
    let mut cfg = TrackerConfig {
        interval: Duration::from_secs(30),
        ..Default::default()
    };
    tune(&mut cfg);
    let t = Tracker::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let addr = t.local_addr().unwrap();
    let stopper = t.stopper().unwrap();
    let thread = std::thread::spawn(move || t.run());
    Running {
        addr,
        stopper,
        thread: Some(thread),
    }
}

/// One request; (status code, body).
fn get(addr: SocketAddr, target: &str) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET {target} HTTP/1.1\r\nHost: t\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let code = String::from_utf8_lossy(&raw[9..12]).parse().unwrap();
    (code, raw[end + 4..].to_vec())
}

fn pct(b: &[u8]) -> String {
    b.iter().map(|c| format!("%{c:02X}")).collect()
}

fn announce(hash: &[u8; 20], peer: u8, port: u16, left: u64, compact: bool) -> String {
    format!(
        "/announce?info_hash={}&peer_id={}&port={port}&uploaded=0&downloaded=0&left={left}&event=started&compact={}",
        pct(hash),
        pct(&[peer; 20]),
        u8::from(compact)
    )
}

#[test]
fn announces_hand_out_peers() {
    let t = start(|_| {});
    let hash = [0xab; 20];
    let (code, body) = get(t.addr, &announce(&hash, 1, 7001, 0, true));
    assert_eq!(code, 200);
    let v = decode(&body).unwrap();
    assert_eq!(v.get("peers").and_then(Value::as_bytes), Some(&b""[..]));
    assert_eq!(v.get("interval").and_then(Value::as_int), Some(30));
    // the leecher gets the seeder: 127.0.0.1, port 7001 big-endian
    let (_, body) = get(t.addr, &announce(&hash, 2, 7002, 5, true));
    let v = decode(&body).unwrap();
    assert_eq!(
        v.get("peers").and_then(Value::as_bytes),
        Some(&[127, 0, 0, 1, 0x1b, 0x59][..])
    );
    assert_eq!(v.get("complete").and_then(Value::as_int), Some(1));
    assert_eq!(v.get("incomplete").and_then(Value::as_int), Some(1));
    // non-compact: a list of dictionaries
    let (_, body) = get(t.addr, &announce(&hash, 3, 7003, 5, false));
    let v = decode(&body).unwrap();
    let Some(Value::List(peers)) = v.get("peers") else {
        panic!("{v:?}")
    };
    assert_eq!(peers.len(), 2);
    let mut ports: Vec<i64> = peers
        .iter()
        .map(|p| p.get("port").and_then(Value::as_int).unwrap())
        .collect();
    ports.sort_unstable();
    assert_eq!(ports, [7001, 7002]);
    let (code, body) = get(t.addr, "/stats");
    assert_eq!(code, 200);
    let s: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(s["announces"], 3);
    let tor = &s["torrents"][0];
    assert_eq!(tor["infoHash"], hex::encode(hash));
    assert_eq!((&tor["seeders"], &tor["leechers"]), (&1.into(), &2.into()));
    // refusals: bencoded failure reasons
    let (code, body) = get(t.addr, "/announce?info_hash=%AB&peer_id=x");
    assert_eq!(code, 200);
    let v = decode(&body).unwrap();
    assert!(
        v.get("failure reason")
            .and_then(Value::as_bytes)
            .is_some_and(|m| m.starts_with(b"invalid parameter info_hash")),
        "{v:?}"
    );
    let (code, body) = get(t.addr, "/scrape");
    assert_eq!(code, 404);
    assert!(decode(&body).unwrap().get("failure reason").is_some());
}

#[test]
fn connections_are_bounded_and_slow_heads_closed() {
    // one connection at most: a second one gets 503 while the first holds
    // the slot (an unfinished request head, a long head deadline)
    let t = start(|c| {
        c.max_connections = 1;
        c.header_timeout = Duration::from_secs(60);
    });
    let mut first = TcpStream::connect(t.addr).unwrap();
    first.write_all(b"GET /stats HTTP/1.1\r\n").unwrap();
    // the first is accepted before the second (one accept loop, in order)
    let (code, body) = get(t.addr, "/stats");
    assert_eq!(code, 503);
    assert!(decode(&body).unwrap().get("failure reason").is_some());
    drop(first);

    // a head that does not arrive within the deadline: the connection ends
    let t = start(|c| c.header_timeout = Duration::from_millis(300));
    let mut slow = TcpStream::connect(t.addr).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    slow.write_all(b"GET /stats HTTP/1.1\r\n").unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 64];
    match slow.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the slow connection was not closed: {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(30));
}
