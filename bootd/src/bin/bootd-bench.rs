//! bootd benchmark: DHCP (perfdhcp against bootd, dnsmasq and Kea memfile) and
//! TFTP (atftp against bootd, tftpd-hpa and dnsmasq; plain veth and a path
//! with 1 ms added each way by a user-space UDP delay relay), all inside a
//! namespace this program creates and deletes. Prints ratios against the
//! references measured in the same run; writes target/bench/bootd.json.
//!
//! Run as root: `cargo run --release -p anneal-bootd --bin bootd-bench [-- --quick]`

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anneal_bootd::{NetnsServer, ServerOptions, StaticConfig, in_netns};
use anyhow::{Context, bail};

const SERVER: &str = "10.88.0.1";
const RELAY: &str = "10.88.0.2";

/// The server namespace (`s0`, 10.88.0.1 and the relay's 10.88.0.2) and a
/// client namespace (`c0`, 10.88.255.254) joined by a veth pair: clients
/// (perfdhcp, atftp) must not share port 67 with the servers.
struct Ns {
    name: String,
    client: String,
}

impl Ns {
    fn create() -> anyhow::Result<Ns> {
        let name = format!("annealbench{}", std::process::id());
        let client = format!("annealbenchc{}", std::process::id());
        sh(Command::new("ip").args(["netns", "add", &name]))?;
        sh(Command::new("ip").args(["netns", "add", &client]))?;
        let ns = Ns { name, client };
        ns.ip(&["link", "set", "lo", "up"])?;
        ns.cip(&["link", "set", "lo", "up"])?;
        ns.ip(&[
            "link", "add", "s0", "type", "veth", "peer", "name", "c0", "netns", &ns.client,
        ])?;
        ns.ip(&["addr", "add", "10.88.0.1/16", "dev", "s0"])?;
        ns.ip(&["addr", "add", "10.88.0.2/16", "dev", "s0"])?;
        ns.cip(&["addr", "add", "10.88.255.254/16", "dev", "c0"])?;
        ns.ip(&["link", "set", "s0", "up"])?;
        ns.cip(&["link", "set", "c0", "up"])?;
        Ok(ns)
    }
    fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        sh(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }
    fn cip(&self, args: &[&str]) -> anyhow::Result<String> {
        sh(Command::new("ip").arg("-n").arg(&self.client).args(args))
    }
    fn exec(&self, prog: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, prog]);
        c
    }
    fn cexec(&self, prog: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.client, prog]);
        c
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.name])
            .status();
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.client])
            .status();
    }
}

