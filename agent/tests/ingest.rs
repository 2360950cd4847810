//! `anneal-agent ingest` and `anneal-agent store verify|remove` as real
//! processes against sources served on loopback (plain HTTP, chunked HTTP,
//! HTTPS with a test CA), compared with `anneal-agent capture` of the same
//! files; and the content server on the published store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use anneal_image::ContentIndex;
use rcgen::{CertificateParams, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::Value;
use sha2::Digest as _;

const PIECE: &str = "1048576";

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sh(script: &str) -> String {
    run(Command::new("bash").args(["-euo", "pipefail", "-c", script]))
}

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_anneal-agent"))
}

fn tmpdir() -> tempfile::TempDir {
    let base = Path::new("/var/tmp/anneal-test");
    std::fs::create_dir_all(base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(b))
}

fn file_sha(p: &Path) -> String {
    sha256_hex(&std::fs::read(p).unwrap())
}

/// A finished `anneal-agent` run: exit code and every stdout line as JSON
/// (a line that is not JSON fails the test: stdout is a protocol).
struct Outcome {
    code: i32,
    lines: Vec<Value>,
    stderr: String,
}

impl Outcome {
    fn last(&self) -> &Value {
        self.lines
            .last()
            .unwrap_or_else(|| panic!("no output; stderr: {}", self.stderr))
    }
    fn progress(&self) -> Vec<&Value> {
        self.lines
            .iter()
            .filter(|l| l["event"] == "progress")
            .collect()
    }
    fn ok(&self) -> &Value {
        assert_eq!(
            self.code, 0,
            "stdout: {:?}\nstderr: {}",
            self.lines, self.stderr
        );
        let l = self.last();
        assert_eq!(l["event"], "result", "{l}");
        l
    }
    fn err(&self, reason: &str) -> String {
        assert_eq!(
            self.code, 1,
            "stdout: {:?}\nstderr: {}",
            self.lines, self.stderr
        );
        let l = self.last();
        assert_eq!(l["event"], "error", "{l}");
        assert_eq!(l["reason"], reason, "{l}");
        let m = l["message"].as_str().unwrap().to_owned();
        assert!(!m.contains('\n'));
        m
    }
}

