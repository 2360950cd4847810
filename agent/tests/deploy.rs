//! `anneal-agent deploy`: a captured GPT disk (ESP, swap, ext4 with data),
//! served by `anneal-agent serve` on 127.0.0.1 (port 0), deployed to a
//! sparse file through a plan; a proxy in the test corrupts one range once
//! or always; a wrong index hash is refused before any write; `wipe`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sha2::Digest as _;

const NS: &str = "lab";
const PIECE: u64 = 256 << 10;

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

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_anneal-agent"))
}

fn base() -> tempfile::TempDir {
    let base = Path::new("/var/tmp/anneal-test");
    std::fs::create_dir_all(base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

/// A 64 MiB GPT disk: ESP (vfat, a file), swap, ext4 with ~6 MiB of
/// pseudo-random files.
fn make_disk(d: &Path) -> PathBuf {
    let raw = d.join("disk.raw");
    std::fs::File::create(&raw)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    run(Command::new("sgdisk")
        .args([
            "-o",
            "-n",
            "1:2048:+8M",
            "-t",
            "1:ef00",
            "-n",
            "2:0:+4M",
            "-t",
            "2:8200",
            "-n",
            "3:0:+40M",
            "-t",
            "3:8300",
        ])
        .arg(&raw));
    let esp = d.join("esp");
    std::fs::create_dir_all(&esp).unwrap();
    run(Command::new("mkfs.vfat")
        .args(["--offset", "2048", "-n", "DEPLOYESP"])
        .arg(&raw)
        .arg("8192"));
    // swap: mkswap on a file, copied into place
    let swap = d.join("swap.img");
    std::fs::File::create(&swap)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    run(Command::new("mkswap").arg("-L").arg("dswap").arg(&swap));
    run(Command::new("dd")
        .arg(format!("if={}", swap.display()))
        .arg(format!("of={}", raw.display()))
        .args(["bs=512", "seek=18432", "conv=notrunc", "status=none"]));
    let tree = d.join("tree");
    std::fs::create_dir_all(tree.join("data")).unwrap();
    std::fs::write(tree.join("marker"), b"deployed over http\n").unwrap();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..6 {
        let mut v = vec![0u8; 1 << 20];
        for b in v.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        std::fs::write(tree.join("data").join(format!("f{i}")), &v).unwrap();
    }
    run(Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-L", "droot", "-E"])
        .arg(format!("offset={}", 26_624 * 512))
        .arg("-d")
        .arg(&tree)
        .arg(&raw)
        .arg("40M"));
    raw
}

struct Fixture {
    dir: tempfile::TempDir,
    raw: PathBuf,
    cap: PathBuf,
    server: Child,
    addr: SocketAddr,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

fn sha256_hex(p: &Path) -> String {
    hex::encode(sha2::Sha256::digest(std::fs::read(p).unwrap()))
}

/// Captures the disk, publishes its contents in a store and serves it.
fn fixture() -> Fixture {
    let dir = base();
    let raw = make_disk(dir.path());
    served(dir, raw, &["p1", "p3"])
}

/// Captures the disk `raw` (in `dir`), publishes its contents `names` in a
/// store and serves it.
fn served(dir: tempfile::TempDir, raw: PathBuf, names: &[&str]) -> Fixture {
    let d = dir.path();
    let cap = d.join("cap");
    run(agent()
        .arg("capture")
        .arg(&raw)
        .arg("--out")
        .arg(&cap)
        .arg("--piece-length")
        .arg(PIECE.to_string()));
    let store = d.join("store");
    for name in names {
        let c = store.join(NS).join(name);
        std::fs::create_dir_all(&c).unwrap();
        std::fs::copy(cap.join(format!("{name}.index")), c.join("index")).unwrap();
        std::fs::copy(cap.join(format!("{name}.stream")), c.join("stream")).unwrap();
        std::fs::write(
            c.join("verified"),
            format!("{}\n", sha256_hex(&c.join("stream"))),
        )
        .unwrap();
    }
    let (server, addr) = spawn_listening(
        agent()
            .arg("serve")
            .arg("--content-dir")
            .arg(&store)
            .arg("--listen")
            .arg("127.0.0.1:0"),
    );
    Fixture {
        dir,
        raw,
        cap,
        server,
        addr,
    }
}

/// Starts `cmd` and waits for the stderr line that names the address it
/// bound on 127.0.0.1; its later stderr is drained.
fn spawn_listening(cmd: &mut Command) -> (Child, SocketAddr) {
    let mut child = cmd
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let Some(Ok(line)) = lines.next() else {
            let _ = child.kill();
            panic!("{cmd:?} ended before naming its address");
        };
        if let Some(i) = line.find("127.0.0.1:") {
            let port: String = line[i + 10..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            break SocketAddr::from(([127, 0, 0, 1], port.parse::<u16>().unwrap()));
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (child, addr)
}

/// A plan for `target` with the contents at `http://addr`.
fn plan(f: &Fixture, addr: SocketAddr, target: &Path) -> serde_json::Value {
    let layout: serde_json::Value =
        serde_json::from_slice(&std::fs::read(f.cap.join("layout.json")).unwrap()).unwrap();
    let mut contents = Vec::new();
    for s in layout["slots"].as_array().unwrap() {
        let Some(name) = s["contentRef"].as_str() else {
            continue;
        };
        let stream = f.cap.join(format!("{name}.stream"));
        contents.push(serde_json::json!({
            "name": name,
            "slot": s["number"],
            "indexUrl": format!("http://{addr}/content/{NS}/{name}/index"),
            "streamUrl": format!("http://{addr}/content/{NS}/{name}/stream"),
            "indexSha256": sha256_hex(&f.cap.join(format!("{name}.index"))),
            "streamSha256": sha256_hex(&stream),
            "streamBytes": std::fs::metadata(&stream).unwrap().len(),
        }));
    }
    serde_json::json!({
        "runId": "m1-run-1",
        "disks": [{
            "image": "test",
            "os": true,
            "deviceName": target,
            "layout": layout,
            "contents": contents,
        }],
        "afterDeploy": "PowerOff",
        "progressIntervalSeconds": 1,
        "architecture": "x86_64",
    })
}

struct Deployed {
    ok: bool,
    lines: Vec<serde_json::Value>,
    stdout: String,
}

fn deploy(d: &Path, plan: &serde_json::Value, extra: &[&str]) -> Deployed {
    let p = d.join("plan.json");
    std::fs::write(&p, serde_json::to_vec(plan).unwrap()).unwrap();
    let out = agent()
        .arg("deploy")
        .arg("--plan")
        .arg(&p)
        .args(["--range-mib", "1", "--backoff-ms", "50", "--retries", "2"])
        .args(extra)
        // as in the initramfs: no CA certificate anywhere (the swarm's
        // HTTP client must still build)
        .env("SSL_CERT_FILE", d.join("no-ca-certificates.pem"))
        .env("SSL_CERT_DIR", d.join("no-ca-certificates"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    Deployed {
        ok: out.status.success(),
        lines,
        stdout,
    }
}

/// A local `anneal-agent restore` of the capture: the reference.
fn reference(f: &Fixture) -> Vec<u8> {
    let r = f.dir.path().join("reference.img");
    run(agent()
        .arg("restore")
        .arg(&r)
        .arg("--from")
        .arg(&f.cap)
        .arg("--size")
        .arg((64u64 << 20).to_string()));
    std::fs::read(r).unwrap()
}

/// A proxy in front of the content server that flips one byte of the
/// stream of content `p3` at `at` in every answer covering it, `times`
/// times (usize::MAX: always), or (`cut`) closes the connection just before
/// that byte. Counts what it did.
struct Proxy {
    addr: SocketAddr,
    corrupted: Arc<AtomicUsize>,
}

fn proxy(upstream: SocketAddr, at: u64, times: usize) -> Proxy {
    proxy_with(upstream, at, times, false)
}

fn proxy_with(upstream: SocketAddr, at: u64, times: usize, cut: bool) -> Proxy {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let corrupted = Arc::new(AtomicUsize::new(0));
    let count = corrupted.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let count = count.clone();
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if c.read(&mut b).unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(b[0]);
                }
                let text = String::from_utf8_lossy(&head).into_owned();
                let mut up = TcpStream::connect(upstream).unwrap();
                up.write_all(&head).unwrap();
                let mut resp = Vec::new();
                up.read_to_end(&mut resp).unwrap();
                let body_at = resp.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                let range_start = text
                    .lines()
                    .find_map(|l| l.strip_prefix("Range: bytes="))
                    .and_then(|r| r.split('-').next())
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .unwrap_or(0);
                let body_len = (resp.len() - body_at) as u64;
                if text.starts_with(&format!("GET /content/{NS}/p3/stream"))
                    && (range_start..range_start + body_len).contains(&at)
                    && count
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                            (n < times).then_some(n + 1)
                        })
                        .is_ok()
                {
                    let i = body_at + (at - range_start) as usize;
                    if cut {
                        resp.truncate(i);
                    } else {
                        resp[i] ^= 0xff;
                    }
                }
                let _ = c.write_all(&resp);
            });
        }
    });
    Proxy { addr, corrupted }
}

