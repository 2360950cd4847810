//! The content server (`anneal_agent::serve`) on loopback: whole files and
//! byte ranges checked with curl (a real client) and with raw requests for
//! the refusals, keep-alive, the connection bound and an idle connection.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anneal_agent::serve::{ServeConfig, ServeStats, Server, Stopper};

fn content(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 31 + i / 4093) as u8).collect()
}

struct Running {
    addr: SocketAddr,
    stats: std::sync::Arc<ServeStats>,
    stopper: Stopper,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stopper.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn start(files: &[(&str, &[u8])], tune: impl FnOnce(&mut ServeConfig)) -> Running {
    let dir = tempfile::tempdir().unwrap();
    for (rel, data) in files {
        let p = dir.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, data).unwrap();
        // published and verified (`anneal-agent store verify` writes this)
        std::fs::write(p.parent().unwrap().join("verified"), b"x\n").unwrap();
    }
    let mut cfg = ServeConfig::new(dir.path());
    tune(&mut cfg);
    let server = Server::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let addr = server.local_addr().unwrap();
    let stats = server.stats();
    let stopper = server.stopper().unwrap();
    let thread = std::thread::spawn(move || server.run());
    Running {
        addr,
        stats,
        stopper,
        thread: Some(thread),
        _dir: dir,
    }
}

fn curl(args: &[&str], out: &Path) -> String {
    let o = Command::new("curl")
        .args(["-sS", "--max-time", "60", "-o"])
        .arg(out)
        .args(["-w", "%{http_code}"])
        .args(args)
        .output()
        .expect("curl runs");
    assert!(
        o.status.success(),
        "curl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// One raw request; returns (status line, headers lower-cased, body).
fn raw(addr: SocketAddr, req: &[u8]) -> (String, Vec<(String, String)>, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(req).unwrap();
    let mut r = BufReader::new(s);
    read_response(&mut r, req.starts_with(b"HEAD"))
}

fn read_response(
    r: &mut BufReader<TcpStream>,
    head_only: bool,
) -> (String, Vec<(String, String)>, Vec<u8>) {
    let mut status = String::new();
    r.read_line(&mut status).unwrap();
    let mut headers = Vec::new();
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        let l = l.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').unwrap();
        headers.push((k.to_ascii_lowercase(), v.trim().to_string()));
    }
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .map(|(_, v)| v.parse().unwrap())
        .unwrap_or(0);
    let mut body = vec![0u8; if head_only { 0 } else { len }];
    r.read_exact(&mut body).unwrap();
    (status.trim_end().to_string(), headers, body)
}

fn header<'a>(h: &'a [(String, String)], k: &str) -> Option<&'a str> {
    h.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
}

