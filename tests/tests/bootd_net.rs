//! bootd against real clients inside network namespaces: busybox udhcpc
//! (lease mode, MAC gate, relay through Debian's dhcrelay, restart), atftp
//! and tftp-hpa (TFTP options, traversal), curl (scripts only to the leased
//! address, the token cpio, Range), and hostile
//! datagrams that must be dropped, counted, and not stop the server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};
use std::time::Duration;

use anneal_bootd::{NetnsServer, ServerOptions, StaticConfig, in_netns};
use anneal_testinfra::Netns;
use anneal_tests::eventually_blocking;
use anneal_tests::wait::{DHCRELAY_READY, file_contains};

const ENROLLED: &str = "52:54:00:00:00:01";
const STRANGER: &str = "52:54:00:00:00:99";

fn yaml(mode: &str, dir: &std::path::Path, extra: &str) -> String {
    let gateway = if mode == "lease" {
        "  gateway: \"\"\n"
    } else {
        ""
    };
    format!(
        r#"subnet: lab/seg1
serverIP: 10.77.0.1
cidr: 10.77.0.0/24
dhcp:
  mode: {mode}
{gateway}  leaseTime: 10m
  leaseRange: {{start: 10.77.0.100, end: 10.77.0.150}}
api: {{url: "https://10.77.0.1:8443", caSha256: "ab12"}}
artifacts: {{kernel: {dir}/kernel, initrd: {dir}/initrd}}
files: {{snponly.efi: /usr/lib/ipxe/snponly.efi}}
{extra}machines:
  - name: lab/m1
    mac: "{ENROLLED}"
    address: 10.77.0.50
    console: ["ttyS0,115200"]
    token: "tok-secret-1"
"#,
        dir = dir.display()
    )
}

fn snapshot(text: &str) -> anneal_bootd::Snapshot {
    StaticConfig::from_yaml(text)
        .unwrap()
        .snapshot(8080, "rev-1".into())
        .unwrap()
}

fn opts(dir: &std::path::Path, iface: &str) -> ServerOptions {
    ServerOptions {
        interface: Some(iface.into()),
        lease_file: Some(dir.join("leases.json")),
        ..ServerOptions::default()
    }
}

/// The persisted leases (snapshot and journal), one `MAC ADDRESS` a line.
fn lease_file(dir: &std::path::Path) -> String {
    anneal_bootd::leasefile::load(&dir.join("leases.json"))
        .unwrap()
        .iter()
        .map(|l| format!("{} {}\n", l.mac, l.address))
        .collect()
}