fn events<'a>(d: &'a Deployed, kind: &str) -> Vec<&'a serde_json::Value> {
    d.lines.iter().filter(|l| l["event"] == kind).collect()
}

#[test]
fn deploy_over_http_matches_a_local_restore() {
    let f = fixture();
    let target = f.dir.path().join("target.img");
    let out = deploy(f.dir.path(), &plan(&f, f.addr, &target), &[]);
    assert!(out.ok, "{}", out.stdout);
    let result = events(&out, "result");
    assert_eq!(result.len(), 1);
    let phases: Vec<&str> = result[0]["timings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["phase"].as_str().unwrap())
        .collect();
    assert_eq!(
        phases,
        [
            "Partitioning",
            "WritingContent",
            "Finalizing",
            "RunningPostHook"
        ]
    );
    // progress names both content partitions with their totals
    let last = *events(&out, "progress").last().unwrap();
    let parts = last["partitions"].as_array().unwrap();
    assert_eq!(parts.len(), 2);
    for p in parts {
        assert_eq!(p["bytesDone"], p["bytesTotal"], "{last}");
    }
    assert!(last["httpBytes"].as_u64().unwrap() > 6 << 20);
    // byte-identical to a local restore of the same capture
    let got = std::fs::read(&target).unwrap();
    let want = reference(&f);
    assert_eq!(got.len(), want.len());
    assert!(
        got == want,
        "the deployed disk differs from a local restore"
    );
    let v = run(Command::new("sgdisk").arg("-v").arg(&target));
    assert!(v.contains("No problems found"), "{v}");
    // the swap slot got its header back (blank slot of the layout)
    let sw = run(Command::new("blkid")
        .args(["-p", "-O"])
        .arg((18_432u64 * 512).to_string())
        .arg(&target));
    assert!(sw.contains("TYPE=\"swap\""), "{sw}");
}

#[test]
fn a_range_corrupted_once_is_fetched_again() {
    let f = fixture();
    // a byte inside piece 5 of the ext4 content
    let px = proxy(f.addr, 5 * PIECE + 1000, 1);
    let target = f.dir.path().join("target.img");
    let out = deploy(f.dir.path(), &plan(&f, px.addr, &target), &[]);
    assert!(out.ok, "{}", out.stdout);
    assert_eq!(px.corrupted.load(Ordering::SeqCst), 1);
    let retries: Vec<&str> = events(&out, "progress")
        .iter()
        .flat_map(|p| p["logLines"].as_array().unwrap())
        .filter_map(|l| l.as_str())
        .filter(|l| l.starts_with("retry:"))
        .collect();
    assert_eq!(retries.len(), 1, "{}", out.stdout);
    assert!(
        retries[0].contains("content p3 piece 5 ") && retries[0].contains("SHA-1"),
        "{}",
        retries[0]
    );
    assert!(std::fs::read(&target).unwrap() == reference(&f));
}

#[test]
fn a_range_cut_short_resumes_where_it_stopped() {
    let f = fixture();
    let px = proxy_with(f.addr, 9 * PIECE + 77, 1, true);
    let target = f.dir.path().join("target.img");
    let out = deploy(f.dir.path(), &plan(&f, px.addr, &target), &[]);
    assert!(out.ok, "{}", out.stdout);
    assert_eq!(px.corrupted.load(Ordering::SeqCst), 1);
    let retries: Vec<&str> = events(&out, "progress")
        .iter()
        .flat_map(|p| p["logLines"].as_array().unwrap())
        .filter_map(|l| l.as_str())
        .collect();
    assert_eq!(retries.len(), 1, "{}", out.stdout);
    assert!(
        retries[0].starts_with("retry: content p3 piece 9 ")
            && retries[0].contains("connection closed"),
        "{}",
        retries[0]
    );
    assert!(std::fs::read(&target).unwrap() == reference(&f));
}

#[test]
fn an_abort_stops_the_run_and_leaves_no_table() {
    use anneal_agent::deploy::{Control, DeployOptions, Phase, no_hooks, run_plan};
    let f = fixture();
    let target = f.dir.path().join("target.img");
    std::fs::copy(&f.raw, &target).unwrap();
    let p: anneal_api::agent::DeployPlan =
        serde_json::from_value(plan(&f, f.addr, &target)).unwrap();
    let opts = DeployOptions {
        allow_files: true,
        ..DeployOptions::default()
    };
    let mut seen = Vec::new();
    let mut report = |pr: &anneal_agent::deploy::Progress| {
        seen.push(pr.phase);
        if pr.phase == Phase::WritingContent {
            Control::Abort
        } else {
            Control::Continue
        }
    };
    let err = run_plan(&p, &opts, &mut report, &mut no_hooks).unwrap_err();
    assert_eq!(err.phase, Phase::WritingContent);
    assert!(err.wrote);
    assert!(
        err.reason()
            .contains("aborted by the manager during WritingContent"),
        "{}",
        err.reason()
    );
    assert_eq!(seen.last(), Some(&Phase::WritingContent));
    let mut t = std::fs::File::open(&target).unwrap();
    assert!(anneal_image::layout::read_layout(&mut t).is_err());
}

#[test]
fn a_range_corrupted_always_fails_naming_the_piece_and_leaves_no_table() {
    let f = fixture();
    let px = proxy(f.addr, 7 * PIECE + 3, usize::MAX);
    // the target starts as a valid, bootable-looking disk
    let target = f.dir.path().join("target.img");
    std::fs::copy(&f.raw, &target).unwrap();
    let out = deploy(f.dir.path(), &plan(&f, px.addr, &target), &[]);
    assert!(!out.ok, "{}", out.stdout);
    // first attempt and two retries
    assert_eq!(px.corrupted.load(Ordering::SeqCst), 3);
    let err = events(&out, "error");
    assert_eq!(err.len(), 1);
    let msg = err[0]["message"].as_str().unwrap();
    let (a, e) = (7 * PIECE, 8 * PIECE);
    assert!(
        msg.contains("content p3: piece 7 ")
            && msg.contains(&format!("stream bytes {a}..{e}"))
            && msg.contains("3 times"),
        "{msg}"
    );
    assert_eq!(err[0]["phase"], "WritingContent");
    assert_eq!(err[0]["diskInvalidated"], true);
    let mut t = std::fs::File::open(&target).unwrap();
    assert!(anneal_image::layout::read_layout(&mut t).is_err());
    let o = Command::new("blkid")
        .arg("-p")
        .arg(&target)
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains("PTTYPE"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn a_wrong_index_hash_is_refused_before_any_write() {
    let f = fixture();
    let target = f.dir.path().join("target.img");
    std::fs::copy(&f.raw, &target).unwrap();
    let before = std::fs::read(&target).unwrap();
    let mut p = plan(&f, f.addr, &target);
    let real = p["disks"][0]["contents"][1]["indexSha256"]
        .as_str()
        .unwrap()
        .to_string();
    let wrong = "ab".repeat(32);
    p["disks"][0]["contents"][1]["indexSha256"] = wrong.clone().into();
    let out = deploy(f.dir.path(), &p, &[]);
    assert!(!out.ok);
    let err = events(&out, "error");
    let msg = err[0]["message"].as_str().unwrap();
    assert!(
        msg.contains("content p3") && msg.contains(&real) && msg.contains(&wrong),
        "{msg}"
    );
    assert_eq!(err[0]["phase"], "Partitioning");
    assert_eq!(err[0]["diskInvalidated"], false);
    assert!(
        std::fs::read(&target).unwrap() == before,
        "the target was written"
    );
}

#[test]
fn wipe_leaves_no_table_and_no_signature() {
    let dir = base();
    let raw = make_disk(dir.path());
    let found = |offset: Option<u64>| {
        let mut c = Command::new("blkid");
        c.arg("-p");
        if let Some(o) = offset {
            c.arg("-O").arg(o.to_string());
        }
        let o = c.arg(&raw).output().unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let offsets = [2048u64 * 512, 18_432 * 512, 26_624 * 512];
    assert!(found(None).contains("PTTYPE=\"gpt\""));
    for (o, ty) in offsets.iter().zip(["vfat", "swap", "ext4"]) {
        assert!(found(Some(*o)).contains(&format!("TYPE=\"{ty}\"")));
    }
    let rep = anneal_agent::deploy::wipe(&raw).unwrap();
    assert_eq!(rep.partitions, 3);
    assert!(!rep.discarded);
    assert_eq!(found(None), "");
    for o in offsets {
        assert_eq!(found(Some(o)), "", "a signature is left at {o}");
    }
    let p = Command::new("sgdisk").arg("-p").arg(&raw).output().unwrap();
    let text = String::from_utf8_lossy(&p.stdout);
    assert!(
        text.contains("Creating new GPT entries") || !p.status.success(),
        "{text}"
    );
    let mut t = std::fs::File::open(&raw).unwrap();
    assert!(anneal_image::layout::read_layout(&mut t).is_err());
}

/// Detaches the loop device when dropped.
struct Loop(String);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

#[test]
fn wipe_of_a_loop_device_discards_and_asks_for_a_table_reread() {
    let dir = base();
    let raw = make_disk(dir.path());
    let dev = run(Command::new("losetup")
        .args(["-f", "--show", "-P"])
        .arg(&raw))
    .trim()
    .to_string();
    let lo = Loop(dev);
    let o = Command::new("blkid").arg("-p").arg(&lo.0).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("PTTYPE=\"gpt\""));
    let rep = anneal_agent::deploy::wipe(Path::new(&lo.0)).unwrap();
    assert!(rep.discarded, "{rep:?}");
    assert!(rep.reread, "{rep:?}");
    assert_eq!(rep.partitions, 3);
    let o = Command::new("blkid").arg("-p").arg(&lo.0).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout), "");
    for off in [2048u64 * 512, 18_432 * 512, 26_624 * 512] {
        let o = Command::new("blkid")
            .args(["-p", "-O"])
            .arg(off.to_string())
            .arg(&lo.0)
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&o.stdout), "", "at {off}");
    }
}