fn exec(cmd: &mut Command) -> Outcome {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
        .collect();
    Outcome {
        code: out.status.code().unwrap_or(-1),
        lines,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn ingest(url: &str, store: &Path, import: &str, prefix: &str, extra: &[&str]) -> Outcome {
    exec(
        agent()
            .args(["ingest", "--url", url, "--store"])
            .arg(store)
            .args(["--namespace", "lab", "--import", import, "--prefix", prefix])
            .args(["--piece-length", PIECE, "--timeout-secs", "10"])
            .args(extra),
    )
}

fn store_cmd(op: &str, store: &Path, content: &str) -> Outcome {
    exec(agent().args(["store", op, "--store"]).arg(store).args([
        "--namespace",
        "lab",
        "--content",
        content,
    ]))
}

// ------------------------------------------------------------ fixtures

/// A 64 MiB GPT disk: 1 ESP vfat (16 MiB), 2 swap (8 MiB), 3 ext4 with
/// files (24 MiB), 4 unformatted (4 MiB).
fn build_disk(d: &Path) -> PathBuf {
    let disk = d.join("disk.raw");
    let tree = d.join("tree");
    std::fs::create_dir_all(tree.join("etc")).unwrap();
    std::fs::write(tree.join("etc/motd"), b"ingested over http\n").unwrap();
    let noise: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(tree.join("blob"), noise).unwrap();
    sh(&format!(
        "cd {d} && truncate -s 64M disk.raw && \
         sgdisk -o -n 1:2048:+16M -t 1:ef00 -n 2:0:+8M -t 2:8200 -n 3:0:+24M -n 4:0:+4M disk.raw >/dev/null && \
         mkfs.vfat --offset 2048 -n INGESP disk.raw 16384 >/dev/null && \
         truncate -s 8M swap.img && mkswap -L swp swap.img >/dev/null && \
         dd if=swap.img of=disk.raw bs=512 seek=34816 conv=notrunc status=none && rm swap.img && \
         mke2fs -q -F -t ext4 -L ingroot -E offset=$((51200*512)) -d tree disk.raw 24M",
        d = d.display()
    ));
    disk
}

/// `anneal-agent capture` of `src` into `out` (the reference).
fn capture(src: &Path, out: &Path, extra: &[&str]) -> String {
    run(agent()
        .arg("capture")
        .arg(src)
        .arg("--out")
        .arg(out)
        .args(["--piece-length", PIECE])
        .args(extra))
}

/// Checks an ingest result against the capture directory `cap` (contents
/// `p<N>.index/.stream`, `layout.json` when there is one) and the store.
fn assert_matches_capture(res: &Value, cap: &Path, store: &Path, import: &str, prefix: &str) {
    let contents = res["contents"].as_array().unwrap();
    assert!(!contents.is_empty());
    for c in contents {
        let n = c["partitionNumber"].as_u64().unwrap();
        let name = format!("{prefix}-p{n}");
        assert_eq!(c["name"], name.as_str());
        let ref_index = std::fs::read(cap.join(format!("p{n}.index"))).unwrap();
        let ref_stream = cap.join(format!("p{n}.stream"));
        let idx = ContentIndex::parse(&ref_index).unwrap();
        let h = &idx.header;
        assert_eq!(c["usedBytes"], h.used_bytes);
        assert_eq!(c["sizeBytes"], h.partition_size);
        assert_eq!(c["lastExtentEnd"], h.last_extent_end);
        assert_eq!(c["blockSize"], h.block_size);
        assert_eq!(c["pieceLength"], h.piece_length);
        assert_eq!(c["streamSha256"], idx.stream_sha256_hex().as_str());
        assert_eq!(c["indexSha256"], sha256_hex(&ref_index).as_str());
        let opt = |v: &Value| v.as_str().map(str::to_owned);
        let nonempty = |s: String| (!s.is_empty()).then_some(s);
        assert_eq!(opt(&c["fsType"]), nonempty(h.fs_type.clone()));
        assert_eq!(opt(&c["uuid"]), nonempty(h.uuid_string()));
        assert_eq!(opt(&c["label"]), nonempty(h.label.clone()));
        let dir = store.join("lab").join(&name);
        assert!(std::fs::read(dir.join("index")).unwrap() == ref_index);
        assert!(std::fs::read(dir.join("stream")).unwrap() == std::fs::read(&ref_stream).unwrap());
        assert!(!dir.join("verified").exists(), "ingest does not verify");
    }
    if res["layout"].is_null() {
        assert!(!store.join("lab/.imports").join(import).exists());
    } else {
        let mut want: Value =
            serde_json::from_slice(&std::fs::read(cap.join("layout.json")).unwrap()).unwrap();
        for s in want["slots"].as_array_mut().unwrap() {
            if let Some(r) = s["contentRef"].as_str() {
                s["contentRef"] = Value::from(format!("{prefix}-{r}"));
            }
        }
        assert_eq!(res["layout"], want);
        let stored: Value = serde_json::from_slice(
            &std::fs::read(store.join("lab/.imports").join(import).join("layout.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(stored, want);
    }
    assert_clean(store);
}

/// No staging directory is left behind.
fn assert_clean(store: &Path) {
    let staging = store.join(".staging/lab");
    if staging.exists() {
        let left: Vec<_> = std::fs::read_dir(&staging).unwrap().collect();
        assert!(left.is_empty(), "staging left: {left:?}");
    }
}

/// Content directories in the store's `lab` namespace.
fn published(store: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(store.join("lab")) else {
        return Vec::new();
    };
    let mut v: Vec<String> = rd
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    v.sort();
    v
}

// ------------------------------------------------------------ servers

/// Serves the files of a directory: `GET /<name>` with Content-Length,
/// `GET /chunked/<name>` chunked, `/status/<code>` that status; 404 else.
/// One thread per connection; with `tls`, HTTPS.
fn serve_dir(root: PathBuf, tls: Option<Arc<rustls::ServerConfig>>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(tcp) = c else { continue };
            let (root, tls) = (root.clone(), tls.clone());
            std::thread::spawn(move || {
                let _ = match tls {
                    Some(cfg) => {
                        let conn = rustls::ServerConnection::new(cfg).unwrap();
                        answer(rustls::StreamOwned::new(conn, tcp), &root)
                    }
                    None => answer(tcp, &root),
                };
            });
        }
    });
    addr
}

fn answer(mut s: impl Read + Write, root: &Path) -> std::io::Result<()> {
    let mut r = BufReader::new(&mut s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let path = line.split(' ').nth(1).unwrap_or("/").to_owned();
    let mut range_from: Option<u64> = None;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("range: bytes=") {
            range_from = v.trim().trim_end_matches('-').parse().ok();
        }
    }
    drop(r);
    for (prefix, ranges) in [("/cut/", true), ("/cut-norange/", false)] {
        // `/cut/<n>/<name>`: the first request of that path gets the
        // whole Content-Length but only n bytes, then the connection
        // closes; later ones are served whole, or from `Range: bytes=N-`
        // (206) unless the path starts with `/cut-norange/`
        let Some(rest) = path.strip_prefix(prefix) else {
            continue;
        };
        let (n, name) = rest.split_once('/').unwrap();
        let seen = {
            let mut m = FLAKY.lock().unwrap();
            let c = m.entry(path.clone()).or_insert(0);
            *c += 1;
            *c
        };
        let data = std::fs::read(root.join(name))?;
        let len = data.len();
        if seen == 1 {
            let n: usize = n.parse().unwrap();
            s.write_all(format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nETag: \"v1\"\r\nConnection: close\r\n\r\n").as_bytes())?;
            s.write_all(&data[..n])?;
            return s.flush();
        }
        match range_from {
            Some(from) if ranges => {
                let from = usize::try_from(from).unwrap();
                s.write_all(format!("HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {from}-{}/{len}\r\nETag: \"v1\"\r\nConnection: close\r\n\r\n", len - from, len - 1).as_bytes())?;
                s.write_all(&data[from..])?;
            }
            _ => {
                s.write_all(format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nETag: \"v1\"\r\nConnection: close\r\n\r\n").as_bytes())?;
                s.write_all(&data)?;
            }
        }
        return s.flush();
    }
    if let Some(rest) = path.strip_prefix("/redirect/") {
        let resp = format!(
            "HTTP/1.1 302 Found\r\nLocation: /{rest}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        s.write_all(resp.as_bytes())?;
        return s.flush();
    }
    if let Some(rest) = path.strip_prefix("/flaky/") {
        // `/flaky/<n>/<name>`: 503 for the first n requests of that path
        let (n, name) = rest.split_once('/').unwrap();
        let seen = {
            let mut m = FLAKY.lock().unwrap();
            let c = m.entry(path.clone()).or_insert(0);
            *c += 1;
            *c
        };
        if seen <= n.parse::<usize>().unwrap() {
            s.write_all(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
            return s.flush();
        }
        return send_file(s, &root.join(name), false);
    }
    if let Some(code) = path.strip_prefix("/status/") {
        let resp = format!("HTTP/1.1 {code} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        s.write_all(resp.as_bytes())?;
        return s.flush();
    }
    let (chunked, name) = match path.strip_prefix("/chunked/") {
        Some(n) => (true, n.to_owned()),
        None => (false, path.trim_start_matches('/').to_owned()),
    };
    send_file(s, &root.join(name), chunked)
}

static FLAKY: std::sync::Mutex<std::collections::BTreeMap<String, usize>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

fn send_file(mut s: impl Write, path: &Path, chunked: bool) -> std::io::Result<()> {
    let Ok(mut f) = std::fs::File::open(path) else {
        s.write_all(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 10\r\nConnection: close\r\n\r\nnot found\n",
        )?;
        return s.flush();
    };
    let len = f.metadata()?.len();
    if chunked {
        s.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")?;
        let mut buf = vec![0u8; 65_521];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            s.write_all(format!("{n:x};ext=1\r\n").as_bytes())?;
            s.write_all(&buf[..n])?;
            s.write_all(b"\r\n")?;
        }
        s.write_all(b"0\r\nX-Trailer: 1\r\n\r\n")?;
    } else {
        s.write_all(
            format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )?;
        std::io::copy(&mut f, &mut s)?;
    }
    s.flush()
}

/// A CA and a server certificate for 127.0.0.1 signed by it: (CA PEM,
/// server config).
fn tls_server() -> (String, Arc<rustls::ServerConfig>) {
    let pki = anneal_testinfra::test_pki("ingest test ca").unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![
                CertificateDer::from(pki.leaf_der),
                CertificateDer::from(pki.ca_der),
            ],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(pki.key_der)),
        )
        .unwrap();
    (pki.ca_pem, Arc::new(cfg))
}

