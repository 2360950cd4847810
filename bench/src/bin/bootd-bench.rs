//! bootd benchmark: DHCP (perfdhcp against bootd, dnsmasq and Kea memfile) and
//! TFTP (atftp against bootd, tftpd-hpa and dnsmasq; plain veth and a path
//! with 1 ms added each way by a user-space UDP delay relay), all inside a
//! namespace this program creates and deletes. Prints ratios against the
//! references measured in the same run; writes target/bench/bootd.json.
//!
//! Run as root: `cargo run --release -p anneal-bench --bin bootd-bench [-- --quick]`
//! (`--help` lists the options).
#![cfg_attr(test, allow(clippy::too_many_lines))]

use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anneal_bench::{ChildGroup, Netns, median};
use anneal_bootd::{NetnsServer, ServerOptions, StaticConfig, in_netns};
use anyhow::{Context, bail};

const SERVER: &str = "10.88.0.1";

/// The server namespace (`s0`, 10.88.0.1) and a client namespace (`c0`,
/// 10.88.255.254, and the delay relay on its loopback) joined by a veth
/// pair: clients (perfdhcp, atftp) must not share port 67 with the servers.
/// Both are the tests' [`Netns`]: dropping them deletes the namespaces.
struct Ns {
    server: Netns,
    client: Netns,
}

impl Ns {
    fn create() -> anyhow::Result<Ns> {
        let server = Netns::bare("annealbs")?;
        let client = Netns::bare("annealbc")?;
        server.link(&client, "s0", "10.88.0.1/16", "c0", "10.88.255.254/16")?;
        Ok(Ns { server, client })
    }
    /// `ip -n <server> <args>`.
    fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        self.server.ip(args)
    }
    /// `prog` in the server namespace.
    fn exec(&self, prog: &str) -> Command {
        self.server.exec(prog)
    }
    /// `prog` in the client namespace.
    fn cexec(&self, prog: &str) -> Command {
        self.client.exec(prog)
    }
}

/// Starts daemon `name` in its own process group (killed with the group on
/// drop), output to `log`, and gives it 700 ms to bind its sockets.
fn spawn(name: &str, c: &mut Command, log: &Path) -> anyhow::Result<ChildGroup> {
    let child = ChildGroup::spawn_logged(name, c, log)?;
    std::thread::sleep(Duration::from_millis(700));
    Ok(child)
}

fn bootd_yaml(dir: &Path) -> String {
    format!(
        "serverIP: {SERVER}\ncidr: 10.88.0.0/16\n\
         dhcp: {{mode: lease, gateway: \"\", leaseTime: 1h, leaseRange: {{start: 10.88.1.0, end: 10.88.250.250}}}}\n\
         answerAll: true\nfiles: {{f1m: {d}/f1m, f8m: {d}/f8m}}\n",
        d = dir.display()
    )
}

/// bootd answering DHCP on s0 and TFTP/HTTP on `listen`.
fn start_bootd(ns: &Ns, dir: &Path, listen: &str) -> anyhow::Result<NetnsServer> {
    let _ = std::fs::remove_file(dir.join("bootd.leases"));
    let snap = StaticConfig::from_yaml(&bootd_yaml(dir))?.snapshot(18080, "bench".into())?;
    Ok(NetnsServer::start(
        ns.server.name(),
        ServerOptions {
            interface: Some("s0".into()),
            listen_ip: listen.parse()?,
            http_port: 18080,
            // --bootd-no-lease-file: diagnosis only (what the lease file costs)
            lease_file: (!anneal_bench::flag("--bootd-no-lease-file"))
                .then(|| dir.join("bootd.leases")),
            ..ServerOptions::default()
        },
        snap,
    )?)
}

/// dnsmasq with DHCP on s0 (`Some(ping_check)`) or TFTP on one address.
fn start_dnsmasq(
    ns: &Ns,
    dir: &Path,
    dhcp: Option<bool>,
    tftp: Option<&str>,
) -> anyhow::Result<ChildGroup> {
    let mut c = ns.exec("dnsmasq");
    c.args([
        "--keep-in-foreground",
        "--port=0",
        "--bind-interfaces",
        "--log-facility=-",
    ])
    .arg(format!("--pid-file={}/dnsmasq.pid", dir.display()));
    match tftp {
        Some(addr) => c.arg(format!("--listen-address={addr}")),
        None => c.arg("--interface=s0"),
    };
    if let Some(ping_check) = dhcp {
        if !ping_check {
            c.args(["--no-ping", "--quiet-dhcp"]);
        }
        c.args([
            "--dhcp-range=10.88.1.0,10.88.250.250,1h",
            "--dhcp-lease-max=100000",
        ])
        .arg(format!("--dhcp-leasefile={}/dnsmasq.leases", dir.display()));
        let _ = std::fs::remove_file(dir.join("dnsmasq.leases"));
    }
    if tftp.is_some() {
        c.arg("--enable-tftp")
            .arg(format!("--tftp-root={}", dir.display()));
    }
    spawn("dnsmasq", &mut c, &dir.join("dnsmasq.log"))
}