/// Gives every content of `plan` a swarm: `trackers`, a stall timeout of
/// `stall` seconds, the HTTP fallback when `fallback`; the agent listens on
/// any port and seeds until 3 s without upload.
fn with_swarm(
    plan: &mut serde_json::Value,
    f: &Fixture,
    trackers: &[String],
    stall: u32,
    fallback: bool,
) {
    use anneal_image::format::ContentIndex;
    use anneal_image::torrent::Metainfo;
    for c in plan["disks"][0]["contents"].as_array_mut().unwrap() {
        let name = c["name"].as_str().unwrap().to_string();
        let raw = std::fs::read(f.cap.join(format!("{name}.index"))).unwrap();
        let index = ContentIndex::parse(&raw).unwrap();
        c["swarm"] = serde_json::json!({
            "infoHash": Metainfo::from_index(&index, &name, None).info_hash_hex(),
            "trackers": trackers,
            "seederHosts": [],
            "listenPort": 0,
            "stallTimeoutSeconds": stall,
            "httpFallback": fallback,
        });
    }
    plan["seeding"] = serde_json::json!({"idleSeconds": 3, "maxSeconds": 60});
}

/// Kills a child process when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Two machines deploy the same plan at once through the swarm (a tracker,
/// a seeder capped at 1 MB/s): both disks equal a local restore, each
/// machine sent pieces to the other, and each seeded after writing.
#[test]
fn two_machines_deploy_at_once_through_the_swarm() {
    let f = fixture();
    let store = f.dir.path().join("store");
    let (tracker, taddr) =
        spawn_listening(agent().args(["tracker", "--listen", "127.0.0.1:0", "--interval", "2"]));
    let _tracker = Killed(tracker);
    let announce = format!("http://{taddr}/announce");
    let mut seeder = agent()
        .arg("seed")
        .arg("--content-dir")
        .arg(&store)
        .args([
            "--content",
            &format!("{NS}/p1"),
            "--content",
            &format!("{NS}/p3"),
        ])
        .args(["--listen", "0.0.0.0:0", "--tracker", &announce])
        .args(["--upload-bps", "1000000"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(seeder.stdout.take().unwrap()).lines();
    let _seeder = Killed(seeder);
    // synchronise on the seeder's line: both contents checked and served
    let line = out.next().unwrap().unwrap();
    assert!(line.contains("\"seeding\""), "{line}");
    std::thread::spawn(move || for _ in out {});

    let reference = reference(&f);
    let runs: Vec<Deployed> = std::thread::scope(|s| {
        let handles: Vec<_> = ["m1", "m2"]
            .iter()
            .map(|m| {
                let d = f.dir.path().join(m);
                std::fs::create_dir_all(&d).unwrap();
                let target = d.join("target.img");
                let mut p = plan(&f, f.addr, &target);
                with_swarm(&mut p, &f, std::slice::from_ref(&announce), 60, false);
                p["runId"] = format!("{m}-run-1").into();
                s.spawn(move || (deploy(&d, &p, &[]), target))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let (out, target) = h.join().unwrap();
                assert!(out.ok, "{}", out.stdout);
                assert!(
                    std::fs::read(&target).unwrap() == reference,
                    "{} differs from a local restore",
                    target.display()
                );
                out
            })
            .collect()
    });
    let used: u64 = ["p1", "p3"]
        .iter()
        .map(|n| {
            std::fs::metadata(f.cap.join(format!("{n}.stream")))
                .unwrap()
                .len()
        })
        .sum();
    let mut uploaded = 0;
    for out in &runs {
        let result = events(out, "result")[0];
        let t = &result["transfer"];
        println!("transfer: {t}");
        // every byte came from the swarm (peers: the seeder and the other
        // machine, all on 127.0.0.1), none over HTTP ranges
        assert!(t["peerBytes"].as_u64().unwrap() >= used, "{t}");
        assert!(t.get("fallbackReason").is_none(), "{t}");
        uploaded += t["uploadedBytes"].as_u64().unwrap();
        assert!(
            out.stdout.contains("seeding to the run's other machines"),
            "{}",
            out.stdout
        );
        assert!(
            out.stdout.contains("seeding stopped after"),
            "{}",
            out.stdout
        );
    }
    // the machines traded pieces (a seeder never downloads)
    assert!(uploaded > 0, "no machine sent the other a byte");
}

/// Deploys a plan whose swarm's tracker is down (its port closed), with a
/// 2 s stall timeout and the HTTP fallback when `fallback`.
fn deploy_with_tracker_down(fallback: bool) -> (Fixture, PathBuf, Deployed) {
    deploy_with_tracker_down_on(fallback, None)
}

/// [`deploy_with_tracker_down`], the agent listening on `port` when given.
fn deploy_with_tracker_down_on(fallback: bool, port: Option<u16>) -> (Fixture, PathBuf, Deployed) {
    let f = fixture();
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let target = f.dir.path().join("target.img");
    let mut p = plan(&f, f.addr, &target);
    with_swarm(
        &mut p,
        &f,
        &[format!("http://{closed}/announce")],
        2,
        fallback,
    );
    if let Some(port) = port {
        for c in p["disks"][0]["contents"].as_array_mut().unwrap() {
            c["swarm"]["listenPort"] = port.into();
        }
    }
    let out = deploy(f.dir.path(), &p, &[]);
    (f, target, out)
}

/// Checks a run that fell back to HTTP: it succeeded, the target equals a
/// local restore, and the result's `transfer.fallbackReason` contains
/// `reason`. Returns the result line.
fn fell_back<'a>(
    f: &Fixture,
    target: &Path,
    out: &'a Deployed,
    reason: &str,
) -> &'a serde_json::Value {
    assert!(out.ok, "{}", out.stdout);
    assert!(std::fs::read(target).unwrap() == reference(f));
    let result = events(out, "result")[0];
    let got = result["transfer"]["fallbackReason"]
        .as_str()
        .unwrap_or_default();
    assert!(got.contains(reason), "{result}");
    result
}

