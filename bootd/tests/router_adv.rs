//! bootd's router advertisements (`ServerOptions::router_advertisements`,
//! docs/bootd.md "DHCPv6 and router advertisements") between two namespaces:
//! the client hears an RA with the managed and other flags and the prefix,
//! its kernel installs the on-link prefix route from it, and a Router
//! Solicitation is answered no sooner than MIN_DELAY_BETWEEN_RAS after the
//! previous RA and well before the next unsolicited one.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::io::Read;
use std::net::{Ipv6Addr, SocketAddrV6};
use std::time::{Duration, Instant};

use anneal_bootd::{NetnsServer, ServerOptions, StaticConfig, in_netns, ra};
use common::{ANSWER_ALL_YAML, SERVER, topology};

mod common;

fn wait_no_tentative(ns: &anneal_testinfra::Netns, dev: &str) {
    let t = Instant::now();
    while ns
        .ip(&["-6", "addr", "show", "dev", dev])
        .unwrap()
        .contains("tentative")
    {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{dev} stays tentative"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Receives ICMPv6 until an RA arrives or `deadline`: (bytes, when).
fn next_ra(s: &socket2::Socket, deadline: Instant) -> Option<(Vec<u8>, Instant)> {
    let mut buf = [0u8; 1500];
    while Instant::now() < deadline {
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(left.max(Duration::from_millis(10))))
            .unwrap();
        let Ok(n) = (&mut &*s).read(&mut buf) else {
            continue;
        };
        if buf.first() == Some(&134) {
            return Some((buf[..n].to_vec(), Instant::now()));
        }
    }
    None
}

#[test]
fn router_advertisements_are_sent_and_solicitations_answered() {
    let (server, client) = topology("bra");
    server
        .ip(&["-6", "addr", "add", "fd88::1/64", "dev", "s0", "nodad"])
        .unwrap();
    wait_no_tentative(&server, "s0");
    wait_no_tentative(&client, "c0");
    let snap = StaticConfig::from_yaml(ANSWER_ALL_YAML)
        .unwrap()
        .snapshot(8080, "rev-1".into())
        .unwrap();
    let cap = in_netns(client.name(), || {
        let s = socket2::Socket::new(
            socket2::Domain::IPV6,
            socket2::Type::RAW,
            Some(socket2::Protocol::ICMPV6),
        )
        .unwrap();
        s.set_multicast_hops_v6(255).unwrap();
        s
    })
    .unwrap();
    let _srv = NetnsServer::start(
        server.name(),
        ServerOptions {
            interface: Some("s0".into()),
            listen_ip: SERVER,
            dhcp_port: 0,
            pxe_port: 0,
            tftp_port: 0,
            http_port: anneal_testinfra::free_port().unwrap(),
            dhcp6: Some(anneal_bootd::dhcp6::Dhcp6Options {
                server_ip: "fd88::1".parse().unwrap(),
                prefix: "fd88::/64".parse().unwrap(),
                range: None,
                dns: vec![],
                preferred_lifetime: 600,
                valid_lifetime: 900,
            }),
            router_advertisements: true,
            ..ServerOptions::default()
        },
        snap,
    )
    .unwrap();
    let (first, at) =
        next_ra(&cap, Instant::now() + Duration::from_secs(20)).expect("an RA within 20 s");
    assert_eq!(first[5], ra::FLAG_MANAGED | ra::FLAG_OTHER, "{first:?}");
    let prefix: Ipv6Addr = "fd88::".parse().unwrap();
    assert!(first.windows(16).any(|w| w == prefix.octets()), "{first:?}");
    // a Router Solicitation from the client: answered after the 3 s
    // minimum gap, long before the next unsolicited one (10 s at least)
    let index = in_netns(client.name(), || {
        nix::net::if_::if_nametoindex("c0").unwrap()
    })
    .unwrap();
    cap.set_multicast_if_v6(index).unwrap();
    let to = SocketAddrV6::new(ra::ALL_ROUTERS, 0, 0, index);
    cap.send_to(&[133, 0, 0, 0, 0, 0, 0, 0], &to.into())
        .unwrap();
    let (_, again) =
        next_ra(&cap, Instant::now() + Duration::from_secs(8)).expect("an RA answering the RS");
    let gap = again - at;
    println!("RA answering the solicitation {gap:?} after the first");
    assert!(gap >= Duration::from_millis(2900), "{gap:?}");
    assert!(
        gap <= ra::MIN_DELAY_BETWEEN_RAS + ra::MAX_RA_DELAY + Duration::from_secs(1),
        "{gap:?}"
    );
    // the client's kernel took the prefix as on-link
    let t = Instant::now();
    loop {
        let routes = client.ip(&["-6", "route", "show", "dev", "c0"]).unwrap();
        if routes.contains("fd88::/64") {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "no on-link route: {routes}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