fn start_kea(ns: &Ns, dir: &Path) -> anyhow::Result<ChildGroup> {
    std::fs::create_dir_all("/run/kea")?;
    let leases = dir.join("kea-leases.csv");
    let _ = std::fs::remove_file(&leases);
    let conf = dir.join("kea.json");
    std::fs::write(
        &conf,
        format!(
            r#"{{"Dhcp4": {{
  "interfaces-config": {{"interfaces": ["s0"], "dhcp-socket-type": "raw"}},
  "multi-threading": {{"enable-multi-threading": false}},
  "lease-database": {{"type": "memfile", "persist": true, "name": "{}", "lfc-interval": 0}},
  "valid-lifetime": 3600,
  "subnet4": [{{"subnet": "10.88.0.0/16", "id": 1, "pools": [{{"pool": "10.88.1.0 - 10.88.250.250"}}]}}],
  "loggers": [{{"name": "kea-dhcp4", "severity": "WARN", "output_options": [{{"output": "stderr"}}]}}]
}}}}"#,
            leases.display()
        ),
    )?;
    let mut c = ns.exec("kea-dhcp4");
    c.arg("-c").arg(&conf);
    spawn("kea-dhcp4", &mut c, &dir.join("kea.log"))
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
struct DhcpRun {
    offered: u32,
    rate: f64,
    drops_pct: f64,
    avg_ms: f64,
    max_ms: f64,
}