/// A swarm that cannot start (the port it must listen on is taken): the
/// content comes over HTTP ranges and the reason is in the run's figures.
#[test]
fn a_swarm_that_cannot_start_falls_back_to_http() {
    let taken = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let (f, target, out) = deploy_with_tracker_down_on(true, Some(port));
    fell_back(&f, &target, &out, "the BitTorrent session did not start");
    assert!(
        out.stdout
            .contains("content p1: HTTP fallback: the BitTorrent session did not start"),
        "{}",
        out.stdout
    );
    drop(taken);
}

/// The tracker is down from the start and no peer is known: after the
/// stall timeout the contents come over HTTP ranges, verified the same
/// way; the reason is in the run's transfer figures.
#[test]
fn tracker_down_at_start_the_http_fallback_completes_the_run() {
    let (f, target, out) = deploy_with_tracker_down(true);
    let result = fell_back(&f, &target, &out, "the swarm stalled: no piece for 2 s");
    assert!(result["httpBytes"].as_u64().unwrap() > 6 << 20, "{result}");
    assert!(
        out.stdout.contains("HTTP fallback after a stall"),
        "{}",
        out.stdout
    );
}

/// Without the HTTP fallback a stalled swarm fails the run, naming the
/// content, and the disk is left without a partition table.
#[test]
fn a_stalled_swarm_without_fallback_fails_and_leaves_no_table() {
    let (_fixture, target, out) = deploy_with_tracker_down(false);
    assert!(!out.ok, "{}", out.stdout);
    let err = events(&out, "error")[0];
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains(
            "content p1: fetching over BitTorrent failed: the swarm stalled: no piece for 2 s with 0 of"
        ) && msg.matches("stalled").count() == 1,
        "{err}"
    );
    assert_eq!(err["phase"], "WritingContent", "{err}");
    assert_eq!(err["diskInvalidated"], true, "{err}");
    let mut t = std::fs::File::open(&target).unwrap();
    assert!(anneal_image::layout::read_layout(&mut t).is_err());
}

