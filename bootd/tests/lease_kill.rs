//! Leases that survive: the bootd binary in lease mode answers DORAs from
//! a windowed client in another network namespace and is killed with
//! SIGKILL (by PID) at random points; after each kill the lease file it
//! leaves (what a restarted bootd loads) holds every address ACKed before
//! the kill, for the same MAC, and a bootd restarted on it reports them.
//!
//! Synchronisation is on events only: bootd's "bootd serving" log line,
//! ACKs received by the client, the child's exit.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anneal_bootd::in_netns;
use anneal_dhcp::Mac;
use anneal_testinfra::ChildGroup;
use anneal_testinfra::Netns;
use common::{ANSWER_ALL_YAML, SERVER, client_socket, dhcp_packet, parse_reply, topology};

mod common;

fn write_config(dir: &Path) -> PathBuf {
    let p = dir.join("bootd.yaml");
    std::fs::write(&p, ANSWER_ALL_YAML).unwrap();
    p
}

/// A running bootd binary and its log.
struct Bootd {
    child: ChildGroup,
    log: PathBuf,
}

/// Starts the bootd binary in `ns` and waits for its "bootd serving" line.
fn start_bootd(ns: &Netns, dir: &Path, run: usize, http_port: u16) -> Bootd {
    let log = dir.join(format!("bootd-{run}.log"));
    let mut cmd = ns.exec(env!("CARGO_BIN_EXE_bootd"));
    cmd.arg("--config")
        .arg(dir.join("bootd.yaml"))
        .args(["--interface", "s0", "--listen-ip", "10.88.0.1"])
        .args(["--pxe-port", "0", "--tftp-port", "0"])
        .args(["--http-port", &http_port.to_string()])
        .arg("--lease-file")
        .arg(dir.join("leases.json"))
        // one line per packet would dominate the run
        .env("RUST_LOG", "info,anneal_bootd::dhcp=warn");
    let mut child = ChildGroup::spawn_logged("bootd", &mut cmd, &log).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("bootd serving") {
            break;
        }
        if let Some(st) = child.try_exit() {
            panic!("bootd run {run} exited ({st}) before serving:\n{text}");
        }
        assert!(
            Instant::now() < deadline,
            "bootd run {run} did not print `bootd serving` within 60 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Bootd { child, log }
}

fn mac_of(i: u32) -> [u8; 6] {
    let b = i.to_be_bytes();
    [0x02, 0x4b, b[0], b[1], b[2], b[3]]
}

fn packet(i: u32, msg: u8, extra: &[u8]) -> Vec<u8> {
    // broadcast flag: answers to 255.255.255.255:68
    dhcp_packet(mac_of(i), i, true, msg, extra)
}

/// DORAs from MACs `first..` with up to `WINDOW` in flight until `stop`,
/// then the ACKs still in flight are read for a while; returns every
/// (MAC index, address) ACKed. `acked` counts ACKs as they arrive.
fn doras(first: u32, stop: &AtomicBool, acked: &AtomicUsize) -> Vec<(u32, Ipv4Addr)> {
    const WINDOW: usize = 48;
    let sock = client_socket("c0", Duration::from_millis(10));
    let to = SocketAddr::from(([255, 255, 255, 255], 67));
    // index -> (REQUEST sent for this address, last send)
    let mut flight: HashMap<u32, (Option<Ipv4Addr>, Instant)> = HashMap::new();
    let mut next = first;
    let mut got = Vec::new();
    let mut buf = [0u8; 1500];
    let mut drain_until: Option<Instant> = None;
    loop {
        if drain_until.is_none() && stop.load(Ordering::SeqCst) {
            // bootd is dead: what it sent before is still arriving
            drain_until = Some(Instant::now() + Duration::from_millis(500));
        }
        if drain_until.is_some_and(|t| Instant::now() > t) {
            return got;
        }
        if drain_until.is_none() {
            while flight.len() < WINDOW {
                let _ = sock.send_to(&packet(next, 1, &[]), to);
                flight.insert(next, (None, Instant::now()));
                next += 1;
            }
            // retransmit what got no answer (a datagram lost under load)
            for (i, (req, at)) in flight.iter_mut() {
                if at.elapsed() > Duration::from_millis(500) {
                    let p = match req {
                        None => packet(*i, 1, &[]),
                        Some(a) => request(*i, *a),
                    };
                    let _ = sock.send_to(&p, to);
                    *at = Instant::now();
                }
            }
        }
        let Ok(n) = sock.recv(&mut buf) else { continue };
        let Some((xid, ty, yi)) = parse_reply(&buf[..n]) else {
            continue;
        };
        let Some(state) = flight.get_mut(&xid) else {
            continue;
        };
        match (ty, state.0) {
            (2, None) if drain_until.is_none() => {
                let _ = sock.send_to(&request(xid, yi), to);
                *state = (Some(yi), Instant::now());
            }
            (5, Some(a)) => {
                assert_eq!(a, yi, "ACK for mac index {xid} names another address");
                flight.remove(&xid);
                got.push((xid, yi));
                acked.fetch_add(1, Ordering::SeqCst);
            }
            // NAK: another MAC in flight was offered the same address and
            // took it first; start over, as a client does
            (6, Some(_)) if drain_until.is_none() => {
                let _ = sock.send_to(&packet(xid, 1, &[]), to);
                *state = (None, Instant::now());
            }
            _ => {}
        }
    }
}

fn request(i: u32, addr: Ipv4Addr) -> Vec<u8> {
    let mut o = vec![50, 4];
    o.extend_from_slice(&addr.octets());
    o.extend_from_slice(&[54, 4]);
    o.extend_from_slice(&SERVER.octets());
    packet(i, 3, &o)
}

/// `GET /metrics` inside bootd's namespace.
fn metrics(server: &Netns, port: u16) -> String {
    in_netns(server.name(), move || {
        let mut s = std::net::TcpStream::connect((SERVER, port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bootd\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    })
    .unwrap()
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}")) as u64
}

/// A small xorshift, seeded from the clock (printed, so a failure can be
/// replayed with `LEASE_KILL_SEED`).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn acked_leases_survive_sigkill() {
    let seed = std::env::var("LEASE_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("LEASE_KILL_SEED={seed}");
    let mut rng = Rng(seed);
    let (server, client) = topology("bdk");
    let dir = server.dir();
    write_config(&dir);
    let port = anneal_testinfra::free_port().unwrap();
    let lease_file = dir.join("leases.json");
    const KILLS: usize = 5;
    const TOTAL: u64 = 10_000;
    let started = Instant::now();
    // every (MAC, address) ACKed so far, over all runs
    let mut acked_all: BTreeMap<Mac, Ipv4Addr> = BTreeMap::new();
    let mut lost_report = Vec::new();
    for run in 0..KILLS {
        let mut bootd = start_bootd(&server, &dir, run, port);
        // a random kill point, 0.5 to 1.5 times TOTAL / KILLS ACKs into the
        // run; the last run makes up the rest, so TOTAL are ACKed in all
        let per = TOTAL / KILLS as u64;
        let target = if run + 1 < KILLS {
            (per / 2 + rng.below(per)) as usize
        } else {
            (TOTAL as usize)
                .saturating_sub(acked_all.len())
                .max(per as usize / 2)
        };
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(AtomicUsize::new(0));
        let (s, a) = (stop.clone(), acked.clone());
        let first = (run as u32 + 1) * 1_000_000;
        let name = client.name().to_owned();
        let worker = std::thread::spawn(move || in_netns(&name, move || doras(first, &s, &a)));
        let deadline = Instant::now() + Duration::from_secs(60);
        while acked.load(Ordering::SeqCst) < target {
            if Instant::now() > deadline || bootd.child.try_exit().is_some() {
                stop.store(true, Ordering::SeqCst);
                panic!(
                    "run {run}: {} of {target} ACKs within 60 s; bootd log:\n{}",
                    acked.load(Ordering::SeqCst),
                    std::fs::read_to_string(&bootd.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // SIGKILL by PID (the process group bootd leads), then reaped
        bootd.child.kill();
        stop.store(true, Ordering::SeqCst);
        let got = worker.join().unwrap().unwrap();
        for (i, a) in &got {
            acked_all.insert(Mac(mac_of(*i)), *a);
        }
        // what a restarted bootd loads
        let persisted: BTreeMap<Mac, Ipv4Addr> = anneal_bootd::leasefile::load(&lease_file)
            .unwrap()
            .into_iter()
            .map(|l| (l.mac, l.address))
            .collect();
        let lost: Vec<_> = acked_all
            .iter()
            .filter(|(m, a)| persisted.get(m) != Some(a))
            .collect();
        eprintln!(
            "run {run}: killed after {} ACKs ({} ACKed in all), {} persisted, {} ACKed leases lost",
            got.len(),
            acked_all.len(),
            persisted.len(),
            lost.len()
        );
        if !lost.is_empty() {
            lost_report.push(format!(
                "run {run}: {} of {} ACKed leases not in the lease file after SIGKILL, e.g. {:?}",
                lost.len(),
                acked_all.len(),
                &lost[..lost.len().min(3)]
            ));
        }
    }
    assert!(
        lost_report.is_empty(),
        "ACKed leases lost (seed {seed}):\n{}",
        lost_report.join("\n")
    );
    // a bootd restarted on the file holds them all
    let bootd = start_bootd(&server, &dir, KILLS, port);
    let m = metrics(&server, port);
    let active = metric(&m, "bootd_dhcp_leases_active");
    assert!(
        active >= acked_all.len() as u64,
        "restarted bootd holds {active} leases, {} were ACKed",
        acked_all.len()
    );
    assert_eq!(metric(&m, "bootd_lease_file_durable"), 1, "{m}");
    drop(bootd);
    eprintln!(
        "{} DORAs ACKed over {KILLS} SIGKILLs in {:.1} s",
        acked_all.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(acked_all.len() as u64 >= TOTAL);
}

/// One DORA from `mac` (broadcast flag set); the ACKed address.
fn one_dora(mac: [u8; 6], xid: u32) -> Option<Ipv4Addr> {
    let sock = client_socket("c0", Duration::from_millis(100));
    let to = SocketAddr::from(([255, 255, 255, 255], 67));
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = [0u8; 1500];
    let mut offered = None;
    let mut sent = Instant::now() - Duration::from_secs(10);
    while Instant::now() < deadline {
        if sent.elapsed() > Duration::from_secs(1) {
            let p = match offered {
                None => dhcp_packet(mac, xid, true, 1, &[]),
                Some(a) => {
                    let mut o = vec![50, 4];
                    o.extend_from_slice(&Ipv4Addr::octets(&a));
                    o.extend_from_slice(&[54, 4]);
                    o.extend_from_slice(&SERVER.octets());
                    dhcp_packet(mac, xid, true, 3, &o)
                }
            };
            sock.send_to(&p, to).unwrap();
            sent = Instant::now();
        }
        let Ok(n) = sock.recv(&mut buf) else { continue };
        match parse_reply(&buf[..n]) {
            Some((x, 2, yi)) if x == xid && offered.is_none() => {
                offered = Some(yi);
                sent = Instant::now() - Duration::from_secs(10);
            }
            Some((x, 5, yi)) if x == xid && offered == Some(yi) => return Some(yi),
            _ => {}
        }
    }
    None
}

/// A lease file that cannot be written at start-up (its temporary file's
/// path is taken by a directory) does not keep DHCP down: bootd starts,
/// ACKs from memory (counted), and once the path is free the retry timer
/// writes every lease and ACKs are durable again.
#[test]
fn unwritable_lease_file_at_startup_serves_from_memory_then_recovers() {
    let (server, client) = topology("bdw");
    let dir = server.dir();
    let lease_file = dir.join("leases.json");
    let obstacle = dir.join("leases.json.tmp");
    std::fs::create_dir(&obstacle).unwrap();
    std::fs::write(obstacle.join("x"), b"x").unwrap();
    let snap = anneal_bootd::StaticConfig::from_yaml(ANSWER_ALL_YAML)
        .unwrap()
        .snapshot(8080, "rev-1".into())
        .unwrap();
    let srv = anneal_bootd::NetnsServer::start(
        server.name(),
        anneal_bootd::ServerOptions {
            interface: Some("s0".into()),
            listen_ip: SERVER,
            pxe_port: 0,
            tftp_port: 0,
            http_port: anneal_testinfra::free_port().unwrap(),
            lease_file: Some(lease_file.clone()),
            ..anneal_bootd::ServerOptions::default()
        },
        snap,
    )
    .unwrap_or_else(|e| {
        panic!(
            "bootd did not start with an unwritable lease file: {}",
            anneal_api::error_chain(&e)
        )
    });
    let m1 = [0x02, 0x57, 0, 0, 0, 1];
    let name = client.name().to_owned();
    let a1 = in_netns(&name, move || one_dora(m1, 0x0d00_0001))
        .unwrap()
        .unwrap_or_else(|| panic!("no ACK from memory:\n{}", srv.shared().metrics.render()));
    let text = srv.shared().metrics.render();
    assert_eq!(metric(&text, "bootd_lease_file_durable"), 0, "{text}");
    assert!(
        metric(&text, "bootd_dhcp_acks_not_durable_total") >= 1,
        "{text}"
    );
    assert!(
        metric(&text, "bootd_lease_file_write_failures_total") >= 1,
        "{text}"
    );
    std::fs::remove_dir_all(&obstacle).unwrap();
    // the retry timer (1 s) writes the table: wait for the file to hold it
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let held = anneal_bootd::leasefile::load(&lease_file)
            .unwrap()
            .iter()
            .any(|l| l.mac == Mac(m1) && l.address == a1);
        if held {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lease ACKed from memory was not written within 30 s of the path being freed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let m2 = [0x02, 0x57, 0, 0, 0, 2];
    let a2 = in_netns(&name, move || one_dora(m2, 0x0d00_0002))
        .unwrap()
        .expect("no ACK once the lease file works");
    // durable: written before the ACK left
    assert!(
        anneal_bootd::leasefile::load(&lease_file)
            .unwrap()
            .iter()
            .any(|l| l.mac == Mac(m2) && l.address == a2)
    );
    let text = srv.shared().metrics.render();
    assert_eq!(metric(&text, "bootd_lease_file_durable"), 1, "{text}");
    srv.stop();
}