/// One perfdhcp run at `rate` for `secs`: achieved DORA/s, drop %, delays.
fn perfdhcp(ns: &Ns, rate: u32, secs: u32) -> anyhow::Result<DhcpRun> {
    let o = ns
        .cexec("perfdhcp")
        .args(["-4", "-l", "c0", "-R", "1000000"])
        .arg(format!("-r{rate}"))
        .arg(format!("-p{secs}"))
        .output()?;
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    let mut sent = [0f64; 2];
    let mut drops = [0f64; 2];
    let mut avg = 0.0;
    let mut max: f64 = 0.0;
    let mut rate_out = 0.0;
    let mut section = None;
    let num = |l: &str| -> f64 {
        l.split(':')
            .nth(1)
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    for l in text.lines() {
        let t = l.trim();
        if t.contains("DISCOVER-OFFER") {
            section = Some(0);
        } else if t.contains("REQUEST-ACK") {
            section = Some(1);
        }
        if t.starts_with("Rate:") {
            rate_out = num(t);
        }
        if let Some(s) = section {
            if t.starts_with("sent packets:") {
                sent[s] = num(t);
            } else if t.starts_with("drops:") {
                drops[s] = num(t);
            } else if t.starts_with("avg delay:") {
                avg += num(t);
            } else if t.starts_with("max delay:") {
                max = max.max(num(t));
            }
        }
    }
    if sent[0] == 0.0 {
        bail!("perfdhcp produced no report:\n{text}");
    }
    Ok(DhcpRun {
        offered: rate,
        rate: rate_out,
        drops_pct: 100.0 * (drops[0] + drops[1]) / (sent[0] + sent[1]).max(1.0),
        avg_ms: avg,
        max_ms: max,
    })
}

/// Drops limit of Kea's method.
const DROPS_LIMIT: f64 = 2.5;

/// One perfdhcp run on a fresh server; a run that fails to produce a report
/// counts as 100 % drops (and is printed), it does not end the program.
fn dhcp_point(
    ns: &Ns,
    name: &str,
    rate: u32,
    secs: u32,
    restart: &mut dyn FnMut() -> anyhow::Result<()>,
) -> DhcpRun {
    let run = restart().and_then(|()| perfdhcp(ns, rate, secs));
    match run {
        Ok(run) => {
            println!(
                "  {name:8} offered {rate:6}/s -> {:8.0} DORA/s, drops {:6.2} %, avg {:.2} ms, max {:.1} ms",
                run.rate, run.drops_pct, run.avg_ms, run.max_ms
            );
            run
        }
        Err(e) => {
            println!("  {name:8} offered {rate:6}/s -> failed: {e:#}");
            DhcpRun {
                offered: rate,
                rate: 0.0,
                drops_pct: 100.0,
                avg_ms: f64::NAN,
                max_ms: f64::NAN,
            }
        }
    }
}

/// The next rate of one server's sweep (Kea's method: the best achieved
/// rate with drops under 2.5 %), from the highest good and lowest bad
/// offered rate so far: rates double from 250/s until drops reach the limit
/// (or halve until they do not), then the knee is bisected until the step
/// is under `resolution` of the rate. `None`: the sweep is done.
fn next_rate(good: Option<u32>, bad: Option<u32>, resolution: f64) -> Option<u32> {
    match (good, bad) {
        (None, None) => Some(250),
        (Some(g), None) => (g < 32_000).then_some(g * 2),
        (None, Some(b)) => (b >= 20).then_some(b / 2),
        (Some(g), Some(b)) => {
            if f64::from(b.saturating_sub(g)) <= (resolution * f64::from(g)).max(10.0) {
                return None;
            }
            let unit = if g >= 1000 { 50 } else { 5 };
            let m = (g + b) / 2 / unit * unit;
            (m > g).then_some(m)
        }
    }
}

/// One server's sweep so far.
struct Sweep {
    name: &'static str,
    good: Option<u32>,
    bad: Option<u32>,
    all: Vec<DhcpRun>,
}

impl Sweep {
    fn best(&self) -> Option<DhcpRun> {
        self.all
            .iter()
            .filter(|r| r.drops_pct < DROPS_LIMIT)
            .copied()
            .max_by(|a, b| a.rate.total_cmp(&b.rate))
    }
}

/// Sweeps every server at once, one rate of each in turn (so that load from
/// other work on the machine falls on all of them alike), a fresh server
/// per rate.
fn sweep_all(ns: &Ns, d: &Path, names: &[&'static str], secs: u32, resolution: f64) -> Vec<Sweep> {
    let mut sweeps: Vec<Sweep> = names
        .iter()
        .map(|&name| Sweep {
            name,
            good: None,
            bad: None,
            all: Vec::new(),
        })
        .collect();
    loop {
        let mut ran = false;
        for sw in &mut sweeps {
            let Some(rate) = next_rate(sw.good, sw.bad, resolution) else {
                continue;
            };
            ran = true;
            let mut holder: Option<Box<dyn std::any::Any>> = None;
            let mut restart = || -> anyhow::Result<()> {
                holder = Some(start_dhcp_server(ns, d, sw.name)?);
                Ok(())
            };
            let run = dhcp_point(ns, sw.name, rate, secs, &mut restart);
            drop(holder);
            sw.all.push(run);
            if run.drops_pct < DROPS_LIMIT {
                sw.good = Some(sw.good.map_or(rate, |g| g.max(rate)));
            } else {
                sw.bad = Some(sw.bad.map_or(rate, |b| b.min(rate)));
            }
        }
        if !ran {
            return sweeps;
        }
    }
}

fn dhcp_packet(mac: [u8; 6], xid: u32, msg: u8, extra: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 240];
    p[0] = 1;
    p[1] = 1;
    p[2] = 6;
    p[4..8].copy_from_slice(&xid.to_be_bytes());
    p[10] = 0x80; // broadcast flag
    p[28..34].copy_from_slice(&mac);
    p[236..240].copy_from_slice(&[99, 130, 83, 99]);
    p.extend_from_slice(&[53, 1, msg]);
    p.extend_from_slice(extra);
    p.push(255);
    p
}

/// Sequential DORA exchanges from one socket on c0 for `dur`: per-exchange
/// latency percentiles (ms) and the number of exchanges that timed out.
fn dora_latency(ns: &Ns, dur: Duration) -> anyhow::Result<(usize, f64, f64, usize)> {
    let r = in_netns(
        ns.client.name(),
        move || -> std::io::Result<(usize, f64, f64, usize)> {
            use socket2::{Domain, Protocol, Socket, Type};
            let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
            s.set_reuse_address(true)?;
            s.set_broadcast(true)?;
            s.bind_device(Some(b"c0"))?;
            s.bind(&SocketAddr::from(([0, 0, 0, 0], 68)).into())?;
            s.set_read_timeout(Some(Duration::from_millis(200)))?;
            let sock: std::net::UdpSocket = s.into();
            let to = SocketAddr::from(([255, 255, 255, 255], 67));
            let mut lat = Vec::new();
            let mut lost = 0usize;
            let mut buf = [0u8; 1500];
            let end = Instant::now() + dur;
            let mut i: u32 = 0;
            let wait = |xid: u32, want: u8, buf: &mut [u8]| -> Option<([u8; 4], [u8; 4])> {
                let deadline = Instant::now() + Duration::from_millis(200);
                while Instant::now() < deadline {
                    let Ok(n) = sock.recv(buf) else { return None };
                    if n < 244 || buf[4..8] != xid.to_be_bytes() {
                        continue;
                    }
                    let yi = [buf[16], buf[17], buf[18], buf[19]];
                    let mut sid = [0u8; 4];
                    let mut k = 240;
                    let mut ty = 0;
                    while k + 1 < n && buf[k] != 255 {
                        if buf[k] == 0 {
                            k += 1;
                            continue;
                        }
                        let l = buf[k + 1] as usize;
                        if buf[k] == 53 && l == 1 && k + 2 < n {
                            ty = buf[k + 2];
                        }
                        if buf[k] == 54 && l == 4 && k + 6 <= n {
                            sid.copy_from_slice(&buf[k + 2..k + 6]);
                        }
                        k += 2 + l;
                    }
                    if ty == want {
                        return Some((yi, sid));
                    }
                }
                None
            };
            while Instant::now() < end {
                i += 1;
                let mac = [
                    0x02,
                    0x42,
                    (i >> 24) as u8,
                    (i >> 16) as u8,
                    (i >> 8) as u8,
                    i as u8,
                ];
                let xid = 0x5000_0000 | i;
                let t = Instant::now();
                sock.send_to(&dhcp_packet(mac, xid, 1, &[]), to)?;
                let Some((yi, sid)) = wait(xid, 2, &mut buf) else {
                    lost += 1;
                    continue;
                };
                let mut opts = vec![50, 4];
                opts.extend_from_slice(&yi);
                opts.extend_from_slice(&[54, 4]);
                opts.extend_from_slice(&sid);
                sock.send_to(&dhcp_packet(mac, xid, 3, &opts), to)?;
                if wait(xid, 5, &mut buf).is_none() {
                    lost += 1;
                    continue;
                }
                lat.push(t.elapsed().as_secs_f64() * 1e3);
            }
            lat.sort_by(f64::total_cmp);
            let pct = |q: f64| {
                lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1)))
                    .copied()
                    .unwrap_or(f64::NAN)
            };
            Ok((lat.len(), pct(0.5), pct(0.99), lost))
        },
    )??;
    Ok(r)
}