fn http_get(addr: SocketAddr, req: &str) -> (String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    let at = all.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    (
        String::from_utf8_lossy(&all[..at]).into_owned(),
        all[at + 4..].to_vec(),
    )
}

// ------------------------------------------------------------ tests

/// A raw GPT image over HTTP with its checksum: the result and the store
/// equal what `anneal-agent capture` makes of the same file; then verify,
/// serve, a taken name, a flipped byte, remove.
#[test]
fn raw_gpt_over_http_equals_capture_then_verify_serve_remove() {
    let dir = tmpdir();
    let d = dir.path();
    let disk = build_disk(d);
    let cap = d.join("cap");
    capture(&disk, &cap, &[]);
    let sha = file_sha(&disk);
    let addr = serve_dir(d.to_owned(), None);
    let store = d.join("store");
    let url = format!("http://{addr}/disk.raw");

    let o = ingest(
        &url,
        &store,
        "imp1",
        "img",
        &["--checksum", &format!("sha256:{sha}")],
    );
    let res = o.ok();
    assert_eq!(res["format"], "raw");
    assert_eq!(res["sourceSha256"], sha.as_str());
    assert_eq!(res["bytesFetched"], 64u64 << 20);
    let names: Vec<&str> = res["contents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    // swap has no content
    assert_eq!(names, ["img-p1", "img-p3", "img-p4"]);
    assert_eq!(res["contents"][0]["fsType"], "vfat");
    assert_eq!(res["contents"][1]["fsType"], "ext4");
    assert_eq!(res["contents"][1]["label"], "ingroot");
    assert!(res["contents"][2].get("label").is_none());
    assert_matches_capture(res, &cap, &store, "imp1", "img");
    let progress = o.progress();
    assert!(progress.len() >= 2, "{progress:?}");
    let phases: Vec<&str> = progress
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    for p in ["Fetching", "Capturing", "Publishing"] {
        assert!(phases.contains(&p), "{phases:?}");
    }
    let lastp = progress.last().unwrap();
    assert_eq!(lastp["bytesTotal"], 64u64 << 20);
    assert_eq!(lastp["bytesFetched"], 64u64 << 20);
    let used: u64 = res["contents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["usedBytes"].as_u64().unwrap())
        .sum();
    assert_eq!(lastp["bytesCaptured"], used);

    // the same prefix again (another import): ContentExists, nothing new
    let before = published(&store);
    let o = ingest(&url, &store, "imp2", "img", &[]);
    let m = o.err("ContentExists");
    assert!(m.contains("img-p1"), "{m}");
    assert_eq!(published(&store), before);
    assert!(!store.join("lab/.imports/imp2").exists());
    assert_clean(&store);

    // verify: marker and sha256 equal to the index header's
    let content_server = {
        let cfg = anneal_agent::serve::ServeConfig::new(&store);
        let server =
            anneal_agent::serve::Server::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
        let a = server.local_addr().unwrap();
        std::thread::spawn(move || server.run());
        a
    };
    let (st, body) = http_get(
        content_server,
        "GET /content/lab/img-p3/stream HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert!(st.starts_with("HTTP/1.1 404"), "{st}");
    assert!(String::from_utf8_lossy(&body).contains("not verified"));
    let idx = ContentIndex::parse(&std::fs::read(store.join("lab/img-p3/index")).unwrap()).unwrap();
    let o = store_cmd("verify", &store, "img-p3");
    let r = o.ok();
    assert_eq!(r["sha256"], idx.stream_sha256_hex().as_str());
    assert_eq!(r["pieces"], idx.piece_count());
    assert_eq!(r["usedBytes"], idx.header.used_bytes);
    assert_eq!(
        r["infoHash"],
        anneal_image::torrent::Metainfo::from_index(&idx, "img-p3", None)
            .info_hash_hex()
            .as_str()
    );
    assert_eq!(
        r["indexSha256"],
        file_sha(&store.join("lab/img-p3/index")).as_str()
    );
    assert!(!o.progress().is_empty());
    assert_eq!(
        std::fs::read_to_string(store.join("lab/img-p3/verified")).unwrap(),
        format!("{}\n", idx.stream_sha256_hex())
    );
    // served now: whole and a range
    let stream = std::fs::read(store.join("lab/img-p3/stream")).unwrap();
    let (st, body) = http_get(
        content_server,
        "GET /content/lab/img-p3/stream HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert!(st.starts_with("HTTP/1.1 200"), "{st}");
    assert!(body == stream);
    let (st, body) = http_get(
        content_server,
        "GET /content/lab/img-p3/stream HTTP/1.1\r\nRange: bytes=1048576-1048675\r\nConnection: close\r\n\r\n",
    );
    assert!(st.starts_with("HTTP/1.1 206"), "{st}");
    assert_eq!(body, &stream[1_048_576..1_048_676]);
    // the old path is gone
    let (st, _) = http_get(
        content_server,
        "GET /v1/contents/lab/img-p3/stream HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert!(st.starts_with("HTTP/1.1 404"), "{st}");

    // a flipped byte in piece 2: PieceMismatch naming it, the marker is gone
    let mut bad = stream.clone();
    bad[2 * 1_048_576 + 77] ^= 0x40;
    std::fs::write(store.join("lab/img-p3/stream"), &bad).unwrap();
    let m = store_cmd("verify", &store, "img-p3").err("PieceMismatch");
    assert!(m.contains("piece 2 of img-p3"), "{m}");
    assert!(!store.join("lab/img-p3/verified").exists());
    let (st, _) = http_get(
        content_server,
        "GET /content/lab/img-p3/stream HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert!(st.starts_with("HTTP/1.1 404"), "{st}");
    // a missing content, a bad name
    store_cmd("verify", &store, "nope-p1").err("Missing");
    store_cmd("verify", &store, "../img-p3").err("StoreError");
    // remove, twice
    store_cmd("remove", &store, "img-p3").ok();
    assert!(!store.join("lab/img-p3").exists());
    store_cmd("remove", &store, "img-p3").ok();
}

/// A connection that breaks mid-body: the rest is fetched with `Range`
/// (206), or, from a server without range support, re-read from the start
/// with the bytes already had skipped; the result equals the capture.
#[test]
fn a_broken_connection_resumes() {
    let dir = tmpdir();
    let d = dir.path();
    let disk = build_disk(d);
    let cap = d.join("cap");
    capture(&disk, &cap, &[]);
    let sha = file_sha(&disk);
    let addr = serve_dir(d.to_owned(), None);
    for (i, route) in ["cut", "cut-norange"].iter().enumerate() {
        let store = d.join(format!("store{i}"));
        // cut inside the ext4 partition's data
        let url = format!("http://{addr}/{route}/30000123/disk.raw");
        let o = ingest(
            &url,
            &store,
            "imp",
            "img",
            &["--checksum", &format!("sha256:{sha}"), "--retries", "1"],
        );
        let res = o.ok();
        assert_eq!(res["sourceSha256"], sha.as_str());
        assert_eq!(res["bytesFetched"], 64u64 << 20);
        assert_eq!(o.stderr.matches("resuming").count(), 1, "{}", o.stderr);
        assert_matches_capture(res, &cap, &store, "imp", "img");
    }
    // no retries left: the broken body is an error, nothing published
    let store = d.join("store-noretry");
    let o = ingest(
        &format!("http://{addr}/cut/30000124/disk.raw"),
        &store,
        "imp",
        "img",
        &["--retries", "0"],
    );
    let m = o.err("Unreachable");
    assert!(m.contains("after 30000124 bytes"), "{m}");
    assert!(published(&store).is_empty());
    assert_clean(&store);
}

/// The same disk as qcow2 (scratch removed afterwards), with the scratch
/// directory given; and from `staged://`.
#[test]
fn qcow2_and_staged_sources() {
    let dir = tmpdir();
    let d = dir.path();
    let disk = build_disk(d);
    let cap = d.join("cap");
    capture(&disk, &cap, &[]);
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&disk)
        .arg(d.join("disk.qcow2")));
    let addr = serve_dir(d.to_owned(), None);
    let store = d.join("store");
    let scratch = d.join("scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    // through a redirect, with its checksum (spooled, hashed, verified)
    let qsha = file_sha(&d.join("disk.qcow2"));
    let o = ingest(
        &format!("http://{addr}/redirect/disk.qcow2"),
        &store,
        "imp-q",
        "q",
        &[
            "--scratch",
            scratch.to_str().unwrap(),
            "--checksum",
            &format!("sha256:{qsha}"),
        ],
    );
    let res = o.ok();
    assert_eq!(res["format"], "qcow2");
    assert_eq!(res["sourceSha256"], qsha.as_str());
    assert_matches_capture(res, &cap, &store, "imp-q", "q");
    assert_eq!(
        std::fs::read_dir(&scratch).unwrap().count(),
        0,
        "scratch left"
    );

    // staged: the file is already in the store
    let staged = store.join("lab/.staged");
    std::fs::create_dir_all(&staged).unwrap();
    std::fs::copy(&disk, staged.join("upload-1")).unwrap();
    // a failed import keeps the upload for the next attempt
    ingest(
        "staged://upload-1",
        &store,
        "imp-bad",
        "bad",
        &[
            "--format",
            "raw",
            "--checksum",
            &format!("sha256:{}", "0".repeat(64)),
        ],
    )
    .err("ChecksumMismatch");
    assert!(std::fs::read(staged.join("upload-1")).unwrap() == std::fs::read(&disk).unwrap());
    let res = ingest(
        "staged://upload-1",
        &store,
        "imp-s",
        "s",
        &["--format", "raw"],
    );
    let res = res.ok();
    assert_eq!(res["format"], "raw");
    assert_matches_capture(res, &cap, &store, "imp-s", "s");
    // captured in place, then removed once its contents are published
    assert!(
        !staged.join("upload-1").exists(),
        "the staged upload outlived its import"
    );
    ingest("staged://upload-2", &store, "imp-t", "t", &[]).err("SourceNotFound");
}

fn partclone_image(d: &Path, part: &Path, tool: &str, out: &Path) {
    let mut c = Command::new(format!("partclone.{tool}"));
    if tool != "dd" {
        c.arg("-c");
    }
    run(c
        .arg("-q")
        .arg("-L")
        .arg(d.join("partclone.log"))
        .arg("-s")
        .arg(part)
        .arg("-o")
        .arg(out));
}

fn have_partclone() -> bool {
    Command::new("sh")
        .args([
            "-c",
            "command -v partclone.ext4 && command -v partclone.vfat",
        ])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A single partclone image (ext4, zstd-compressed) over chunked HTTP:
/// captured while it streams, equal to `capture --format partclone`.
#[test]
fn single_partclone_image_over_chunked_http() {
    if !have_partclone() {
        eprintln!("SKIPPED: partclone.ext4 is not installed (Debian package `partclone`)");
        return;
    }
    let dir = tmpdir();
    let d = dir.path();
    build_disk(d);
    sh(&format!(
        "cd {} && dd if=disk.raw of=p3.part bs=512 skip=51200 count=49152 status=none",
        d.display()
    ));
    let pcl = d.join("p3.pcl");
    partclone_image(d, &d.join("p3.part"), "ext4", &pcl);
    sh(&format!(
        "cd {} && zstd -q p3.pcl -o p3.pcl.zst",
        d.display()
    ));
    let cap = d.join("cap");
    capture(&pcl, &cap, &["--format", "partclone", "--name", "p1"]);
    let addr = serve_dir(d.to_owned(), None);
    let store = d.join("store");
    let sha = file_sha(&d.join("p3.pcl.zst"));
    let o = ingest(
        &format!("http://{addr}/chunked/p3.pcl.zst"),
        &store,
        "imp-p",
        "pc",
        &["--checksum", &format!("sha256:{sha}")],
    );
    let res = o.ok();
    assert_eq!(res["format"], "partclone");
    assert!(res["layout"].is_null());
    assert_eq!(
        res["bytesFetched"],
        std::fs::metadata(d.join("p3.pcl.zst")).unwrap().len()
    );
    assert_eq!(res["contents"].as_array().unwrap().len(), 1);
    assert_eq!(res["contents"][0]["name"], "pc-p1");
    assert_eq!(res["contents"][0]["fsType"], "ext4");
    assert_matches_capture(res, &cap, &store, "imp-p", "pc");
    // progress reports no total for a chunked body
    assert!(o.progress().iter().all(|p| p["bytesTotal"] == 0));

    // --max-bytes below the size of a chunked body: refused while reading
    let store2 = d.join("store2");
    let m = ingest(
        &format!("http://{addr}/chunked/p3.pcl.zst"),
        &store2,
        "imp-p",
        "pc",
        &["--max-bytes", "20000"],
    )
    .err("SourceTooLarge");
    assert!(m.contains("20000"), "{m}");
    assert!(published(&store2).is_empty());
    assert_clean(&store2);
}

/// A Clonezilla image directory packed as tar (vfat gzip, ext4 zstd split
/// in two, swap info), `--format partclone`: equal to `capture` of the
/// directory.
#[test]
fn clonezilla_tar_over_http() {
    if !have_partclone() {
        eprintln!(
            "SKIPPED: partclone.ext4/partclone.vfat are not installed (Debian package `partclone`)"
        );
        return;
    }
    let dir = tmpdir();
    let d = dir.path();
    let disk = build_disk(d);
    let cz = d.join("2026-12-01-img");
    std::fs::create_dir_all(&cz).unwrap();
    sh(&format!(
        "sfdisk -d {disk} | sed -E 's#^[^ ]*raw([0-9]+) :#/dev/sda\\1 :#' > {cz}/sda-pt.sf && echo sda > {cz}/disk && echo 'sda1 sda2 sda3 sda4' > {cz}/parts",
        disk = disk.display(),
        cz = cz.display()
    ));
    for (n, tool, comp, skip, count) in [
        (1, "vfat", "gz", 2048, 32768),
        (3, "ext4", "zst", 51200, 49152),
    ] {
        let part = d.join(format!("p{n}.part"));
        sh(&format!(
            "dd if={disk} of={part} bs=512 skip={skip} count={count} status=none",
            disk = disk.display(),
            part = part.display()
        ));
        let compress = if comp == "gz" {
            "gzip -c"
        } else {
            "zstd -q -c"
        };
        sh(&format!(
            "partclone.{tool} -c -q -L {d}/pc.log -s {part} -o - | {compress} > {d}/tmp && \
             split -n 2 {d}/tmp {cz}/sda{n}.{tool}-ptcl-img.{comp}. && rm {d}/tmp {part}",
            d = d.display(),
            part = part.display(),
            cz = cz.display()
        ));
    }
    std::fs::write(cz.join("swappt-sda2.info"), "UUID=\"\"\nLABEL=\"swp\"\n").unwrap();
    let cap = d.join("cap");
    capture(&cz, &cap, &["--format", "clonezilla"]);
    sh(&format!(
        "cd {} && tar -cf cz.tar 2026-12-01-img",
        d.display()
    ));
    let addr = serve_dir(d.to_owned(), None);
    let store = d.join("store");
    let o = ingest(
        &format!("http://{addr}/cz.tar"),
        &store,
        "imp-cz",
        "cz",
        &[
            "--format",
            "partclone",
            "--checksum",
            &format!("sha256:{}", file_sha(&d.join("cz.tar"))),
        ],
    );
    let res = o.ok();
    assert_eq!(res["format"], "clonezilla");
    let names: Vec<&str> = res["contents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["cz-p1", "cz-p3"]);
    assert_matches_capture(res, &cap, &store, "imp-cz", "cz");

    // the same tar compressed with zstd, format detected
    sh(&format!(
        "cd {} && zstd -q cz.tar -o cz.tar.zst",
        d.display()
    ));
    let store = d.join("store-zst");
    let zsha = file_sha(&d.join("cz.tar.zst"));
    let o = ingest(
        &format!("http://{addr}/cz.tar.zst"),
        &store,
        "imp-cz",
        "cz",
        &["--checksum", &format!("sha256:{zsha}")],
    );
    let res = o.ok();
    assert_eq!(res["format"], "clonezilla");
    assert_eq!(res["sourceSha256"], zsha.as_str());
    assert_matches_capture(res, &cap, &store, "imp-cz", "cz");
}

/// Every refusal: reason, a message naming what is wrong, nothing
/// published, no staging left.
#[test]
fn refusals() {
    let dir = tmpdir();
    let d = dir.path();
    // a small raw disk is enough here
    sh(&format!(
        "cd {} && truncate -s 8M small.raw && sgdisk -o -n 1:2048:+4M -n 2:0:+2M small.raw >/dev/null && \
         mkfs.vfat --offset 2048 small.raw 4096 >/dev/null",
        d.display()
    ));
    // magic, version 0002 and the endianness marker, then garbage
    let mut hostile = b"partclone-image\0".to_vec();
    hostile.resize(30, 0);
    hostile.extend_from_slice(b"0002");
    hostile.extend_from_slice(&0xC0DEu16.to_le_bytes());
    hostile.extend((0..20_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8));
    std::fs::write(d.join("hostile.pcl"), &hostile).unwrap();
    let addr = serve_dir(d.to_owned(), None);
    let small = format!("http://{addr}/small.raw");
    let sha = file_sha(&d.join("small.raw"));

    // checksum mismatch: expected and actual named, nothing published
    let store = d.join("s1");
    let wrong = "ab".repeat(32);
    let m = ingest(
        &small,
        &store,
        "i",
        "x",
        &["--checksum", &format!("sha256:{wrong}")],
    )
    .err("ChecksumMismatch");
    assert!(m.contains(&wrong) && m.contains(&sha), "{m}");
    assert!(published(&store).is_empty());
    assert!(!store.join("lab/.imports/i").exists());
    assert_clean(&store);

    // 404
    let m =
        ingest(&format!("http://{addr}/missing.raw"), &store, "i", "x", &[]).err("SourceNotFound");
    assert!(m.contains("missing.raw") && m.contains("404"), "{m}");
    // 4xx other than 404: HTTPError, not retried
    let m = ingest(&format!("http://{addr}/status/403"), &store, "i", "x", &[]).err("HTTPError");
    assert!(m.contains("403"), "{m}");
    // 5xx twice, then the file: retried and ingested
    let o = ingest(
        &format!("http://{addr}/flaky/2/small.raw"),
        &d.join("s0"),
        "i",
        "x",
        &["--retries", "2"],
    );
    // without a checksum the source is not hashed
    assert_eq!(o.ok()["sourceSha256"], "");
    assert_eq!(o.stderr.matches("retrying").count(), 2, "{}", o.stderr);
    // 5xx after retries: HTTPError
    let m = ingest(
        &format!("http://{addr}/status/503"),
        &store,
        "i",
        "x",
        &["--retries", "1"],
    )
    .err("HTTPError");
    assert!(m.contains("503"), "{m}");

    // a taken name: ContentExists naming it, nothing published
    let store = d.join("s2");
    std::fs::create_dir_all(store.join("lab/x-p1")).unwrap();
    let m = ingest(&small, &store, "i", "x", &[]).err("ContentExists");
    assert!(m.contains("x-p1"), "{m}");
    assert_eq!(published(&store), ["x-p1"]);
    assert!(
        std::fs::read_dir(store.join("lab/x-p1"))
            .unwrap()
            .next()
            .is_none()
    );
    assert!(!store.join("lab/.imports/i").exists());
    assert_clean(&store);

    // --max-bytes smaller than the source (Content-Length)
    let store = d.join("s3");
    let m = ingest(&small, &store, "i", "x", &["--max-bytes", "1000000"]).err("SourceTooLarge");
    assert!(
        m.contains("1000000") && m.contains(&(8u64 << 20).to_string()),
        "{m}"
    );
    assert!(published(&store).is_empty());

    // a closed port: Unreachable after the retries
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let o = ingest(
        &format!("http://{closed}/x.raw"),
        &store,
        "i",
        "x",
        &["--retries", "2"],
    );
    let m = o.err("Unreachable");
    assert!(
        m.contains("3 attempts") && m.contains(&closed.to_string()),
        "{m}"
    );
    assert_eq!(o.stderr.matches("retrying").count(), 2, "{}", o.stderr);

    // a hostile partclone image: InvalidSource with the parser's message
    let want = anneal_image::partclone::parse_header(&hostile)
        .unwrap_err()
        .to_string();
    let m =
        ingest(&format!("http://{addr}/hostile.pcl"), &store, "i", "x", &[]).err("InvalidSource");
    assert!(m.contains(&want), "{m} / {want}");
    assert!(published(&store).is_empty());
    assert_clean(&store);

    // names that are not DNS-1123: refused before the store is touched
    let store = d.join("s4");
    let m = ingest(&small, &store, "../i", "x", &[]).err("StoreError");
    assert!(m.contains("import"), "{m}");
    assert!(!store.exists());
}

/// A self-signed server certificate for 127.0.0.1.
fn self_signed_server() -> Arc<rustls::ServerConfig> {
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Arc::new(
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
            .unwrap(),
    )
}

/// HTTPS: verified against --ca-bundle only; a server with a self-signed
/// certificate, or one signed by a CA not in the bundle, is a TLSError.
#[test]
fn https_with_ca_bundle() {
    let dir = tmpdir();
    let d = dir.path();
    sh(&format!(
        "cd {} && truncate -s 8M small.raw && sgdisk -o -n 1:2048:+4M small.raw >/dev/null && \
         mkfs.vfat --offset 2048 small.raw 4096 >/dev/null",
        d.display()
    ));
    let (ca_pem, cfg) = tls_server();
    let (other_ca_pem, _) = tls_server();
    std::fs::write(d.join("ca.pem"), ca_pem).unwrap();
    std::fs::write(d.join("other.pem"), other_ca_pem).unwrap();
    let addr = serve_dir(d.to_owned(), Some(cfg));
    let url = format!("https://{addr}/small.raw");
    let store = d.join("store");
    let selfsigned = serve_dir(d.to_owned(), Some(self_signed_server()));
    let m = ingest(
        &format!("https://{selfsigned}/small.raw"),
        &store,
        "i",
        "x",
        &["--ca-bundle", d.join("ca.pem").to_str().unwrap()],
    )
    .err("TLSError");
    assert!(m.contains(&selfsigned.to_string()), "{m}");
    // no bundle: the system roots do not know the test CA either
    ingest(&url, &store, "i", "x", &[]).err("TLSError");
    let m = ingest(
        &url,
        &store,
        "i",
        "x",
        &["--ca-bundle", d.join("other.pem").to_str().unwrap()],
    )
    .err("TLSError");
    assert!(m.contains(&url), "{m}");
    assert!(published(&store).is_empty());
    let o = ingest(
        &url,
        &store,
        "i",
        "x",
        &["--ca-bundle", d.join("ca.pem").to_str().unwrap()],
    );
    let res = o.ok();
    assert_eq!(res["format"], "raw");
    assert_eq!(res["sourceSha256"], "");
    assert_eq!(published(&store), ["x-p1"]);
}

/// SIGTERM while the source streams (a deleted Job): the staging and
/// scratch directories are removed, nothing is published, exit 128+15.
#[test]
fn sigterm_removes_the_work_directories() {
    let dir = tmpdir();
    let d = dir.path();
    // a server that sends 2 MiB of a 64 MiB body, then stalls
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        while r.read_line(&mut line).unwrap() > 0 && line != "\r\n" {
            line.clear();
        }
        s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 67108864\r\n\r\n")
            .unwrap();
        s.write_all(&vec![0x5a; 2 << 20]).unwrap();
        // keep the connection open until the test ends
        let _ = hold_rx.recv();
    });
    let store = d.join("store");
    let scratch = d.join("scratch");
    let mut child = agent()
        .args([
            "ingest",
            "--url",
            &format!("http://{addr}/big.raw"),
            "--store",
        ])
        .arg(&store)
        .args(["--namespace", "lab", "--import", "i", "--prefix", "x"])
        .arg("--scratch")
        .arg(&scratch)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // wait until bytes are flowing (a progress event says so)
    loop {
        let l = lines.next().expect("ingest ended early").unwrap();
        let v: Value = serde_json::from_str(&l).unwrap();
        assert_eq!(v["event"], "progress", "{v}");
        if v["bytesFetched"].as_u64().unwrap() > 0 {
            break;
        }
    }
    // the work directories exist while it runs
    assert_eq!(
        std::fs::read_dir(store.join(".staging/lab"))
            .unwrap()
            .count(),
        1
    );
    assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 1);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(128 + 15), "{st:?}");
    assert_clean(&store);
    assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0);
    assert!(published(&store).is_empty());
    drop(hold_tx);
}

/// `anneal-agent capture` that must fail: its stderr.
fn capture_fails(src: &Path, out: &Path, format: &str) -> String {
    let o = agent()
        .arg("capture")
        .arg(src)
        .arg("--out")
        .arg(out)
        .args(["--format", format, "--piece-length", PIECE])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "capture {src:?} as {format} succeeded");
    // nothing captured: no index nor stream
    if let Ok(rd) = std::fs::read_dir(out) {
        let made: Vec<_> = rd
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".index") || n.ends_with("layout.json"))
            .collect();
        assert!(made.is_empty(), "capture {src:?} as {format} left {made:?}");
    }
    stderr
}

