//! In proxy mode (bootd holds no leases; docs/api.md, "Boot token delivery") a
//! machine's unused boot token, and its boot script, go only to the host that
//! did the PXE exchange for its MAC with this bootd, over real DHCP (port
//! 4011) and HTTP on loopback, two hosts being two source addresses
//! (127.0.0.x):
//!
//! - no exchange seen for a MAC: 403 from any address;
//! - an exchange from an address (a port 4011 REQUEST from 127.0.0.2):
//!   only that address gets the script and the token cpio, another gets
//!   403 naming the MAC and both addresses, and nothing secret;
//! - an exchange from a client without an address yet (a DISCOVER from
//!   0.0.0.0, through the DHCP shell): the first address to ask after it is
//!   bound, others are refused, and a new exchange binds anew;
//! - a spent token: 410 from every address, the bound one too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

mod common;

use common::{contains, text};
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::Duration;

use anneal_bootd::state::BootToken;
use anneal_bootd::{Server, Shared, StaticConfig};
use anneal_dhcp::{Ingress, Mac, ServerPort};

const TOKEN: &str = "41e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f041";
const M1: Mac = Mac([0x52, 0x54, 0, 0x41, 0, 1]);
const SCRIPT1: &str = "/ipxe/52-54-00-41-00-01";
const TOKEN1: &str = "/token/52-54-00-41-00-01";

const YAML: &str = "serverIP: 127.0.0.1\ncidr: 127.0.0.0/8\ndhcp: {mode: proxy}\n\
     api: {url: \"https://127.0.0.1:8443\", caSha256: \"ab12\"}\n\
     artifacts: {kernel: /k, initrd: /i}\n\
     machines:\n\
     - {name: lab/m1, mac: \"52:54:00:41:00:01\", token: \"41e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f041\"}\n\
     - {name: lab/m2, mac: \"52:54:00:41:00:02\", token: \"41e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f041x\"}\n";

fn src(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, n))
}

/// A free UDP port on 0.0.0.0 (bound, read, released).
fn free_udp_port() -> u16 {
    UdpSocket::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// bootd in proxy mode: DHCP and PXE (4011) on free ports of 0.0.0.0,
/// HTTP on 127.0.0.1 port 0, TFTP off. Returns it and its PXE port.
async fn start() -> (Server, u16) {
    let snap = StaticConfig::from_yaml(YAML)
        .unwrap()
        .snapshot(8080, "r1".into())
        .unwrap();
    let pxe_port = free_udp_port();
    let opts = anneal_bootd::ServerOptions {
        listen_ip: Ipv4Addr::LOCALHOST,
        dhcp_port: free_udp_port(),
        pxe_port,
        tftp_port: 0,
        http_port: 0,
        ..Default::default()
    };
    (Server::start(opts, snap).await.unwrap(), pxe_port)
}

/// One GET from source address `from`: status and body.
async fn get(server: &Server, from: IpAddr, path: &str) -> (u16, Vec<u8>) {
    common::http_get_from(server.http_addr, from, path).await
}

/// Options of a BIOS PXE client: vendor class `PXEClient...`, arch 0.
fn pxe_options() -> Vec<u8> {
    let class = b"PXEClient:Arch:00000:UNDI:002001";
    let mut o = vec![60, class.len() as u8];
    o.extend_from_slice(class);
    o.extend_from_slice(&[93, 2, 0, 0]);
    o
}

/// A real PXE exchange from `host`: a REQUEST to bootd's port 4011 with
/// `ciaddr` = `host`, as firmware sends once it holds an address; returns
/// when bootd's ACK arrived.
fn pxe_exchange_from(host: Ipv4Addr, pxe_port: u16, mac: Mac) {
    let c = UdpSocket::bind(SocketAddrV4::new(host, 0)).unwrap();
    // a bound on a hung test only: the ACK is the event waited for
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut p = common::dhcp_packet(mac.0, 0x4141, false, 3, &pxe_options());
    p[12..16].copy_from_slice(&host.octets());
    c.send_to(&p, (Ipv4Addr::LOCALHOST, pxe_port)).unwrap();
    let mut buf = [0u8; 1500];
    let (n, _) = c.recv_from(&mut buf).unwrap();
    let (xid, msg, _) = common::parse_reply(&buf[..n]).expect("a DHCP reply");
    assert_eq!((xid, msg), (0x4141, 5), "an ACK to the PXE request");
}

/// A PXE DISCOVER from a client that holds no address yet (source
/// 0.0.0.0:68, which loopback cannot send from), through bootd's DHCP
/// shell: bootd answers it with a proxy OFFER.
fn pxe_discover_without_address(shared: &Shared, mac: Mac) {
    let p = common::dhcp_packet(mac.0, 0x4242, true, 1, &pxe_options());
    let ingress = Ingress {
        port: ServerPort::Dhcp,
        src: SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 68),
    };
    let answer = anneal_bootd::dhcp::handle(shared, &p, ingress, anneal_bootd::unix_now())
        .expect("a proxy OFFER");
    let (xid, msg, yiaddr) = common::parse_reply(&answer.bytes).unwrap();
    assert_eq!((xid, msg, yiaddr), (0x4242, 2, Ipv4Addr::UNSPECIFIED));
}