/// Sleeps until `at`: a kernel sleep to shortly before it, then spinning
/// (tokio's and the kernel's timer slack add 50 us..1 ms otherwise).
fn sleep_until(at: Instant) {
    loop {
        let now = Instant::now();
        if now >= at {
            return;
        }
        let left = at - now;
        if left > Duration::from_micros(300) {
            std::thread::sleep(left - Duration::from_micros(200));
        } else {
            std::hint::spin_loop();
        }
    }
}

/// How late the relay delivered datagrams (microseconds past their deadline).
#[derive(Debug, Default)]
struct Lateness(Vec<u32>);

impl Lateness {
    fn summary(&mut self) -> (usize, f64, u32, u32) {
        let v = &mut self.0;
        v.sort_unstable();
        let n = v.len();
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n.max(1) as f64;
        let p99 = v.get(n * 99 / 100).copied().unwrap_or(0);
        let max = v.last().copied().unwrap_or(0);
        (n, mean, p99, max)
    }
}

/// One direction of the relay: datagrams leave `delay` after they arrived.
fn delay_line(
    stop: Arc<AtomicBool>,
    rx: std::sync::mpsc::Receiver<(Instant, Vec<u8>)>,
    sock: Arc<UdpSocket>,
    to: Arc<Mutex<SocketAddr>>,
    late: Arc<Mutex<Lateness>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut mine = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let Ok((at, p)) = rx.recv_timeout(Duration::from_millis(50)) else {
                continue;
            };
            sleep_until(at);
            let dest = to.lock().map(|g| *g);
            if let Ok(dest) = dest {
                let _ = sock.send_to(&p, dest);
            }
            mine.push(at.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
        }
        if let Ok(mut l) = late.lock() {
            l.0.extend(mine);
        }
    })
}

/// Copies datagrams arriving on `sock` into a delay line; `from` (if given)
/// learns the sender (the server's transfer port).
fn receiver(
    stop: Arc<AtomicBool>,
    sock: Arc<UdpSocket>,
    tx: std::sync::mpsc::Sender<(Instant, Vec<u8>)>,
    delay: Duration,
    from: Option<Arc<Mutex<SocketAddr>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut b = vec![0u8; 65536];
        while !stop.load(Ordering::Relaxed) {
            let Ok((n, src)) = sock.recv_from(&mut b) else {
                continue;
            };
            let at = Instant::now() + delay;
            if let Some(f) = &from
                && let Ok(mut g) = f.lock()
            {
                *g = src;
            }
            let _ = tx.send((at, b[..n].to_vec()));
        }
    })
}

