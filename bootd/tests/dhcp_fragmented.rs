//! Fragmented DHCP: a DISCOVER larger than the link's MTU (legal with
//! option 57) crosses a veth pair with MTU 1500 as IP fragments, is
//! reassembled by the kernel and answered; the OFFER stays within the
//! client's option 57 (or 576 without it), IP and UDP headers counted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anneal_bootd::{NetnsServer, ServerOptions, StaticConfig, in_netns};
use common::{ANSWER_ALL_YAML, client_socket, dhcp_packet, parse_reply, topology};

mod common;

/// `Ip: ReasmOKs` of the calling thread's network namespace.
fn reassembled() -> u64 {
    let snmp = std::fs::read_to_string("/proc/thread-self/net/snmp").unwrap();
    let mut ip = snmp.lines().filter(|l| l.starts_with("Ip: "));
    let (names, values) = (ip.next().unwrap(), ip.next().unwrap());
    let i = names
        .split_whitespace()
        .position(|n| n == "ReasmOKs")
        .unwrap();
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}

/// A DISCOVER of more than 2,000 bytes: eight option-224 blocks of 250
/// bytes (concatenated, RFC 3396), option 57 when given.
fn big_discover(mac: [u8; 6], xid: u32, max_size: Option<u16>) -> Vec<u8> {
    let mut o = Vec::new();
    if let Some(m) = max_size {
        o.extend_from_slice(&[57, 2]);
        o.extend_from_slice(&m.to_be_bytes());
    }
    for _ in 0..8 {
        o.extend_from_slice(&[224, 250]);
        o.extend_from_slice(&[0xaa; 250]);
    }
    dhcp_packet(mac, xid, true, 1, &o)
}

/// Sends `p` until an OFFER for `xid` arrives (10 s at most); its length.
fn offer_len(p: Vec<u8>, xid: u32) -> Option<usize> {
    let sock = client_socket("c0", Duration::from_millis(200));
    let to = SocketAddr::from(([255, 255, 255, 255], 67));
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = vec![0u8; 65536];
    let mut sent = Instant::now() - Duration::from_secs(10);
    while Instant::now() < deadline {
        if sent.elapsed() > Duration::from_secs(1) {
            sock.send_to(&p, to).unwrap();
            sent = Instant::now();
        }
        let Ok(n) = sock.recv(&mut buf) else { continue };
        if let Some((x, 2, _)) = parse_reply(&buf[..n])
            && x == xid
        {
            return Some(n);
        }
    }
    None
}

#[test]
fn discover_larger_than_the_mtu_is_answered_within_option_57() {
    let (server, client) = topology("bdf");
    for (ns, dev) in [(&server, "s0"), (&client, "c0")] {
        ns.ip(&["link", "set", dev, "mtu", "1500"]).unwrap();
    }
    let snap = StaticConfig::from_yaml(ANSWER_ALL_YAML)
        .unwrap()
        .snapshot(8080, "rev-1".into())
        .unwrap();
    let srv = NetnsServer::start(
        server.name(),
        ServerOptions {
            interface: Some("s0".into()),
            listen_ip: common::SERVER,
            pxe_port: 0,
            tftp_port: 0,
            http_port: anneal_testinfra::free_port().unwrap(),
            ..ServerOptions::default()
        },
        snap,
    )
    .unwrap();
    let before = in_netns(server.name(), reassembled).unwrap();
    for (xid, max, limit) in [
        (0x0f00_0001u32, Some(2500u16), 2500 - 28),
        (0x0f00_0002, None, 548),
    ] {
        let p = big_discover([0x02, 0x46, 0, 0, 0, xid as u8], xid, max);
        assert!(p.len() > 2000, "{}", p.len());
        let len = in_netns(client.name(), move || offer_len(p, xid)).unwrap();
        let Some(len) = len else {
            panic!(
                "no OFFER within 10 s to a DISCOVER of more than 2,000 bytes (option 57 {max:?}); bootd counted:\n{}",
                srv.shared().metrics.render()
            );
        };
        assert!(
            len <= limit,
            "OFFER of {len} bytes exceeds the client's limit of {limit} (option 57 {max:?} less IP and UDP headers)"
        );
    }
    let after = in_netns(server.name(), reassembled).unwrap();
    assert!(
        after >= before + 2,
        "the DISCOVERs were not IP-fragmented and reassembled (ReasmOKs {before} -> {after})"
    );
    srv.stop();
}