fn out(mut c: Command) -> Output {
    c.output().expect("spawn")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// One udhcpc run (quit after a lease or after 3 tries) on `iface` in `ns`.
fn udhcpc(ns: &Netns, iface: &str, extra: &[&str]) -> Output {
    let mut c = ns.exec("busybox");
    c.args([
        "udhcpc", "-i", iface, "-n", "-q", "-f", "-t", "3", "-T", "1", "-A", "1",
    ])
    .args(["-s", "/bin/true"])
    .args(extra);
    out(c)
}

/// Generous: how long bootd may take to persist a lease or count a datagram
/// on a loaded machine.
const SETTLE: Duration = Duration::from_secs(30);

/// Waits until the persisted leases satisfy `ok`; returns them.
fn wait_lease_file(dir: &std::path::Path, what: &str, ok: impl Fn(&str) -> bool) -> String {
    eventually_blocking(what, SETTLE, || {
        let lf = lease_file(dir);
        if ok(&lf) { Ok(lf) } else { Err(lf) }
    })
}

/// Waits until every `needle` has a metric value of at least 1.
fn wait_counted(server: &NetnsServer, needles: &[String]) {
    eventually_blocking(&format!("bootd counting {needles:?}"), SETTLE, || {
        let m = metrics(server);
        if needles.iter().all(|n| metric_value(&m, n) >= 1) {
            Ok(())
        } else {
            Err(m)
        }
    });
}

fn metrics(server: &NetnsServer) -> String {
    server.shared().metrics.render()
}

fn metric_value(m: &str, needle: &str) -> u64 {
    m.lines()
        .filter(|l| !l.starts_with('#') && l.contains(needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// Namespace with bootd's bridge plus a client namespace joined by a veth
/// (`c0` there) and a second veth (`h0`, 10.77.0.200) for raw datagrams.
fn topology() -> (Netns, Netns) {
    let ns = Netns::create("bdl").unwrap();
    let client = Netns::bare("bdc").unwrap();
    ns.add_veth_to_bridge(&client, "vc0", "c0", "").unwrap();
    ns.add_veth_to_bridge(&client, "vh0", "h0", "10.77.0.200/24")
        .unwrap();
    client
        .ip(&["link", "set", "c0", "address", ENROLLED])
        .unwrap();
    (ns, client)
}

fn artifacts(dir: &std::path::Path) -> Vec<u8> {
    let kernel: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(dir.join("kernel"), &kernel).unwrap();
    std::fs::write(dir.join("initrd"), b"initrd-bytes").unwrap();
    kernel
}

fn send_raw(client: &Netns, packets: Vec<Vec<u8>>) {
    in_netns(client.name(), move || {
        let s = std::net::UdpSocket::bind("10.77.0.200:0").unwrap();
        for p in &packets {
            let _ = s.send_to(p, "10.77.0.1:67");
        }
    })
    .unwrap();
}

fn valid_discover(mac: [u8; 6]) -> Vec<u8> {
    let mut p = vec![0u8; 240];
    p[0] = 1;
    p[1] = 1;
    p[2] = 6;
    p[4..8].copy_from_slice(&[1, 2, 3, 4]);
    p[28..34].copy_from_slice(&mac);
    p[236..240].copy_from_slice(&[99, 130, 83, 99]);
    p.extend_from_slice(&[53, 1, 1, 255]);
    p
}

#[test]
fn lease_mode_gate_tftp_http_hostile_and_restart() {
    let (ns, client) = topology();
    let dir = ns.dir();
    let kernel = artifacts(&dir);
    let text_cfg = yaml("lease", &dir, "");
    // a persisted lease of a MAC that is not enrolled any more is filtered on start
    std::fs::write(
        dir.join("leases.json"),
        format!(
            r#"{{"version":1,"leases":[{{"mac":"{STRANGER}","address":"10.77.0.77","expires":{}}}]}}"#,
            anneal_bootd::unix_now() + 600
        ),
    )
    .unwrap();
    let server = NetnsServer::start(ns.name(), opts(&dir, "br0"), snapshot(&text_cfg)).unwrap();
    let lf = lease_file(&dir);
    assert!(!lf.contains(STRANGER), "stale lease kept: {lf}");

    // enrolled MAC: its reservation
    let o = udhcpc(&client, "c0", &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("10.77.0.50"), "{t}");
    wait_lease_file(&dir, "the enrolled lease persisted", |lf| {
        lf.contains(ENROLLED) && lf.contains("10.77.0.50")
    });

    // unknown MAC: not a single packet from bootd on the wire, and the drop
    // is counted with its reason. The same capture then sees the enrolled
    // exchange: once its replies are captured, any reply to the stranger
    // (asked first) would have been too.
    client
        .ip(&["link", "set", "c0", "address", STRANGER])
        .unwrap();
    let ((stranger, enrolled), seen) = capture_replies(&client, ENROLLED, 2, || {
        let s = udhcpc(&client, "c0", &[]);
        client
            .ip(&["link", "set", "c0", "address", ENROLLED])
            .unwrap();
        (s, udhcpc(&client, "c0", &[]))
    });
    assert!(
        !stranger.status.success(),
        "stranger got a lease: {}",
        text(&stranger)
    );
    assert!(enrolled.status.success(), "{}", text(&enrolled));
    assert_eq!(
        seen(STRANGER),
        0,
        "bootd answered an unknown MAC on the wire"
    );
    wait_counted(&server, &["outcome=\"drop_not_enrolled\"".to_string()]);

    // hostile datagrams: truncated, option overflow, bad magic (a 4000-byte
    // DISCOVER is not one: larger than the MTU, it is IP-fragmented and read,
    // see bootd/tests/dhcp_fragmented.rs; only more than a UDP datagram
    // holds, which no socket delivers, is `oversized`)
    let good = valid_discover([0x52, 0x54, 0, 0, 0, 1]);
    let mut overflow = good[..240].to_vec();
    overflow.extend_from_slice(&[53, 1, 1, 60, 200, b'P', b'X']);
    let mut magic = good.clone();
    magic[236] = 0;
    let mut huge = good.clone();
    huge.resize(4000, 0);
    send_raw(
        &client,
        vec![
            good[..100].to_vec(),
            huge,
            overflow,
            magic,
            vec![],
            vec![0xff; 300],
        ],
    );
    let needles: Vec<String> = ["truncated", "option_overflow", "bad_magic"]
        .iter()
        .map(|r| format!("bootd_dhcp_malformed_total{{reason=\"{r}\"}}"))
        .collect();
    wait_counted(&server, &needles);
    // ...and the server keeps answering
    let o = udhcpc(&client, "c0", &[]);
    assert!(text(&o).contains("10.77.0.50"), "{}", text(&o));

    // TFTP: configured file with options, traversal and unknown names refused
    let tdir = tempdir_in(&dir, "tftp");
    let mut c = client.exec("atftp");
    c.current_dir(&tdir).args([
        "--option",
        "blksize 1468",
        "--option",
        "tsize 0",
        "--option",
        "windowsize 8",
        "-g",
        "-r",
        "snponly.efi",
        "-l",
        "snponly.efi",
        "10.77.0.1",
    ]);
    let o = out(c);
    let got = std::fs::read(tdir.join("snponly.efi")).unwrap_or_default();
    assert_eq!(
        got,
        std::fs::read("/usr/lib/ipxe/snponly.efi").unwrap(),
        "atftp: {}",
        text(&o)
    );
    let mut c = client.exec("tftp");
    c.current_dir(&tdir).args([
        "10.77.0.1",
        "-m",
        "binary",
        "-c",
        "get",
        "../../../etc/passwd",
        "p",
    ]);
    let o = out(c);
    let p = std::fs::read(tdir.join("p")).unwrap_or_default();
    assert!(p.is_empty(), "traversal served: {}", text(&o));
    let mut c = client.exec("tftp");
    c.current_dir(&tdir)
        .args(["10.77.0.1", "-m", "binary", "-c", "get", "ipxe.efi", "q"]);
    let _ = out(c);
    assert!(std::fs::read(tdir.join("q")).unwrap_or_default().is_empty());
    let m = metrics(&server);
    assert!(
        metric_value(&m, "bootd_tftp_bytes_total") >= got.len() as u64,
        "{m}"
    );

    // HTTP: per-machine script, unknown MAC script, Range
    let curl = |args: &[&str]| {
        let mut c = client.exec("curl");
        c.args(["-sS", "--max-time", "5", "--interface", "h0"])
            .args(args);
        out(c)
    };
    // h0 (10.77.0.200) is not the address leased to the
    // enrolled MAC (c0's 10.77.0.50): 403 and no token
    for path in ["ipxe", "token"] {
        let o = curl(&[
            "-w",
            "\n%{http_code}",
            &format!("http://10.77.0.1:8080/{path}/52-54-00-00-00-01"),
        ]);
        let s = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(s.ends_with("\n403"), "{path} from another address: {s}");
        assert!(!s.contains("tok-secret-1"), "{s}");
    }
    // the leased address gets the script, the token only in its cpio
    let ip = out({
        let mut c = client.exec("ip");
        c.args(["addr", "add", "10.77.0.50/32", "dev", "h0"]);
        c
    });
    assert!(ip.status.success(), "{}", text(&ip));
    let leased = |args: &[&str]| {
        let mut c = client.exec("curl");
        c.args(["-sS", "--max-time", "5", "--interface", "10.77.0.50"])
            .args(args);
        out(c)
    };
    let o = leased(&["http://10.77.0.1:8080/ipxe/52-54-00-00-00-01"]);
    let s = String::from_utf8_lossy(&o.stdout).to_string();
    for want in [
        "#!ipxe",
        "initrd --name initrd.img http://10.77.0.1:8080/boot/initrd",
        "initrd --name anneal-token.cpio http://10.77.0.1:8080/token/52-54-00-00-00-01",
        "kernel http://10.77.0.1:8080/boot/kernel initrd=anneal-token.cpio initrd=initrd.img ",
        "anneal.api=https://10.77.0.1:8443",
        "anneal.ca=ab12",
        "anneal.machine=lab/m1",
        "BOOTIF=01-52-54-00-00-00-01",
        "console=ttyS0,115200",
    ] {
        assert!(s.contains(want), "missing {want:?} in\n{s}");
    }
    assert!(!s.contains("{{"), "{s}");
    assert!(
        !s.contains("tok-secret-1") && !s.contains("anneal.token"),
        "{s}"
    );
    let o = leased(&["http://10.77.0.1:8080/token/52-54-00-00-00-01"]);
    assert!(
        o.stdout.windows(12).any(|w| w == b"tok-secret-1")
            && o.stdout.windows(16).any(|w| w == b"run/anneal/token"),
        "the token cpio: {}",
        text(&o)
    );
    let o = curl(&["http://10.77.0.1:8080/ipxe/52-54-00-00-00-99"]);
    let s = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(s.contains("no Machine") && s.contains("\nexit"), "{s}");
    let o = curl(&["-r", "1000-1999", "http://10.77.0.1:8080/boot/kernel"]);
    assert_eq!(o.stdout, kernel[1000..2000].to_vec());
    let o = curl(&[
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "-r",
        "999999-",
        "http://10.77.0.1:8080/boot/kernel",
    ]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "416");
    let o = curl(&["http://10.77.0.1:8080/metrics"]);
    let s = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(s.contains("bootd_dhcp_packets_total"), "{s}");
    assert!(!s.contains("tok-secret-1"));

    // restart: the lease survives and renews to the same address
    server.stop();
    let lf = lease_file(&dir);
    assert!(lf.contains("10.77.0.50"), "{lf}");
    let server = NetnsServer::start(ns.name(), opts(&dir, "br0"), snapshot(&text_cfg)).unwrap();
    let o = udhcpc(&client, "c0", &["-r", "10.77.0.50"]);
    assert!(text(&o).contains("lease of 10.77.0.50"), "{}", text(&o));
    // a MAC that leaves the allowlist loses its lease at once
    let without = text_cfg.replace(
        &format!("mac: \"{ENROLLED}\""),
        "mac: \"52:54:00:00:00:02\"",
    );
    server.shared().install(snapshot(&without));
    wait_lease_file(&dir, "the de-enrolled MAC's lease dropped", |lf| {
        !lf.contains(ENROLLED)
    });
    server.stop();
}

/// Runs `f` while tcpdump in the client namespace records, on `c0`, the
/// DHCP replies (UDP from port 67) that reach the client on the wire; waits
/// until `want` replies to `barrier` (a MAC) are captured, so that every
/// earlier reply is in too. Returns `f`'s result and a count of the replies
/// to a MAC (`Client-Ethernet-Address`).
fn capture_replies<T>(
    client: &Netns,
    barrier: &str,
    want: usize,
    f: impl FnOnce() -> T,
) -> (T, impl Fn(&str) -> usize) {
    let log = client.dir().join("capture.txt");
    let err = client.dir().join("capture.err");
    let mut child = client
        .exec("tcpdump")
        .args(["-i", "c0", "-n", "-l", "-vv", "--immediate-mode", "-p"])
        .args(["udp and src port 67"])
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    // live once it says so on stderr
    eventually_blocking("tcpdump listening on c0", SETTLE, || {
        let e = std::fs::read_to_string(&err).unwrap_or_default();
        if e.contains("listening") {
            Ok(())
        } else {
            Err(e)
        }
    });
    let r = f();
    let count = |text: &str, mac: &str| {
        text.matches(&format!("Client-Ethernet-Address {mac}"))
            .count()
    };
    let text = eventually_blocking(
        &format!("{want} replies to {barrier} captured"),
        SETTLE,
        || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if count(&text, barrier) >= want {
                Ok(text)
            } else {
                Err(text)
            }
        },
    );
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let _ = child.wait();
    if std::env::var_os("BOOTD_TEST_DEBUG").is_some() {
        eprintln!("capture: {text}");
    }
    (r, move |mac: &str| count(&text, mac))
}

fn tempdir_in(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::create_dir_all(&p).unwrap();
    p
}

#[test]
fn answer_all_dynamic_lease_survives_restart() {
    let (ns, client) = topology();
    let dir = ns.dir();
    artifacts(&dir);
    client
        .ip(&["link", "set", "c0", "address", STRANGER])
        .unwrap();
    let cfg = yaml("lease", &dir, "answerAll: true\n");
    let server = NetnsServer::start(ns.name(), opts(&dir, "br0"), snapshot(&cfg)).unwrap();
    let o = udhcpc(&client, "c0", &[]);
    let t = text(&o);
    let addr = t
        .split("lease of ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no lease: {t}"))
        .to_string();
    assert!(addr.starts_with("10.77.0.1"), "{addr}");
    wait_lease_file(&dir, "the dynamic lease persisted", |lf| {
        lf.contains(STRANGER) && lf.contains(&addr)
    });
    server.stop();
    let server = NetnsServer::start(ns.name(), opts(&dir, "br0"), snapshot(&cfg)).unwrap();
    // a plain DISCOVER (no requested address) gets the same address back
    let o = udhcpc(&client, "c0", &[]);
    assert!(
        text(&o).contains(&format!("lease of {addr}")),
        "{}",
        text(&o)
    );
    server.stop();
}

#[test]
fn relayed_segment_through_dhcrelay() {
    // bootd ns (10.77.0.1 on a veth) -- relay ns -- client ns (10.78.0.0/24)
    let bootd_ns = Netns::bare("bdr").unwrap();
    let relay = Netns::bare("bdy").unwrap();
    let client = Netns::bare("bdz").unwrap();
    bootd_ns
        .link(&relay, "up0", "10.77.0.1/24", "ru0", "10.77.0.254/24")
        .unwrap();
    relay
        .link(&client, "rd0", "10.78.0.1/24", "c0", "")
        .unwrap();
    bootd_ns
        .ip(&["route", "add", "10.78.0.0/24", "via", "10.77.0.254"])
        .unwrap();
    relay
        .exec("sysctl")
        .args(["-qw", "net.ipv4.ip_forward=1"])
        .status()
        .unwrap();
    client
        .ip(&["link", "set", "c0", "address", ENROLLED])
        .unwrap();
    let dir = bootd_ns.dir();
    artifacts(&dir);
    let cfg = yaml("lease", &dir, "")
        .replace("cidr: 10.77.0.0/24", "cidr: 10.78.0.0/24")
        .replace("10.77.0.50", "10.78.0.50")
        .replace(
            "{start: 10.77.0.100, end: 10.77.0.150}",
            "{start: 10.78.0.100, end: 10.78.0.150}",
        );
    let server = NetnsServer::start(
        bootd_ns.name(),
        ServerOptions {
            tftp_port: 0,
            ..opts(&dir, "up0")
        },
        snapshot(&cfg),
    )
    .unwrap();
    let relay_log = relay.dir().join("dhcrelay.log");
    let mut relay_proc = relay
        .exec("dhcrelay")
        .args(["-d", "-4", "-iu", "ru0", "-id", "rd0", "10.77.0.1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&relay_log).unwrap())
        .spawn()
        .unwrap();
    file_contains(&relay_log, DHCRELAY_READY, SETTLE);
    let o = udhcpc(&client, "c0", &[]);
    let _ = relay_proc.kill();
    let _ = relay_proc.wait();
    let t = text(&o);
    assert!(t.contains("lease of 10.78.0.50"), "{t}");
    wait_counted(&server, &["outcome=\"ack\"".to_string()]);
    server.stop();
}