/// One client's transfer through the relay: four threads (a receiver and a
/// delay line each way).
struct Session {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Session {
    fn start(
        first: Vec<u8>,
        client: SocketAddr,
        server: SocketAddr,
        delay: Duration,
        late: &Arc<Mutex<Lateness>>,
    ) -> std::io::Result<Session> {
        let tick = Some(Duration::from_millis(50));
        // towards the server: leaves through c0 from the client's address
        let up = Arc::new(UdpSocket::bind("0.0.0.0:0")?);
        up.set_read_timeout(tick)?;
        // towards the client, on loopback
        let down = Arc::new(UdpSocket::bind("127.0.0.1:0")?);
        down.set_read_timeout(tick)?;
        let stop = Arc::new(AtomicBool::new(false));
        let server_tid = Arc::new(Mutex::new(server));
        let (tx_up, rx_up) = std::sync::mpsc::channel();
        let (tx_down, rx_down) = std::sync::mpsc::channel();
        let _ = tx_up.send((Instant::now() + delay, first));
        let threads = vec![
            delay_line(
                stop.clone(),
                rx_up,
                up.clone(),
                server_tid.clone(),
                late.clone(),
            ),
            delay_line(
                stop.clone(),
                rx_down,
                down.clone(),
                Arc::new(Mutex::new(client)),
                late.clone(),
            ),
            receiver(stop.clone(), up, tx_down, delay, Some(server_tid)),
            receiver(stop.clone(), down, tx_up, delay, None),
        ];
        Ok(Session { stop, threads })
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A user-space UDP relay in the client namespace, listening on a
/// loopback address, adding `delay` each way between a TFTP client and
/// `server`, one transfer at a time (a new request starts a new session).
/// Datagrams reach the server from the client's own address over the veth,
/// so every server sees an ordinary remote client.
struct Relay {
    stop: Arc<AtomicBool>,
    late: Arc<Mutex<Lateness>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Relay {
    fn start(
        client_ns: &str,
        listen: SocketAddr,
        server: SocketAddr,
        delay: Duration,
    ) -> anyhow::Result<Relay> {
        let stop = Arc::new(AtomicBool::new(false));
        let late = Arc::new(Mutex::new(Lateness::default()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<std::io::Result<()>>();
        let (ns, st, la) = (client_ns.to_owned(), stop.clone(), late.clone());
        let thread = std::thread::spawn(move || {
            let ready = ready_tx.clone();
            let r = in_netns(&ns, move || -> std::io::Result<()> {
                let front = UdpSocket::bind(listen)?;
                front.set_read_timeout(Some(Duration::from_millis(50)))?;
                let _ = ready.send(Ok(()));
                let mut session: Option<Session> = None;
                let mut b = vec![0u8; 65536];
                while !st.load(Ordering::Relaxed) {
                    let Ok((n, client)) = front.recv_from(&mut b) else {
                        continue;
                    };
                    drop(session.take());
                    session = Some(Session::start(b[..n].to_vec(), client, server, delay, &la)?);
                }
                Ok(())
            });
            if let Err(e) = r {
                let _ = ready_tx.send(Err(std::io::Error::other(e)));
            } else if let Ok(Err(e)) = r {
                let _ = ready_tx.send(Err(e));
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .context("relay did not start")??;
        Ok(Relay {
            stop,
            late,
            thread: Some(thread),
        })
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Median seconds of `runs` atftp downloads of `file` from `host` (each
/// bounded by a 120 s wall-clock limit).
fn atftp(
    ns: &Ns,
    host: &str,
    file: &str,
    window: Option<u32>,
    runs: usize,
    size: u64,
) -> anyhow::Result<f64> {
    let mut times = Vec::new();
    for _ in 0..runs {
        let mut c = ns.cexec("timeout");
        c.args([
            "120",
            "atftp",
            "--option",
            "blksize 1468",
            "--option",
            "tsize 0",
        ]);
        if let Some(w) = window {
            c.args(["--option", &format!("windowsize {w}")]);
        }
        let out = format!("/tmp/annealbench-{}-{file}", std::process::id());
        c.args(["-g", "-r", file, "-l", &out, host]);
        let t = Instant::now();
        let o = c.output()?;
        let dt = t.elapsed().as_secs_f64();
        let got = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
        let _ = std::fs::remove_file(&out);
        if !o.status.success() || got != size {
            bail!(
                "atftp {file} from {host}: {got} of {size} bytes after {dt:.1} s ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            );
        }
        times.push(dt);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// `names` filtered by `--servers=a,b` (all when absent).
fn selected<'a>(names: &[&'a str]) -> Vec<&'a str> {
    let want: Option<Vec<String>> =
        anneal_bench::option("--servers").map(|l| l.split(',').map(str::to_owned).collect());
    names
        .iter()
        .filter(|n| want.as_ref().is_none_or(|w| w.iter().any(|x| x == *n)))
        .copied()
        .collect()
}

fn start_dhcp_server(ns: &Ns, d: &Path, name: &str) -> anyhow::Result<Box<dyn std::any::Any>> {
    Ok(match name {
        "bootd" => Box::new(start_bootd(ns, d, SERVER)?),
        "dnsmasq" => Box::new(start_dnsmasq(ns, d, Some(false), None)?),
        "dnsmasq-ping" => Box::new(start_dnsmasq(ns, d, Some(true), None)?),
        _ => Box::new(start_kea(ns, d)?),
    })
}

fn bench_dhcp(
    ns: &Ns,
    d: &Path,
    quick: bool,
    json: &mut serde_json::Map<String, serde_json::Value>,
) -> anyhow::Result<()> {
    let secs = if quick { 3 } else { 5 };
    let resolution = if quick { 0.125 } else { 0.06 };
    println!(
        "DHCP (perfdhcp -r RATE -p {secs}, fresh server per rate, servers in turn; rates double \
         from 250/s, then the knee is bisected to {:.0} % of the rate; best achieved rate under {DROPS_LIMIT} % drops)",
        resolution * 100.0
    );
    println!(
        "  dnsmasq runs with --no-ping and --quiet-dhcp (not its defaults): neither bootd nor Kea \
         probes an address before offering it (with the ping check dnsmasq waits ~3 s per new \
         address: measured below), and Kea logs at WARN, bootd here not at all"
    );
    let servers = selected(&["bootd", "dnsmasq", "kea"]);
    let mut results = Vec::new();
    for sw in sweep_all(ns, d, &servers, secs, resolution) {
        json.insert(format!("dhcp_{}", sw.name), serde_json::to_value(&sw.all)?);
        results.push((sw.name, sw.best()));
    }
    if servers.contains(&"dnsmasq") {
        // dnsmasq's default ping check: one low rate for the record
        let _srv = start_dhcp_server(ns, d, "dnsmasq-ping");
        let mut none = || Ok(());
        let run = dhcp_point(ns, "dnsmasq (default ping check)", 10, secs, &mut none);
        json.insert("dhcp_dnsmasq_ping_check".into(), serde_json::to_value(run)?);
    }
    let best_of = |n: &str| {
        results
            .iter()
            .find(|(k, _)| *k == n)
            .and_then(|(_, b)| *b)
            .map_or(0.0, |b| b.rate)
    };
    let (b, dn, k) = (best_of("bootd"), best_of("dnsmasq"), best_of("kea"));
    let reference = dn.max(k);
    if b > 0.0 && reference > 0.0 {
        let ratio = b / reference;
        println!(
            "DHCP best under {DROPS_LIMIT} % drops: bootd {b:.0}/s, dnsmasq {dn:.0}/s, kea {k:.0}/s \
             -> bootd / max(dnsmasq, kea) = {ratio:.2}x (goal >= 1.0x)"
        );
        json.insert("dhcp_ratio".into(), serde_json::json!(ratio));
    } else {
        println!(
            "DHCP best under {DROPS_LIMIT} % drops: bootd {b:.0}/s, dnsmasq {dn:.0}/s, kea {k:.0}/s (no ratio)"
        );
    }
    bench_latency(ns, d, quick, json);
    Ok(())
}

/// The DHCP latency part alone (`--only=latency` runs just this).
fn bench_latency(
    ns: &Ns,
    d: &Path,
    quick: bool,
    json: &mut serde_json::Map<String, serde_json::Value>,
) {
    println!(
        "DHCP latency (sequential DORA from one client for {} s; goal p99 < 2 ms)",
        if quick { 4 } else { 8 }
    );
    for name in selected(&["bootd", "kea", "dnsmasq"]) {
        let r = start_dhcp_server(ns, d, name)
            .and_then(|_guard| dora_latency(ns, Duration::from_secs(if quick { 4 } else { 8 })));
        match r {
            Ok((n, p50, p99, lost)) => {
                println!(
                    "  {name:8} {n} exchanges, p50 {p50:.3} ms, p99 {p99:.3} ms, {lost} timed out"
                );
                json.insert(
                    format!("latency_{name}"),
                    serde_json::json!({"exchanges": n, "p50_ms": p50, "p99_ms": p99, "lost": lost}),
                );
            }
            Err(e) => println!("  {name:8} failed: {e:#}"),
        }
    }
}

/// The TFTP servers, each on its own address of s0 so that all run at once
/// and the measurements can be interleaved (load on a shared machine then
/// hits every server alike); the relay for each listens on its own
/// loopback address in the client namespace.
const TFTP_SERVERS: [(&str, &str, &str); 3] = [
    ("tftpd-hpa", SERVER, "127.0.0.1"),
    ("dnsmasq", "10.88.0.3", "127.0.0.3"),
    ("bootd", "10.88.0.4", "127.0.0.4"),
];

fn start_tftp_server(
    ns: &Ns,
    d: &Path,
    name: &str,
    addr: &str,
) -> anyhow::Result<Box<dyn std::any::Any>> {
    Ok(match name {
        "tftpd-hpa" => Box::new(spawn(
            "in.tftpd",
            ns.exec("in.tftpd")
                .args(["-L", "-a", &format!("{addr}:69"), "-s"])
                .arg(d),
            &d.join("tftpd.log"),
        )?),
        "dnsmasq" => Box::new(start_dnsmasq(ns, d, None, Some(addr))?),
        _ => Box::new(start_bootd(ns, d, addr)?),
    })
}

fn bench_tftp(
    ns: &Ns,
    d: &Path,
    quick: bool,
    json: &mut serde_json::Map<String, serde_json::Value>,
) -> anyhow::Result<()> {
    for (name, mb) in [("f1m", 1u64), ("f8m", 8)] {
        let bytes: Vec<u8> = (0..mb * 1024 * 1024)
            .map(|i| ((i * 2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(d.join(name), bytes)?;
    }
    let plain_runs = anneal_bench::option_or("--runs", if quick { 5 } else { 9 })?;
    let delay_runs = if quick { 1 } else { 3 };
    // what a transfer costs before any data moves: starting the client
    let t = Instant::now();
    let _ = ns.cexec("atftp").arg("--version").output();
    let spawn_s = t.elapsed().as_secs_f64();
    println!(
        "TFTP (atftp, blksize 1468, tsize; all servers up at once, runs interleaved; median of \
         {plain_runs} on the plain veth, {delay_runs} through the relay; times include starting \
         atftp, {:.1} ms here)",
        spawn_s * 1e3
    );
    let servers: Vec<(&str, &str, &str)> = TFTP_SERVERS
        .iter()
        .filter(|(n, _, _)| selected(&[n]).len() == 1)
        .copied()
        .collect();
    let mut guards = Vec::new();
    let mut up = Vec::new();
    for &(name, addr, relay) in &servers {
        if addr != SERVER {
            let _ = ns.ip(&["addr", "add", &format!("{addr}/16"), "dev", "s0"]);
        }
        match start_tftp_server(ns, d, name, addr) {
            Ok(g) => {
                guards.push(g);
                up.push((name, addr, relay));
            }
            Err(e) => println!("  {name:9} did not start: {e:#}"),
        }
    }
    let mut tftp = serde_json::Map::new();
    let paths: &[&str] = if anneal_bench::flag("--no-relay") {
        &["plain"]
    } else {
        &["plain", "delay1ms"]
    };
    for &path in paths {
        let runs = if path == "plain" {
            plain_runs
        } else {
            delay_runs
        };
        let mut relays = Vec::new();
        if path == "delay1ms" {
            for &(_, addr, relay) in &up {
                relays.push(Relay::start(
                    ns.client.name(),
                    SocketAddr::new(relay.parse()?, 69),
                    SocketAddr::new(addr.parse()?, 69),
                    Duration::from_millis(1),
                )?);
            }
        }
        for (file, size) in [("f1m", 1u64 << 20), ("f8m", 8u64 << 20)] {
            // times[server][0 = lockstep, 1 = windowsize 8]
            let mut times = vec![[Vec::new(), Vec::new()]; up.len()];
            let mut failed: Vec<Option<String>> = vec![None; up.len()];
            for _ in 0..runs {
                for (k, &(_, addr, relay)) in up.iter().enumerate() {
                    let host = if path == "plain" { addr } else { relay };
                    for (m, window) in [None, Some(8)].into_iter().enumerate() {
                        if failed[k].is_some() {
                            continue;
                        }
                        match atftp(ns, host, file, window, 1, size) {
                            Ok(t) => times[k][m].push(t),
                            Err(e) => failed[k] = Some(format!("{e:#}")),
                        }
                    }
                }
            }
            let mut row = serde_json::Map::new();
            let mut reference = f64::MAX;
            let mut bootd_win = None;
            for (k, &(server, _, _)) in up.iter().enumerate() {
                if let Some(e) = &failed[k] {
                    println!("  {path:8} {file} {server:9} failed: {e}");
                    row.insert(format!("{server}_error"), serde_json::json!(e));
                    continue;
                }
                let lock = median(&mut times[k][0]);
                let win = median(&mut times[k][1]);
                println!(
                    "  {path:8} {file} {server:9} lockstep {lock:6.3} s  windowsize 8 {win:6.3} s"
                );
                row.insert(format!("{server}_lockstep_s"), serde_json::json!(lock));
                row.insert(format!("{server}_window8_s"), serde_json::json!(win));
                if server == "bootd" {
                    bootd_win = Some(win);
                } else {
                    reference = reference.min(lock).min(win);
                }
            }
            match bootd_win {
                Some(win) if reference < f64::MAX => {
                    let ratio = reference / win;
                    let goal = if path == "plain" { 1.0 } else { 3.0 };
                    println!(
                        "  {path:8} {file} bootd windowsize 8 vs the fastest reference: {ratio:.2}x (goal >= {goal:.1}x)"
                    );
                    row.insert("ratio".into(), serde_json::json!(ratio));
                }
                _ => println!("  {path:8} {file} no ratio: bootd or every reference missing"),
            }
            tftp.insert(format!("{path}_{file}"), serde_json::Value::Object(row));
        }
        let mut all = Lateness::default();
        for relay in relays {
            let late = relay.late.clone();
            drop(relay);
            if let Ok(mut l) = late.lock() {
                all.0.append(&mut l.0);
            }
        }
        if path == "delay1ms" {
            let (n, mean, p99, max) = all.summary();
            println!(
                "  relay: {n} datagrams, each held 1 ms + lateness mean {mean:.0} us, p99 {p99} us, max {max} us"
            );
            tftp.insert(
                "relay_lateness_us".into(),
                serde_json::json!({"datagrams": n, "mean": mean, "p99": p99, "max": max}),
            );
        }
    }
    drop(guards);
    json.insert("tftp".into(), serde_json::Value::Object(tftp));
    Ok(())
}

const USAGE: &str = "\
usage: bootd-bench [options]   (as root; creates and deletes its own namespaces)
  --quick                 shorter runs and a coarser DHCP sweep
  --only=dhcp|latency|tftp
                          one part only (dhcp includes latency)
  --servers=a,b           only these servers (bootd, dnsmasq, kea, tftpd-hpa)
  --runs=N                TFTP runs on the plain veth (default 9, 5 with --quick)
  --no-relay              TFTP on the plain veth only (no 1 ms delay relay)
  --bootd-no-lease-file   bootd without its lease file (diagnosis only)
writes target/bench/bootd.json";

fn main() -> anyhow::Result<()> {
    if anneal_bench::flag("--help") || anneal_bench::flag("-h") {
        println!("{USAGE}");
        return Ok(());
    }
    let quick = anneal_bench::flag("--quick");
    let only = anneal_bench::option("--only");
    let ns = Ns::create()?;
    let dir = tempfile::Builder::new().prefix("annealbench").tempdir()?;
    let d = dir.path().to_path_buf();
    if let Some(l) = anneal_bench::load_average() {
        println!("load average at start: {l}");
    }
    let mut json = serde_json::Map::new();
    if only.as_deref().is_none_or(|o| o == "dhcp") {
        bench_dhcp(&ns, &d, quick, &mut json)?;
    }
    if only.as_deref() == Some("latency") {
        bench_latency(&ns, &d, quick, &mut json);
    }
    if only.as_deref().is_none_or(|o| o == "tftp") {
        bench_tftp(&ns, &d, quick, &mut json)?;
    }
    if let Some(l) = anneal_bench::load_average() {
        println!("load average at end: {l}");
    }
    anneal_bench::write_json("bootd", &serde_json::Value::Object(json))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a server that keeps up below `knee`/s: the rates tried and
    /// the best good rate found.
    fn simulate(knee: u32, resolution: f64) -> (Vec<u32>, Option<u32>) {
        let (mut good, mut bad, mut tried) = (None, None, Vec::new());
        while let Some(r) = next_rate(good, bad, resolution) {
            assert!(!tried.contains(&r), "{r} twice: {tried:?}");
            tried.push(r);
            if r < knee {
                good = Some(good.map_or(r, |g: u32| g.max(r)));
            } else {
                bad = Some(bad.map_or(r, |b: u32| b.min(r)));
            }
        }
        (tried, good)
    }

    #[test]
    fn sweep_finds_the_knee_within_the_resolution() {
        for knee in [30, 180, 300, 2600, 5200, 9100, 20000] {
            let (tried, good) = simulate(knee, 0.06);
            let g = good.unwrap();
            assert!(
                g < knee && f64::from(knee - g) <= 0.07 * f64::from(g) + 60.0,
                "{knee}: {tried:?}"
            );
            assert!(tried.len() <= 14, "{knee}: {tried:?}");
        }
        // nothing keeps up: halves to the floor and stops
        let (tried, good) = simulate(0, 0.06);
        assert_eq!(good, None);
        assert_eq!(tried.last(), Some(&15));
        // everything keeps up: stops at the top of the ladder
        let (tried, _) = simulate(u32::MAX, 0.06);
        assert_eq!(tried.last(), Some(&32_000));
    }
}