/// Start and size of the partition of [`raw_disk`].
const RAW_AT: u64 = 1 << 20;
const RAW_LEN: u64 = 16 << 20;

/// A 24 MiB GPT disk with one partition no probe of anneal recognises
/// (pseudo-random runs of 12-28 KiB at the start of every 64 KiB, zeros
/// between them): captured raw, its gaps must read as zero on the target
/// (`FLAG_GAPS_ZERO`). Returns the disk and the partition's bytes.
fn raw_disk(d: &Path) -> (PathBuf, Vec<u8>) {
    use std::os::unix::fs::FileExt as _;
    let raw = d.join("raw-disk.img");
    std::fs::File::create(&raw)
        .unwrap()
        .set_len(24 << 20)
        .unwrap();
    run(Command::new("sgdisk")
        .args(["-o", "-n", "1:2048:+16M", "-t", "1:8300"])
        .arg(&raw));
    let mut part = vec![0u8; RAW_LEN as usize];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for (k, chunk) in part.chunks_mut(64 << 10).enumerate() {
        for b in &mut chunk[..(12 + 4 * (k % 5)) << 10] {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
    }
    std::fs::File::options()
        .write(true)
        .open(&raw)
        .unwrap()
        .write_all_at(&part, RAW_AT)
        .unwrap();
    (raw, part)
}

/// A raw-captured partition (`FLAG_GAPS_ZERO`) deployed over HTTP onto a
/// disk full of 0xFF: its slot equals the source partition byte for byte
/// (the gaps zeroed). The same plan with the slot 1 MiB smaller than the
/// content is refused before any write: the disk stays all 0xFF.
#[test]
fn a_raw_partition_over_http_zeroes_its_gaps_and_a_smaller_slot_is_refused() {
    let dir = base();
    let (raw, part) = raw_disk(dir.path());
    let f = served(dir, raw, &["p1"]);
    let index = std::fs::read(f.cap.join("p1.index")).unwrap();
    let index = anneal_image::format::ContentIndex::parse(&index).unwrap();
    assert_eq!(index.header.fs_type, "raw");
    assert_ne!(index.header.flags & anneal_image::format::FLAG_GAPS_ZERO, 0);
    let target = f.dir.path().join("target.img");
    std::fs::write(&target, vec![0xFFu8; 24 << 20]).unwrap();
    let out = deploy(f.dir.path(), &plan(&f, f.addr, &target), &[]);
    assert!(out.ok, "{}", out.stdout);
    let got = std::fs::read(&target).unwrap();
    let (a, b) = (RAW_AT as usize, (RAW_AT + RAW_LEN) as usize);
    assert!(
        got[a..b] == part[..],
        "the slot differs from the source partition (first at partition offset {:?})",
        got[a..b].iter().zip(&part).position(|(x, y)| x != y)
    );

    let target = f.dir.path().join("small.img");
    std::fs::write(&target, vec![0xFFu8; 24 << 20]).unwrap();
    let mut p = plan(&f, f.addr, &target);
    p["disks"][0]["layout"]["slots"][0]["sizeBytes"] = (RAW_LEN - (1 << 20)).into();
    let out = deploy(f.dir.path(), &p, &[]);
    assert!(!out.ok, "{}", out.stdout);
    let err = events(&out, "error")[0];
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("slot 1: content p1") && msg.contains("is larger than its slot"),
        "{err}"
    );
    let got = std::fs::read(&target).unwrap();
    assert!(got.iter().all(|x| *x == 0xFF), "the target was written");
}