/// Zero-length sources, a compressed nothing and a Clonezilla image without
/// partitions: refused with "source is empty" by capture and ingest alike
/// (InvalidSource), nothing published (docs/content-format.md, "Input
/// bounds (capture and ingest)").
#[test]
fn empty_sources_are_refused() {
    let dir = tmpdir();
    let d = dir.path();
    std::fs::write(d.join("empty.raw"), b"").unwrap();
    let cz = d.join("cz");
    std::fs::create_dir_all(&cz).unwrap();
    std::fs::write(cz.join("sda-pt.sf"), b"label: gpt\nunit: sectors\n\n").unwrap();
    std::fs::write(cz.join("disk"), b"sda\n").unwrap();
    std::fs::write(cz.join("parts"), b"\n").unwrap();
    sh(&format!(
        "cd {} && gzip -c </dev/null >empty.gz && tar -cf cz.tar cz",
        d.display()
    ));

    let empty = d.join("empty.raw");
    for (i, (src, format)) in [
        (&empty, "auto"),
        (&empty, "raw"),
        (&empty, "partclone"),
        (&empty, "qcow2"),
        (&empty, "partition"),
        (&d.join("empty.gz"), "partclone"),
        (&cz, "clonezilla"),
    ]
    .into_iter()
    .enumerate()
    {
        let m = capture_fails(src, &d.join(format!("out{i}")), format);
        assert!(m.contains("source is empty"), "{src:?} as {format}: {m}");
    }

    let addr = serve_dir(d.to_owned(), None);
    let store = d.join("s");
    for (name, extra) in [
        ("empty.raw", &[][..]),
        ("empty.raw", &["--format", "raw"][..]),
        ("empty.raw", &["--format", "partclone"][..]),
        ("empty.raw", &["--format", "qcow2"][..]),
        ("empty.gz", &[][..]),
        ("cz.tar", &["--format", "partclone"][..]),
        ("chunked/empty.raw", &["--format", "partclone"][..]),
    ] {
        let m =
            ingest(&format!("http://{addr}/{name}"), &store, "i", "x", extra).err("InvalidSource");
        assert!(
            m.contains("source is empty") && m.contains(name),
            "{name} {extra:?}: {m}"
        );
        assert!(published(&store).is_empty(), "{name} {extra:?}");
        assert!(!store.join("lab/.imports/i").exists());
        assert_clean(&store);
    }
}

