//! The DHCP client and the rtnetlink requests in a network namespace made by
//! the test: a veth pair, dnsmasq on one end, our client on the other (a link
//! with no address yet), then the lease applied over netlink and read back
//! with `ip`. Needs root, iproute2 and dnsmasq (CI runs as root).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anneal_agent::cmdline::Mac;
use anneal_agent::net::{dhcp, netlink::Netlink};

struct Ns {
    name: String,
    client: String,
    dnsmasq: Option<Child>,
}

impl Drop for Ns {
    fn drop(&mut self) {
        if let Some(mut c) = self.dnsmasq.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.client])
            .status();
    }
}

fn ip(ns: &str, args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["-n", ns])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn dhcp_lease_then_address_and_route_over_netlink() {
    // Two namespaces: the server's and the client's (in one namespace the
    // server's replies would carry a local source address and be dropped).
    let name = format!("agnet{}", std::process::id());
    let client = format!("agcli{}", std::process::id());
    for n in [&name, &client] {
        let st = Command::new("ip")
            .args(["netns", "add", n])
            .status()
            .unwrap();
        assert!(st.success(), "ip netns add (needs root)");
    }
    let mut ns = Ns {
        name: name.clone(),
        client: client.clone(),
        dnsmasq: None,
    };
    ip(
        &name,
        &[
            "link", "add", "srv0", "type", "veth", "peer", "name", "cli0",
        ],
    );
    ip(&name, &["link", "set", "cli0", "netns", &client]);
    ip(
        &client,
        &["link", "set", "cli0", "address", "52:54:00:de:ad:01"],
    );
    ip(&name, &["addr", "add", "10.88.0.1/24", "dev", "srv0"]);
    ip(&name, &["link", "set", "srv0", "up"]);
    let dir = tempfile::tempdir().unwrap();
    ns.dnsmasq = Some(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &name,
                "dnsmasq",
                "--no-daemon",
                "--conf-file=/dev/null",
            ])
            .args([
                "--port=0",
                "--interface=srv0",
                "--bind-interfaces",
                "--no-ping",
            ])
            .args(["--dhcp-range=10.88.0.50,10.88.0.60,255.255.255.0,5m"])
            .args(["--dhcp-option=option:router,10.88.0.1"])
            .arg(format!(
                "--dhcp-leasefile={}",
                dir.path().join("leases").display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("dnsmasq (dnsmasq-base) is installed"),
    );
    // dnsmasq is ready once its DHCP socket (UDP 67) is bound in the
    // namespace: wait for that state, not for time.
    let t = std::time::Instant::now();
    loop {
        let out = Command::new("ip")
            .args(["netns", "exec", &name, "ss", "-Hlun", "sport = :67"])
            .output()
            .expect("ss (iproute2) runs");
        if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "dnsmasq in {name} did not bind UDP port 67 within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let ns_path = format!("/run/netns/{client}");
    let handle = std::thread::spawn(move || {
        // This thread (and the sockets it opens) live in the test namespace.
        let f = std::fs::File::open(&ns_path).unwrap();
        nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let index = nix::net::if_::if_nametoindex("cli0").unwrap();
        let mut nl = Netlink::open().unwrap();
        nl.link_up(index).unwrap();
        let mac = Mac([0x52, 0x54, 0, 0xde, 0xad, 0x01]);
        let lease = dhcp::acquire("cli0", mac, Duration::from_secs(20)).unwrap();
        nl.add_address(index, lease.address, lease.prefix).unwrap();
        nl.add_default_route(index, lease.router.unwrap()).unwrap();
        // The lease extends (renewal from the bound address).
        let renewed = dhcp::renew("cli0", mac, &lease, Duration::from_secs(10)).unwrap();
        assert_eq!(renewed.address, lease.address);
        // A second identical request replaces rather than fails.
        nl.add_address(index, lease.address, lease.prefix).unwrap();
        // The kernel's refusals come back as errors.
        assert!(nl.add_address(9999, lease.address, 24).is_err());
        lease
    });
    let lease = handle.join().unwrap();
    assert!(lease.address.octets()[..3] == [10, 88, 0], "{lease:?}");
    assert_eq!(lease.prefix, 24);
    assert_eq!(lease.server.to_string(), "10.88.0.1");
    let addrs = ip(&client, &["-4", "addr", "show", "cli0"]);
    assert!(
        addrs.contains(&format!("inet {}/24", lease.address)),
        "{addrs}"
    );
    assert!(addrs.contains("brd 10.88.0.255"), "{addrs}");
    let routes = ip(&client, &["-4", "route", "show", "default"]);
    assert!(
        routes.contains("default via 10.88.0.1 dev cli0"),
        "{routes}"
    );
    drop(ns);
    assert!(!std::path::Path::new(&format!("/run/netns/{name}")).exists());
    assert!(!std::path::Path::new(&format!("/run/netns/{client}")).exists());
}