/// The same raw partition through the swarm deploy onto a disk full of
/// 0xFF: its tracker is down, so after the stall every piece comes over the
/// swarm's HTTP fallback and is written by the swarm's writer; the slot
/// equals the source partition byte for byte (the gaps zeroed).
#[test]
fn a_raw_partition_through_the_swarm_deploy_zeroes_its_gaps() {
    let dir = base();
    let (raw, part) = raw_disk(dir.path());
    let f = served(dir, raw, &["p1"]);
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let target = f.dir.path().join("target.img");
    std::fs::write(&target, vec![0xFFu8; 24 << 20]).unwrap();
    let mut p = plan(&f, f.addr, &target);
    with_swarm(&mut p, &f, &[format!("http://{closed}/announce")], 2, true);
    let out = deploy(f.dir.path(), &p, &[]);
    assert!(out.ok, "{}", out.stdout);
    let result = events(&out, "result")[0];
    let reason = result["transfer"]["fallbackReason"]
        .as_str()
        .unwrap_or_default();
    assert!(reason.contains("stalled"), "{result}");
    let got = std::fs::read(&target).unwrap();
    let (a, b) = (RAW_AT as usize, (RAW_AT + RAW_LEN) as usize);
    assert!(
        got[a..b] == part[..],
        "the slot differs from the source partition (first at partition offset {:?})",
        got[a..b].iter().zip(&part).position(|(x, y)| x != y)
    );
}