#[test]
fn whole_files_and_ranges_match_curl() {
    let stream = content(3 * 1024 * 1024 + 17);
    let index = content(4096);
    let srv = start(
        &[("lab/img-p1/stream", &stream), ("lab/img-p1/index", &index)],
        |_| {},
    );
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let base = format!("http://{}/content/lab/img-p1", srv.addr);

    assert_eq!(curl(&[&format!("{base}/stream")], &out), "200");
    assert_eq!(std::fs::read(&out).unwrap(), stream);
    assert_eq!(curl(&[&format!("{base}/index")], &out), "200");
    assert_eq!(std::fs::read(&out).unwrap(), index);

    for (r, a, b) in [
        ("0-0", 0, 0),
        ("1000-1048575", 1000, 1_048_575),
        ("3145000-", 3_145_000, stream.len() - 1),
        ("-17", stream.len() - 17, stream.len() - 1),
        ("3000000-99999999", 3_000_000, stream.len() - 1),
    ] {
        assert_eq!(
            curl(&["-r", r, &format!("{base}/stream")], &out),
            "206",
            "{r}"
        );
        assert_eq!(std::fs::read(&out).unwrap(), &stream[a..=b], "{r}");
    }
    // past the end: 416 with the size
    let (st, h, _) = raw(
        srv.addr,
        b"GET /content/lab/img-p1/index HTTP/1.1\r\nHost: x\r\nRange: bytes=4096-\r\n\r\n",
    );
    assert!(st.starts_with("HTTP/1.1 416"), "{st}");
    assert_eq!(header(&h, "content-range"), Some("bytes */4096"));
    // HEAD: headers only
    let (st, h, body) = raw(
        srv.addr,
        b"HEAD /content/lab/img-p1/index HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    assert!(st.starts_with("HTTP/1.1 200"), "{st}");
    assert_eq!(header(&h, "content-length"), Some("4096"));
    assert_eq!(header(&h, "accept-ranges"), Some("bytes"));
    assert!(body.is_empty());
    assert!(srv.stats.partial.load(Ordering::Relaxed) >= 5);
}

#[test]
fn refusals_name_the_problem_and_touch_nothing() {
    let srv = start(&[("lab/img-p1/stream", b"data")], |_| {});
    for (req, code) in [
        (
            &b"GET /content/lab/../../etc/passwd HTTP/1.1\r\n\r\n"[..],
            "400",
        ),
        (b"GET /content/lab/nothere/stream HTTP/1.1\r\n\r\n", "404"),
        (
            b"GET /content/lab/img-p1/layout.json HTTP/1.1\r\n\r\n",
            "404",
        ),
        (b"GET /etc/passwd HTTP/1.1\r\n\r\n", "404"),
        (b"DELETE /content/lab/img-p1/stream HTTP/1.1\r\n\r\n", "405"),
        (b"\x16\x03\x01 not http\r\n\r\n", "400"),
    ] {
        let (st, _, body) = raw(srv.addr, req);
        assert!(
            st.starts_with(&format!("HTTP/1.1 {code}")),
            "{st} for {:?}",
            String::from_utf8_lossy(req)
        );
        assert!(!body.is_empty(), "a reason is given");
    }
    // an endless head is cut at 8 KiB
    let mut s = TcpStream::connect(srv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut big = b"GET /content/lab/img-p1/stream HTTP/1.1\r\nX-Pad: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 16 * 1024));
    let _ = s.write_all(&big);
    let mut r = BufReader::new(s);
    let (st, _, _) = read_response(&mut r, false);
    assert!(st.starts_with("HTTP/1.1 431"), "{st}");
    assert_eq!(srv.stats.served.load(Ordering::Relaxed), 0);
}

#[test]
fn keep_alive_serves_several_requests_on_one_connection() {
    let data = content(10_000);
    let srv = start(&[("lab/c/stream", &data)], |_| {});
    let s = TcpStream::connect(srv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    for (a, b) in [(0usize, 99usize), (5000, 9999), (100, 100)] {
        let req = format!(
            "GET /content/lab/c/stream HTTP/1.1\r\nHost: x\r\nRange: bytes={a}-{b}\r\n\r\n"
        );
        w.write_all(req.as_bytes()).unwrap();
        let (st, _, body) = read_response(&mut r, false);
        assert!(st.starts_with("HTTP/1.1 206"), "{st}");
        assert_eq!(body, &data[a..=b]);
    }
    // Connection: close ends it after the answer
    w.write_all(b"GET /content/lab/c/stream HTTP/1.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    let (st, h, body) = read_response(&mut r, false);
    assert!(st.starts_with("HTTP/1.1 200"), "{st}");
    assert_eq!(header(&h, "connection"), Some("close"));
    assert_eq!(body, data);
    let mut rest = Vec::new();
    assert_eq!(
        r.read_to_end(&mut rest).unwrap(),
        0,
        "closed after the answer"
    );
}

#[test]
fn connections_are_bounded_and_idle_ones_closed() {
    let srv = start(&[("lab/c/stream", b"abc")], |c| {
        c.max_connections = 2;
        c.idle_timeout = Duration::from_secs(2);
    });
    // two idle connections hold both places (each proven open by a request)
    let mut held = Vec::new();
    for _ in 0..2 {
        let s = TcpStream::connect(srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut w = s.try_clone().unwrap();
        let mut r = BufReader::new(s);
        w.write_all(b"GET /content/lab/c/stream HTTP/1.1\r\n\r\n")
            .unwrap();
        let (st, _, _) = read_response(&mut r, false);
        assert!(st.starts_with("HTTP/1.1 200"), "{st}");
        held.push(r);
    }
    let (st, h, _) = raw(srv.addr, b"GET /content/lab/c/stream HTTP/1.1\r\n\r\n");
    assert!(st.starts_with("HTTP/1.1 503"), "{st}");
    assert_eq!(header(&h, "retry-after"), Some("1"));
    assert_eq!(srv.stats.busy.load(Ordering::Relaxed), 1);
    // the server closes the idle ones (EOF on both), which frees the places
    for mut r in held {
        let mut rest = Vec::new();
        assert_eq!(r.read_to_end(&mut rest).unwrap(), 0);
    }
    // a place is free once the server's connection threads have ended:
    // retried until it is (the bound, not the clock, is what is tested)
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (st, _, body) = raw(
            srv.addr,
            b"GET /content/lab/c/stream HTTP/1.1\r\nConnection: close\r\n\r\n",
        );
        if st.starts_with("HTTP/1.1 200") {
            assert_eq!(body, b"abc");
            break;
        }
        assert!(st.starts_with("HTTP/1.1 503"), "{st}");
        assert!(std::time::Instant::now() < deadline, "places never freed");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn unverified_contents_are_not_served() {
    let srv = start(&[("lab/good-p1/stream", b"verified data")], |_| {});
    // published (index and stream in place) but not verified yet
    let dir = srv._dir.path().join("lab/fresh-p1");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("stream"), b"not yet").unwrap();
    std::fs::write(dir.join("index"), b"idx").unwrap();
    for f in ["stream", "index", "torrent"] {
        let req = format!("GET /content/lab/fresh-p1/{f} HTTP/1.1\r\n\r\n");
        let (st, _, body) = raw(srv.addr, req.as_bytes());
        assert!(st.starts_with("HTTP/1.1 404"), "{st}");
        assert!(
            String::from_utf8_lossy(&body).contains("not verified"),
            "{}",
            String::from_utf8_lossy(&body)
        );
    }
    let (st, _, body) = raw(
        srv.addr,
        b"GET /content/lab/good-p1/stream HTTP/1.1\r\n\r\n",
    );
    assert!(st.starts_with("HTTP/1.1 200"), "{st}");
    assert_eq!(body, b"verified data");
    // the marker appears: now served
    std::fs::write(dir.join("verified"), b"x\n").unwrap();
    let (st, _, body) = raw(
        srv.addr,
        b"GET /content/lab/fresh-p1/stream HTTP/1.1\r\n\r\n",
    );
    assert!(st.starts_with("HTTP/1.1 200"), "{st}");
    assert_eq!(body, b"not yet");
}

#[test]
fn torrents_are_made_from_the_index() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/imaging");
    let index = std::fs::read(fixture.join("content-v1.index")).unwrap();
    let stream = std::fs::read(fixture.join("content-v1.stream")).unwrap();
    let files: &[(&str, &[u8])] = &[
        ("lab/content-v1/index", &index),
        ("lab/content-v1/stream", &stream),
        ("lab/broken/index", b"not an index"),
        ("lab/broken/stream", b"x"),
    ];
    let announce = "http://10.0.0.1:6969/announce";
    let with = start(files, |c| c.tracker = Some(announce.into()));
    let (status, h, body) = raw(
        with.addr,
        b"GET /content/lab/content-v1/torrent HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(header(&h, "content-type"), Some("application/x-bittorrent"));
    let m = anneal_image::torrent::Metainfo::parse(&body).unwrap();
    assert_eq!(m.announce.as_deref(), Some(announce));
    assert_eq!(m.name, "content-v1.stream");
    assert_eq!((m.length, m.piece_length), (stream.len() as u64, 16384));
    // the golden info hash of the fixture (anneal_image::torrent's tests)
    assert_eq!(
        m.info_hash_hex(),
        "34d564fc4b7ac05027d799e35bfc33e4c71c0e06"
    );
    let (status, h, body) = raw(
        with.addr,
        b"HEAD /content/lab/content-v1/torrent HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(body.is_empty());
    assert_eq!(
        header(&h, "content-length").map(str::to_string),
        Some(m.to_bytes().len().to_string())
    );
    // an index that does not parse: 500 naming the fix
    let (status, _, body) = raw(
        with.addr,
        b"GET /content/lab/broken/torrent HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, "HTTP/1.1 500 Internal Server Error");
    assert!(String::from_utf8_lossy(&body).contains("verify the content again"));
    // without a tracker: no announce, the same info hash
    let without = start(files, |_| {});
    let (status, _, body) = raw(
        without.addr,
        b"GET /content/lab/content-v1/torrent HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(body.starts_with(b"d4:info"));
    let bare = anneal_image::torrent::Metainfo::parse(&body).unwrap();
    assert_eq!(bare.announce, None);
    assert_eq!(bare.info_hash(), m.info_hash());
}
