//! Issue 15: the boot script and the boot token of a MAC, over real HTTP on
//! loopback from distinct source addresses (127.0.0.x):
//!
//! - lease mode: only the address leased to the MAC gets its script and
//!   token cpio; another host asking gets 403 and nothing secret;
//! - the token is never in the script (no `anneal.token=`), only in the
//!   cpio the script adds as a second initrd;
//! - once the token is spent (what the watcher builds after the agent
//!   registered), a replayed fetch gets 410 and no token, from any address;
//! - proxy mode (no leases): the host of the MAC's PXE exchange, and the
//!   token-unused rule (bootd/tests/proxy_token.rs).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

mod common;

use common::{contains, text};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use anneal_bootd::http::{HttpLimits, serve};
use anneal_bootd::script::BOOT_TEMPLATE;
use anneal_bootd::state::BootToken;
use anneal_bootd::{CancellationToken, Shared, StaticConfig};
use anneal_dhcp::{Lease, Leases, Mac};

const TOKEN: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";
const M1: Mac = Mac([0x52, 0x54, 0, 0x15, 0, 1]);
const M2: Mac = Mac([0x52, 0x54, 0, 0x15, 0, 2]);

fn yaml(mode: &str) -> String {
    let gateway = if mode == "lease" {
        ", gateway: \"\""
    } else {
        ""
    };
    format!(
        "serverIP: 127.0.0.1\ncidr: 127.0.0.0/8\ndhcp: {{mode: {mode}{gateway}}}\n\
         api: {{url: \"https://127.0.0.1:8443\", caSha256: \"ab12\"}}\n\
         artifacts: {{kernel: /k, initrd: /i}}\n\
         machines:\n\
         - {{name: lab/m1, mac: \"52:54:00:15:00:01\", console: [ttyS0], token: \"{TOKEN}\"}}\n\
         - {{name: lab/m2, mac: \"52:54:00:15:00:02\", token: \"{TOKEN}x\"}}\n"
    )
}

fn src(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, n))
}