/// A partclone image cut short of its used blocks: the error says how many
/// of how many it holds; nothing published (docs/content-format.md,
/// "Input bounds (capture and ingest)").
#[test]
fn a_truncated_partclone_image_says_how_much_it_holds() {
    let dir = tmpdir();
    let d = dir.path();
    let bitmap = vec![true; 5000];
    let data: Vec<u8> = (0..5000 * 512u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 9) as u8)
        .collect();
    let img = anneal_image::partclone::build("EXTFS", 512, &bitmap, &data, 0);
    let start = anneal_image::partclone::HEADER_LEN + 5000 / 8 + 4;
    std::fs::write(d.join("cut.pcl"), &img[..start + 1200 * 512 + 100]).unwrap();
    let want = "partclone image ends after 1200 of 5000 used blocks";

    let m = capture_fails(&d.join("cut.pcl"), &d.join("out"), "partclone");
    assert!(m.contains(want), "{m}");

    let addr = serve_dir(d.to_owned(), None);
    let store = d.join("s");
    for name in ["cut.pcl", "chunked/cut.pcl"] {
        let m =
            ingest(&format!("http://{addr}/{name}"), &store, "i", "x", &[]).err("InvalidSource");
        assert!(m.contains(want), "{name}: {m}");
        assert!(published(&store).is_empty());
        assert!(!store.join("lab/.imports/i").exists());
        assert_clean(&store);
    }
}
