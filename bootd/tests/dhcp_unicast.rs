//! RFC 2131 4.1: an OFFER and ACK to a client without the broadcast flag,
//! giaddr and ciaddr go to yiaddr at chaddr (bootd sets the neighbour
//! entry); with the flag they are broadcast. The client namespace captures
//! the frames with an AF_PACKET socket and reads their destinations.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use anneal_bootd::{NetnsServer, ServerOptions, StaticConfig, in_netns};
use common::{ANSWER_ALL_YAML, SERVER, client_socket, dhcp_packet, parse_reply, topology};

mod common;

/// The client's MAC (c0's address, and chaddr).
const MAC: [u8; 6] = [0x02, 0x55, 0x00, 0x00, 0x00, 0x01];
/// A second client that sets the broadcast flag.
const MAC_B: [u8; 6] = [0x02, 0x55, 0x00, 0x00, 0x00, 0x02];

/// One captured DHCP reply: destination MAC, destination IP, message type,
/// yiaddr.
#[derive(Debug)]
struct Frame {
    dst_mac: [u8; 6],
    dst_ip: Ipv4Addr,
    msg: u8,
    yiaddr: Ipv4Addr,
}

/// A packet socket seeing every frame in the calling thread's namespace.
fn capture() -> socket2::Socket {
    use socket2::{Domain, Protocol, Socket, Type};
    let all = i32::from((libc::ETH_P_ALL as u16).to_be());
    let s = Socket::new(Domain::PACKET, Type::RAW, Some(Protocol::from(all))).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    s
}

/// Reads frames until a DHCP reply (UDP to port 68) with `xid` arrives.
fn next_reply(cap: &socket2::Socket, xid: u32, deadline: Instant) -> Option<Frame> {
    let mut f = vec![0u8; 65536];
    while Instant::now() < deadline {
        let Ok(n) = (&mut &*cap).read(&mut f) else {
            continue;
        };
        let f = &f[..n];
        // Ethernet, IPv4, UDP
        if f.len() < 14 + 20 + 8 + 244 || f[12..14] != [0x08, 0x00] || f[23] != 17 {
            continue;
        }
        let udp = 14 + usize::from(f[14] & 0x0f) * 4;
        if f.len() < udp + 8 || f[udp + 2..udp + 4] != 68u16.to_be_bytes() {
            continue;
        }
        let Some((x, msg, yiaddr)) = parse_reply(&f[udp + 8..]) else {
            continue;
        };
        if x != xid {
            continue;
        }
        let mut dst_mac = [0u8; 6];
        dst_mac.copy_from_slice(&f[..6]);
        return Some(Frame {
            dst_mac,
            dst_ip: Ipv4Addr::new(f[30], f[31], f[32], f[33]),
            msg,
            yiaddr,
        });
    }
    None
}

/// DISCOVER then REQUEST from `mac` with or without the broadcast flag;
/// the captured OFFER and ACK.
fn dora(mac: [u8; 6], xid: u32, broadcast: bool) -> (Option<Frame>, Option<Frame>) {
    let cap = capture();
    let sock = client_socket("c0", Duration::from_millis(50));
    let to = SocketAddr::from(([255, 255, 255, 255], 67));
    let deadline = Instant::now() + Duration::from_secs(10);
    sock.send_to(&dhcp_packet(mac, xid, broadcast, 1, &[]), to)
        .unwrap();
    let offer = next_reply(&cap, xid, deadline);
    let Some(o) = &offer else {
        return (None, None);
    };
    let mut opts = vec![50, 4];
    opts.extend_from_slice(&o.yiaddr.octets());
    opts.extend_from_slice(&[54, 4]);
    opts.extend_from_slice(&SERVER.octets());
    sock.send_to(&dhcp_packet(mac, xid, broadcast, 3, &opts), to)
        .unwrap();
    let ack = next_reply(&cap, xid, deadline);
    (offer, ack)
}

#[test]
fn offer_and_ack_unicast_to_yiaddr_at_chaddr_without_broadcast_flag() {
    let (server, client) = topology("bdu");
    let mac = MAC
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
    client.ip(&["link", "set", "c0", "address", &mac]).unwrap();
    let snap = StaticConfig::from_yaml(ANSWER_ALL_YAML)
        .unwrap()
        .snapshot(8080, "rev-1".into())
        .unwrap();
    let srv = NetnsServer::start(
        server.name(),
        ServerOptions {
            interface: Some("s0".into()),
            listen_ip: SERVER,
            pxe_port: 0,
            tftp_port: 0,
            http_port: anneal_testinfra::free_port().unwrap(),
            ..ServerOptions::default()
        },
        snap,
    )
    .unwrap();
    let (offer, ack) = in_netns(client.name(), || dora(MAC, 0x0e00_0001, false)).unwrap();
    let metrics = || srv.shared().metrics.render();
    for (what, f, ty) in [("OFFER", offer, 2), ("ACK", ack, 5)] {
        let f =
            f.unwrap_or_else(|| panic!("no {what} captured within 10 s; bootd:\n{}", metrics()));
        assert_eq!(f.msg, ty, "{what}: {f:?}");
        assert!(!f.yiaddr.is_unspecified(), "{what}: {f:?}");
        assert_eq!(
            (f.dst_mac, f.dst_ip),
            (MAC, f.yiaddr),
            "{what} to a client without the broadcast flag must go to yiaddr at chaddr, got {f:?}"
        );
    }
    let (offer, ack) = in_netns(client.name(), || dora(MAC_B, 0x0e00_0002, true)).unwrap();
    for (what, f) in [("OFFER", offer), ("ACK", ack)] {
        let f =
            f.unwrap_or_else(|| panic!("no {what} captured within 10 s; bootd:\n{}", metrics()));
        assert_eq!(
            (f.dst_mac, f.dst_ip),
            ([0xff; 6], Ipv4Addr::BROADCAST),
            "{what} with the broadcast flag must be broadcast, got {f:?}"
        );
    }
    assert!(
        !metrics().contains("bootd_dhcp_unicast_fallback_total{"),
        "{}",
        metrics()
    );
    srv.stop();
}