struct Server {
    shared: Arc<Shared>,
    addr: SocketAddr,
    cancel: CancellationToken,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn start(mode: &str, leases: Leases) -> Server {
    start_on(mode, leases, "127.0.0.1:0").await
}

async fn start_on(mode: &str, leases: Leases, bind: &str) -> Server {
    let snap = StaticConfig::from_yaml(&yaml(mode))
        .unwrap()
        .snapshot(8080, "r1".into())
        .unwrap();
    let shared = Arc::new(Shared::new(snap, leases, BOOT_TEMPLATE.to_string()));
    let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cancel = CancellationToken::new();
    tokio::spawn(serve(
        shared.clone(),
        listener,
        HttpLimits::default(),
        cancel.clone(),
    ));
    Server {
        shared,
        addr,
        cancel,
    }
}

/// One GET from source address `from`: status and body.
async fn get(server: &Server, from: IpAddr, path: &str) -> (u16, Vec<u8>) {
    common::http_get_from(server.addr, from, path).await
}

/// Marks `mac`'s token spent, as the watcher does once the Machine's
/// `status.netBoot.tokenHash` is gone (the agent registered).
fn spend(shared: &Shared, mac: Mac) {
    let mut snap = (*shared.snapshot()).clone();
    snap.machines.get_mut(&mac).unwrap().token = BootToken::Spent;
    shared.install(snap);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_serves_script_and_token_only_to_the_leased_address_and_only_once() {
    let now = anneal_bootd::unix_now();
    let leases = Leases::from_leases([Lease {
        mac: M1,
        address: Ipv4Addr::new(127, 0, 0, 2),
        expires: now + 600,
    }]);
    let server = start("lease", leases).await;
    let script = "/ipxe/52-54-00-15-00-01";
    let token = "/token/52-54-00-15-00-01";

    // another host asking for m1's script or token: 403, nothing secret
    for path in [script, token] {
        let (code, body) = get(&server, src(3), path).await;
        assert_eq!(code, 403, "{path} from 127.0.0.3: {}", text(&body));
        assert!(!contains(&body, TOKEN), "{path}: the token leaked");
        let t = text(&body);
        assert!(
            t.contains("lab/m1") && t.contains("127.0.0.2") && t.contains("127.0.0.3"),
            "the refusal names the machine and both addresses: {t}"
        );
    }
    // a MAC without a lease: 403 from anywhere
    let (code, body) = get(&server, src(2), "/ipxe/52-54-00-15-00-02").await;
    assert_eq!(code, 403, "{}", text(&body));
    assert!(text(&body).contains("holds no lease"), "{}", text(&body));

    // the leased address: the script (without the token) and the cpio
    let (code, body) = get(&server, src(2), script).await;
    let s = text(&body);
    assert_eq!(code, 200, "{s}");
    assert!(!s.contains(TOKEN), "the token is in the script:\n{s}");
    assert!(!s.contains("anneal.token"), "{s}");
    for want in [
        "initrd --name initrd.img http://127.0.0.1:8080/boot/initrd",
        "initrd --name anneal-token.cpio http://127.0.0.1:8080/token/52-54-00-15-00-01 || goto failed",
        "initrd=anneal-token.cpio initrd=initrd.img anneal.api=https://127.0.0.1:8443",
        "anneal.machine=lab/m1 BOOTIF=01-52-54-00-15-00-01 console=ttyS0",
    ] {
        assert!(s.contains(want), "missing {want:?} in\n{s}");
    }
    let (code, cpio) = get(&server, src(2), token).await;
    assert_eq!(code, 200);
    assert!(cpio.starts_with(b"070701"), "a newc archive");
    assert!(contains(&cpio, "run/anneal/token") && contains(&cpio, TOKEN));
    assert!(contains(&cpio, "TRAILER!!!"));
    // the token file's mode: 0100600 (regular, 0600) in the newc header
    let at = cpio
        .windows(16)
        .position(|w| w == b"run/anneal/token")
        .unwrap();
    let header = &cpio[..at];
    let start = header.windows(6).rposition(|w| w == b"070701").unwrap();
    assert_eq!(&cpio[start + 14..start + 22], b"00008180", "mode 0100600");

    // after registration the token is spent: a replayed fetch, even from
    // the leased address, gets 410 and nothing usable
    spend(&server.shared, M1);
    for path in [script, token] {
        let (code, body) = get(&server, src(2), path).await;
        assert_eq!(code, 410, "{path} after registration: {}", text(&body));
        assert!(!contains(&body, TOKEN), "{path}: the token leaked");
        assert!(
            text(&body).contains("re-arm"),
            "the refusal says the fix: {}",
            text(&body)
        );
    }
    let m = server.shared.metrics.render();
    assert!(
        m.contains("kind=\"script\",code=\"403\"") && m.contains("kind=\"token\",code=\"410\""),
        "{m}"
    );
}

/// Issue 16, IPv6: a machine that booted over IPv6 (its DHCPv6 lease)
/// gets its script and token from that address, with bootd's IPv6 address
/// in the script's URLs; any other IPv6 address gets 403.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_serves_the_script_to_the_dhcpv6_address_of_the_mac() {
    use anneal_dhcp::v6::LeaseEffect6;
    let server = start_on("lease", Leases::default(), "[::1]:0").await;
    server
        .shared
        .http_base6
        .set("http://[fd77::1]:8080".into())
        .unwrap();
    let here: std::net::Ipv6Addr = "::1".parse().unwrap();
    let lease6 = |addr| {
        server
            .shared
            .leases6
            .lock()
            .unwrap()
            .apply(LeaseEffect6::Bind {
                mac: M1,
                addr,
                expires: anneal_bootd::unix_now() + 600,
            });
    };
    let script = "/ipxe/52-54-00-15-00-01";
    let token = "/token/52-54-00-15-00-01";
    // leased elsewhere: ::1 is refused, nothing secret
    lease6("fd77::50".parse().unwrap());
    for path in [script, token] {
        let (code, body) = get(&server, IpAddr::V6(here), path).await;
        assert_eq!(code, 403, "{path}: {}", text(&body));
        assert!(!contains(&body, TOKEN), "{path}: the token leaked");
        assert!(text(&body).contains("fd77::50"), "{}", text(&body));
    }
    // leased to ::1: the script, its URLs on bootd's IPv6 address
    lease6(here);
    let (code, body) = get(&server, IpAddr::V6(here), script).await;
    let s = text(&body);
    assert_eq!(code, 200, "{s}");
    for want in [
        "initrd --name initrd.img http://[fd77::1]:8080/boot/initrd",
        "initrd --name anneal-token.cpio http://[fd77::1]:8080/token/52-54-00-15-00-01",
        "kernel http://[fd77::1]:8080/boot/kernel ",
    ] {
        assert!(s.contains(want), "missing {want:?} in\n{s}");
    }
    let (code, cpio) = get(&server, IpAddr::V6(here), token).await;
    assert_eq!(code, 200);
    assert!(contains(&cpio, TOKEN));
    // no IPv4 lease was involved: an IPv4 client still needs its own
    assert!(server.shared.leases().get(&M1).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_mode_gates_on_the_pxe_host_and_the_unused_token() {
    let server = start("proxy", Leases::default()).await;
    let script = "/ipxe/52-54-00-15-00-02";
    let token = "/token/52-54-00-15-00-02";
    // no leases in proxy mode: the host of the MAC's PXE exchange (issue
    // 41; bootd/tests/proxy_token.rs does the exchange over DHCP) may
    // fetch while the token is unused, no other
    server.shared.record_pxe_exchange(M2, Some(src(4)));
    let (code, body) = get(&server, src(4), script).await;
    assert_eq!(code, 200, "{}", text(&body));
    assert!(!contains(&body, TOKEN), "the token is in the script");
    let (code, body) = get(&server, src(4), token).await;
    assert_eq!(code, 200);
    assert!(contains(&body, &format!("{TOKEN}x")));
    let (code, body) = get(&server, src(5), token).await;
    assert_eq!(code, 403, "{}", text(&body));
    assert!(!contains(&body, TOKEN));
    spend(&server.shared, M2);
    for path in [script, token] {
        let (code, body) = get(&server, src(4), path).await;
        assert_eq!(code, 410, "{path}: {}", text(&body));
        assert!(!contains(&body, TOKEN));
    }
    // m1 is untouched (its own exchange, with no address: the first asks)
    server.shared.record_pxe_exchange(M1, None);
    let (code, _) = get(&server, src(4), "/ipxe/52-54-00-15-00-01").await;
    assert_eq!(code, 200);
}