fn sh(c: &mut Command) -> anyhow::Result<String> {
    let o = c.output().with_context(|| format!("{c:?}"))?;
    if !o.status.success() {
        bail!("{c:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(c: &mut Command, log: &Path) -> anyhow::Result<Daemon> {
    let f = std::fs::File::create(log)?;
    let child = c
        .stdin(Stdio::null())
        .stdout(f.try_clone()?)
        .stderr(f)
        .spawn()
        .with_context(|| format!("{c:?}"))?;
    std::thread::sleep(Duration::from_millis(700));
    Ok(Daemon(child))
}

fn bootd_yaml(dir: &Path) -> String {
    format!(
        "serverIP: {SERVER}\ncidr: 10.88.0.0/16\n\
         dhcp: {{mode: lease, gateway: \"\", leaseTime: 1h, leaseRange: {{start: 10.88.1.0, end: 10.88.250.250}}}}\n\
         answerAll: true\nfiles: {{f1m: {d}/f1m, f8m: {d}/f8m}}\n",
        d = dir.display()
    )
}

fn start_bootd(ns: &Ns, dir: &Path) -> anyhow::Result<NetnsServer> {
    let _ = std::fs::remove_file(dir.join("bootd.leases"));
    let snap = StaticConfig::from_yaml(&bootd_yaml(dir))?.snapshot(18080, "bench".into())?;
    Ok(NetnsServer::start(
        &ns.name,
        ServerOptions {
            interface: Some("s0".into()),
            listen_ip: SERVER.parse()?,
            http_port: 18080,
            lease_file: Some(dir.join("bootd.leases")),
            ..ServerOptions::default()
        },
        snap,
    )?)
}

fn start_dnsmasq(ns: &Ns, dir: &Path, dhcp: bool, tftp: bool) -> anyhow::Result<Daemon> {
    let mut c = ns.exec("dnsmasq");
    c.args([
        "--keep-in-foreground",
        "--port=0",
        "--interface=s0",
        "--bind-interfaces",
        "--log-facility=-",
    ])
    .arg(format!("--pid-file={}/dnsmasq.pid", dir.display()));
    if dhcp {
        c.args([
            "--dhcp-range=10.88.1.0,10.88.250.250,1h",
            "--dhcp-lease-max=100000",
        ])
        .arg(format!("--dhcp-leasefile={}/dnsmasq.leases", dir.display()));
        let _ = std::fs::remove_file(dir.join("dnsmasq.leases"));
    }
    if tftp {
        c.arg("--enable-tftp")
            .arg(format!("--tftp-root={}", dir.display()));
    }
    spawn(&mut c, &dir.join("dnsmasq.log"))
}

fn start_kea(ns: &Ns, dir: &Path) -> anyhow::Result<Daemon> {
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
    spawn(&mut c, &dir.join("kea.log"))
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

/// Highest rate with drops under 2.5 % over a rate sweep (Kea's method).
fn sweep(
    ns: &Ns,
    name: &str,
    rates: &[u32],
    secs: u32,
    restart: &mut dyn FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<(Option<DhcpRun>, Vec<DhcpRun>)> {
    let mut best: Option<DhcpRun> = None;
    let mut all = Vec::new();
    for &r in rates {
        restart()?;
        let run = perfdhcp(ns, r, secs)?;
        println!(
            "  {name:8} offered {r:6}/s -> {:8.0} DORA/s, drops {:5.2} %, avg {:.2} ms, max {:.1} ms",
            run.rate, run.drops_pct, run.avg_ms, run.max_ms
        );
        all.push(run);
        if run.drops_pct < 2.5 {
            if best.is_none_or(|b| run.rate > b.rate) {
                best = Some(run);
            }
        } else {
            break;
        }
    }
    Ok((best, all))
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
        &ns.client,
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

/// A UDP relay adding `delay` each way between a client and a TFTP server,
/// following the server's per-transfer port (TID).
async fn delay_relay(
    listen: SocketAddr,
    server: SocketAddr,
    delay: Duration,
) -> anyhow::Result<()> {
    use tokio::net::UdpSocket;
    let front = Arc::new(UdpSocket::bind(listen).await?);
    let mut buf = vec![0u8; 65536];
    let mut pending: Option<(Vec<u8>, SocketAddr)> = None;
    loop {
        // one transfer at a time: an RRQ on the front socket starts a session
        let (first, client) = match pending.take() {
            Some(x) => x,
            None => {
                let (n, c) = front.recv_from(&mut buf).await?;
                (buf[..n].to_vec(), c)
            }
        };
        let up = Arc::new(UdpSocket::bind((SERVER, 0)).await?);
        let down = Arc::new(UdpSocket::bind((RELAY, 0)).await?);
        let server_tid = Arc::new(tokio::sync::Mutex::new(server));
        let (tx_up, mut rx_up) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
        let (tx_down, mut rx_down) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
        let _ = tx_up.send((Instant::now() + delay, first));
        let up2 = up.clone();
        let tid2 = server_tid.clone();
        let t1 = tokio::spawn(async move {
            while let Some((at, p)) = rx_up.recv().await {
                tokio::time::sleep_until(at.into()).await;
                let to = *tid2.lock().await;
                let _ = up2.send_to(&p, to).await;
            }
        });
        let down2 = down.clone();
        let t2 = tokio::spawn(async move {
            while let Some((at, p)) = rx_down.recv().await {
                tokio::time::sleep_until(at.into()).await;
                let _ = down2.send_to(&p, client).await;
            }
        });
        let up3 = up.clone();
        let tid3 = server_tid.clone();
        let txd = tx_down.clone();
        let t3 = tokio::spawn(async move {
            let mut b = vec![0u8; 65536];
            while let Ok((n, from)) = up3.recv_from(&mut b).await {
                *tid3.lock().await = from;
                let _ = txd.send((Instant::now() + delay, b[..n].to_vec()));
            }
        });
        let mut b = vec![0u8; 65536];
        loop {
            tokio::select! {
                r = tokio::time::timeout(Duration::from_secs(3), down.recv_from(&mut b)) => match r {
                    Ok(Ok((n, _))) => { let _ = tx_up.send((Instant::now() + delay, b[..n].to_vec())); }
                    _ => break,
                },
                r = front.recv_from(&mut buf) => {
                    if let Ok((n, c)) = r {
                        pending = Some((buf[..n].to_vec(), c));
                    }
                    break;
                }
            }
        }
        t3.abort();
        drop(tx_up);
        drop(tx_down);
        // let queued packets drain
        tokio::time::sleep(delay * 2).await;
        t1.abort();
        t2.abort();
    }
}

/// Median seconds of `runs` atftp downloads of `file` from `host`.
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
        let mut c = ns.cexec("atftp");
        c.args(["--option", "blksize 1468", "--option", "tsize 0"]);
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
                "atftp {file} from {host}: {got} bytes: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        times.push(dt);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let ns = Ns::create()?;
    let dir = tempfile::Builder::new().prefix("annealbench").tempdir()?;
    let d = dir.path().to_path_buf();
    let mut json = serde_json::Map::new();

    // ---- DHCP ----
    let secs = if quick { 3 } else { 5 };
    let rates: Vec<u32> = if quick {
        vec![250, 1000, 4000, 8000]
    } else {
        vec![
            250, 500, 1000, 2000, 3000, 4000, 5000, 6500, 8000, 10000, 13000, 16000,
        ]
    };
    println!(
        "DHCP (perfdhcp -r RATE -p {secs}, fresh server per rate, best rate under 2.5 % drops)"
    );
    let mut results = Vec::new();
    for name in ["bootd", "dnsmasq", "kea"] {
        let mut holder: Option<Box<dyn std::any::Any>> = None;
        let ns_ref = &ns;
        let d2 = d.clone();
        let (best, all) = {
            let mut restart = || -> anyhow::Result<()> {
                holder = None;
                holder = Some(match name {
                    "bootd" => Box::new(start_bootd(ns_ref, &d2)?),
                    "dnsmasq" => Box::new(start_dnsmasq(ns_ref, &d2, true, false)?),
                    _ => Box::new(start_kea(ns_ref, &d2)?),
                });
                Ok(())
            };
            sweep(&ns, name, &rates, secs, &mut restart)?
        };
        drop(holder);
        json.insert(format!("dhcp_{name}"), serde_json::to_value(&all)?);
        results.push((name, best));
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
    println!(
        "DHCP best under 2.5 % drops: bootd {b:.0}/s, dnsmasq {dn:.0}/s, kea {k:.0}/s -> bootd / max(dnsmasq, kea) = {:.2}x",
        b / reference.max(1.0)
    );
    json.insert(
        "dhcp_ratio".into(),
        serde_json::json!(b / reference.max(1.0)),
    );
    println!(
        "DHCP latency (sequential DORA from one client for 4 s; dnsmasq left out: it pings each new address)"
    );
    for name in ["bootd", "kea"] {
        let _guard: Box<dyn std::any::Any> = match name {
            "bootd" => Box::new(start_bootd(&ns, &d)?),
            _ => Box::new(start_kea(&ns, &d)?),
        };
        let (n, p50, p99, lost) = dora_latency(&ns, Duration::from_secs(4))?;
        println!("  {name:8} {n} exchanges, p50 {p50:.3} ms, p99 {p99:.3} ms, {lost} timed out");
        json.insert(
            format!("latency_{name}"),
            serde_json::json!({"exchanges": n, "p50_ms": p50, "p99_ms": p99, "lost": lost}),
        );
    }

    // ---- TFTP ----
    for (name, mb) in [("f1m", 1u64), ("f8m", 8)] {
        let bytes: Vec<u8> = (0..mb * 1024 * 1024)
            .map(|i| ((i * 2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(d.join(name), bytes)?;
    }
    let runs = if quick { 1 } else { 3 };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!("TFTP (atftp, blksize 1468, median of {runs})");
    let mut tftp = serde_json::Map::new();
    for (path, host) in [("plain", SERVER), ("delay1ms", RELAY)] {
        let relay = if path == "delay1ms" {
            let ns_name = ns.name.clone();
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            let h = std::thread::spawn(move || {
                let _ = in_netns(&ns_name, move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build();
                    if let Ok(rt) = rt {
                        rt.block_on(async {
                            tokio::select! {
                                r = delay_relay(format!("{RELAY}:69").parse().unwrap_or(SocketAddr::from(([0, 0, 0, 0], 69))), format!("{SERVER}:69").parse().unwrap_or(SocketAddr::from(([0, 0, 0, 0], 69))), Duration::from_millis(1)) => { let _ = r; }
                                () = async { while rx.try_recv().is_err() { tokio::time::sleep(Duration::from_millis(50)).await; } } => {}
                            }
                        });
                    }
                });
            });
            std::thread::sleep(Duration::from_millis(300));
            Some((tx, h))
        } else {
            None
        };
        for (file, size) in [("f1m", 1u64 << 20), ("f8m", 8u64 << 20)] {
            let mut row = serde_json::Map::new();
            let mut lockstep_best = f64::MAX;
            for server in ["tftpd-hpa", "dnsmasq", "bootd"] {
                let _guard: Box<dyn std::any::Any> = match server {
                    "tftpd-hpa" => Box::new(spawn(
                        ns.exec("in.tftpd")
                            .args(["-L", "-a", &format!("{SERVER}:69"), "-s"])
                            .arg(&d),
                        &d.join("tftpd.log"),
                    )?),
                    "dnsmasq" => Box::new(start_dnsmasq(&ns, &d, false, true)?),
                    _ => Box::new(start_bootd(&ns, &d)?),
                };
                let lock = atftp(&ns, host, file, None, runs, size)?;
                let win = atftp(&ns, host, file, Some(8), runs, size)?;
                if server != "bootd" {
                    lockstep_best = lockstep_best.min(lock).min(win);
                }
                println!(
                    "  {path:8} {file} {server:9} lockstep {:6.3} s  windowsize 8 {:6.3} s",
                    lock, win
                );
                row.insert(format!("{server}_lockstep_s"), serde_json::json!(lock));
                row.insert(format!("{server}_window8_s"), serde_json::json!(win));
                if server == "bootd" {
                    let ratio = lockstep_best / win;
                    println!(
                        "  {path:8} {file} bootd (windowsize 8) speed vs fastest reference: {ratio:.2}x"
                    );
                    row.insert("ratio".into(), serde_json::json!(ratio));
                }
            }
            tftp.insert(format!("{path}_{file}"), serde_json::Value::Object(row));
        }
        if let Some((tx, h)) = relay {
            let _ = tx.send(());
            let _ = h.join();
        }
    }
    drop(rt);
    json.insert("tftp".into(), serde_json::Value::Object(tftp));
    let out = PathBuf::from("target/bench");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("bootd.json"), serde_json::to_vec_pretty(&json)?)?;
    println!("wrote target/bench/bootd.json");
    Ok(())
}
