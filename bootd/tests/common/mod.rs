//! Shared by bootd's namespace tests: a server and a client namespace
//! joined by a veth pair, a DHCP client socket, packets and replies.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod process;

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::time::Duration;

use anneal_testinfra::Netns;

/// bootd's address on `s0`.
pub const SERVER: Ipv4Addr = Ipv4Addr::new(10, 88, 0, 1);

/// Server namespace (`s0`, 10.88.0.1/16) and client namespace (`c0`,
/// 10.88.255.254/16: the source of its datagrams) joined by a veth pair
/// (MTU 1500).
pub fn topology(prefix: &str) -> (Netns, Netns) {
    let server = Netns::bare(&format!("{prefix}s")).unwrap();
    let client = Netns::bare(&format!("{prefix}c")).unwrap();
    server
        .link(&client, "s0", "10.88.0.1/16", "c0", "10.88.255.254/16")
        .unwrap();
    (server, client)
}

/// A lease-mode boot table answering every MAC from a /16 pool.
pub const ANSWER_ALL_YAML: &str = "subnet: lab/t\nserverIP: 10.88.0.1\ncidr: 10.88.0.0/16\n\
    dhcp: {mode: lease, gateway: \"\", leaseTime: 1h, leaseRange: {start: 10.88.1.0, end: 10.88.250.250}}\n\
    answerAll: true\napi: {url: \"https://10.88.0.1:8443\", caSha256: \"ab12\"}\n";

/// A client's DHCP datagram: `msg` (option 53), then `extra` options, then end.
pub fn dhcp_packet(mac: [u8; 6], xid: u32, broadcast: bool, msg: u8, extra: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 240];
    p[0] = 1;
    p[1] = 1;
    p[2] = 6;
    p[4..8].copy_from_slice(&xid.to_be_bytes());
    if broadcast {
        p[10] = 0x80;
    }
    p[28..34].copy_from_slice(&mac);
    p[236..240].copy_from_slice(&[99, 130, 83, 99]);
    p.extend_from_slice(&[53, 1, msg]);
    p.extend_from_slice(extra);
    p.push(255);
    p
}

/// xid, message type (option 53) and yiaddr of a server's reply.
pub fn parse_reply(b: &[u8]) -> Option<(u32, u8, Ipv4Addr)> {
    if b.len() < 244 || b[0] != 2 {
        return None;
    }
    let xid = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
    let yi = Ipv4Addr::new(b[16], b[17], b[18], b[19]);
    let mut k = 240;
    while k + 1 < b.len() && b[k] != 255 {
        if b[k] == 0 {
            k += 1;
            continue;
        }
        let l = usize::from(b[k + 1]);
        if b[k] == 53 && l == 1 && k + 2 < b.len() {
            return Some((xid, b[k + 2], yi));
        }
        k += 2 + l;
    }
    None
}

/// A DHCP client's socket: 0.0.0.0:68 on `iface`, broadcast allowed, reads
/// time out after `timeout`. Call inside the client namespace.
pub fn client_socket(iface: &str, timeout: Duration) -> UdpSocket {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).unwrap();
    s.set_reuse_address(true).unwrap();
    s.set_broadcast(true).unwrap();
    s.bind_device(Some(iface.as_bytes())).unwrap();
    s.bind(&SocketAddr::from(([0, 0, 0, 0], 68)).into())
        .unwrap();
    s.set_recv_buffer_size(4 << 20).unwrap();
    s.set_read_timeout(Some(timeout)).unwrap();
    s.into()
}

/// One HTTP GET to `to` from source address `from` (`Connection: close`):
/// status and body.
pub async fn http_get_from(to: SocketAddr, from: std::net::IpAddr, path: &str) -> (u16, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = if from.is_ipv6() {
        tokio::net::TcpSocket::new_v6().unwrap()
    } else {
        tokio::net::TcpSocket::new_v4().unwrap()
    };
    s.bind(SocketAddr::new(from, 0)).unwrap();
    let mut c = s.connect(to).await.unwrap();
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut raw = Vec::new();
    c.read_to_end(&mut raw).await.unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP response: {raw:?}"));
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap();
    (code, raw[split + 4..].to_vec())
}

/// `b` as text (lossy).
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).to_string()
}

/// Whether `hay` holds `needle`.
pub fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}