/// Marks `mac`'s token spent, as the watcher does once the agent registered.
fn spend(shared: &Shared, mac: Mac) {
    let mut snap = (*shared.snapshot()).clone();
    snap.machines.get_mut(&mac).unwrap().token = BootToken::Spent;
    shared.install(snap);
}

/// Asserts that `from` gets 403 for m1's script and token, the refusal
/// naming the MAC, `bound` (when given) and `from`, and no token.
async fn refused(server: &Server, from: IpAddr, bound: Option<IpAddr>) {
    for path in [SCRIPT1, TOKEN1] {
        let (code, body) = get(server, from, path).await;
        let t = text(&body);
        assert_eq!(code, 403, "{path} from {from}: {t}");
        assert!(!contains(&body, TOKEN), "{path}: the token leaked");
        assert!(
            t.contains("52:54:00:41:00:01") && t.contains(&from.to_string()),
            "the refusal names the MAC and the asking address: {t}"
        );
        if let Some(b) = bound {
            assert!(t.contains(&b.to_string()), "and the bound host: {t}");
        }
    }
}

/// Asserts that `from` gets m1's script (without the token) and its cpio.
async fn served(server: &Server, from: IpAddr) {
    let (code, body) = get(server, from, SCRIPT1).await;
    assert_eq!(code, 200, "script from {from}: {}", text(&body));
    assert!(!contains(&body, TOKEN), "the token is in the script");
    let (code, body) = get(server, from, TOKEN1).await;
    assert_eq!(code, 200, "token from {from}: {}", text(&body));
    assert!(contains(&body, TOKEN), "the cpio holds the token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_mode_serves_the_token_only_to_the_host_of_the_pxe_exchange() {
    let (server, pxe_port) = start().await;
    // no exchange for m1 yet: nobody gets its token
    let (code, body) = get(&server, src(2), TOKEN1).await;
    assert_eq!(code, 403, "{}", text(&body));
    assert!(text(&body).contains("answered none"), "{}", text(&body));
    assert!(!contains(&body, TOKEN));

    // 127.0.0.2 does the PXE exchange on port 4011
    let host = Ipv4Addr::new(127, 0, 0, 2);
    let pxe = std::thread::spawn(move || pxe_exchange_from(host, pxe_port, M1));
    tokio::task::spawn_blocking(move || pxe.join().unwrap())
        .await
        .unwrap();
    // another host: refused, before and after the right one fetched
    refused(&server, src(3), Some(src(2))).await;
    served(&server, src(2)).await;
    refused(&server, src(3), Some(src(2))).await;
    // m2 did no exchange: refused even from the host that did m1's
    let (code, body) = get(&server, src(2), "/token/52-54-00-41-00-02").await;
    assert_eq!(code, 403, "{}", text(&body));
    let m = server.shared().metrics.render();
    assert!(
        m.contains("kind=\"script\",code=\"403\"") && m.contains("kind=\"token\",code=\"403\""),
        "{m}"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_mode_binds_the_first_host_to_ask_after_an_exchange_without_an_address() {
    let (server, _) = start().await;
    let shared = server.shared().clone();
    pxe_discover_without_address(&shared, M1);
    // the first to ask after it is bound: 127.0.0.4
    served(&server, src(4)).await;
    refused(&server, src(5), Some(src(4))).await;
    served(&server, src(4)).await;

    // the machine boots again (new exchange): the binding starts afresh
    pxe_discover_without_address(&shared, M1);
    served(&server, src(5)).await;
    refused(&server, src(4), Some(src(5))).await;

    // once spent (the agent registered): 410 from everyone, the host too
    spend(&shared, M1);
    for from in [src(5), src(4)] {
        for path in [SCRIPT1, TOKEN1] {
            let (code, body) = get(&server, from, path).await;
            assert_eq!(code, 410, "{path} from {from}: {}", text(&body));
            assert!(!contains(&body, TOKEN));
        }
    }
    server.shutdown().await;
}
