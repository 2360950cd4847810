//! The DHCPv6 shell: `[::]:547` on the serving interface (ff02::1:2
//! joined), decode, decide ([`anneal_dhcp::v6`]), send, account.
//!
//! The answers come from the same snapshot as DHCPv4's (mode, MAC gate,
//! answer-all, boot files) plus the IPv6 settings of [`Dhcp6Options`]: the
//! prefix, bootd's IPv6 address (the host of the `tftp://[…]/` and
//! `http://[…]:port/` URLs), the range machines without an IPv6
//! reservation get addresses from, DNS servers and lifetimes. IPv6
//! bindings are kept in memory (a restart hands the same MAC the same
//! address again: the range address is picked from the MAC).

use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6};
use std::sync::{Arc, Mutex};

use anneal_api::error_chain;
use anneal_dhcp::Mac;
use anneal_dhcp::v6::{
    BootTable6, Cidr6, Decision6, DropReason6, Duid, Ingress6, Leases6, MachineEntry6, MsgType,
    handle6,
};
use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use crate::metrics::{PacketLabels, ReasonLabels};
use crate::state::Shared;

/// The All_DHCP_Relay_Agents_and_Servers group (RFC 8415 7.1).
pub const ALL_SERVERS: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 1, 2);

/// IPv6 settings of a Subnet's segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dhcp6Options {
    /// bootd's address on the segment (TFTP and HTTP listen on it too).
    pub server_ip: Ipv6Addr,
    /// The on-link prefix.
    pub prefix: Cidr6,
    /// Addresses for machines without an IPv6 reservation (inclusive).
    pub range: Option<(Ipv6Addr, Ipv6Addr)>,
    pub dns: Vec<Ipv6Addr>,
    /// Seconds.
    pub preferred_lifetime: u32,
    /// Seconds.
    pub valid_lifetime: u32,
}

/// The table DHCPv6 answers from: the live snapshot's machines, mode and
/// boot files with the IPv6 settings; `server_mac` makes the DUID-LL.
pub fn table6(shared: &Shared, o: &Dhcp6Options, server_mac: Mac, http_port: u16) -> BootTable6 {
    let snap = shared.snapshot();
    let t = &snap.table;
    BootTable6 {
        mode: t.mode,
        server_duid: Duid::ll_ethernet(server_mac),
        server_ip: o.server_ip,
        prefix: o.prefix,
        dns: o.dns.clone(),
        preferred_lifetime: o.preferred_lifetime,
        valid_lifetime: o.valid_lifetime,
        lease_range: o.range,
        answer_all: t.answer_all,
        boot_files: t.boot_files.clone(),
        http_base: format!("http://[{}]:{http_port}", o.server_ip),
        boot_params: Vec::new(),
        machines: t
            .machines
            .iter()
            .map(|(mac, m)| {
                (
                    *mac,
                    MachineEntry6 {
                        name: m.name.clone(),
                        // the IPv6 reservation of the Subnet's status
                        address: snap.machines.get(mac).and_then(|b| b.ipv6_address),
                    },
                )
            })
            .collect(),
    }
}

/// A UDP socket on `[::]:port` bound to `iface`, in ff02::1:2 there.
pub fn udp_socket6(port: u16, iface: &str) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let index = nix::net::if_::if_nametoindex(iface).map_err(std::io::Error::from)?;
    let s = Socket::new(Domain::IPV6, Type::DGRAM, Some(Protocol::UDP))?;
    s.set_only_v6(true)?;
    s.set_reuse_address(true)?;
    s.bind_device(Some(iface.as_bytes()))?;
    s.set_nonblocking(true)?;
    s.bind(&SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, port, 0, 0)).into())?;
    s.join_multicast_v6(&ALL_SERVERS, index)?;
    Ok(s.into())
}

/// The MAC of `iface` (the server DUID-LL), asked of the kernel over
/// netlink (`getifaddrs`: the caller's network namespace, unlike sysfs).
pub fn interface_mac(iface: &str) -> Option<Mac> {
    nix::ifaddrs::getifaddrs().ok()?.find_map(|a| {
        if a.interface_name != iface {
            return None;
        }
        let ll = a.address?;
        let ll = ll.as_link_addr()?;
        ll.addr().map(Mac)
    })
}

fn count(shared: &Shared, msg: &str, outcome: &str) {
    shared
        .metrics
        .packets
        .get_or_create(&PacketLabels {
            msg_type: format!("v6_{msg}"),
            outcome: outcome.into(),
        })
        .inc();
}

/// Handles one datagram; returns what to send and where.
pub fn handle(
    shared: &Shared,
    table: &BootTable6,
    leases: &Mutex<Leases6>,
    bytes: &[u8],
    ingress: Ingress6,
    now: u64,
) -> Option<(Vec<u8>, SocketAddrV6)> {
    let msg = bytes
        .first()
        .map_or("unknown", |b| MsgType::from_u8(*b).label());
    let decision = {
        let l = leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        handle6(bytes, ingress, table, &l, now)
    };
    match decision {
        Decision6::Reply(r) => {
            // proxy mode: the source is link-local, not the address the
            // client fetches from: the first to ask after it is bound
            if table.mode == anneal_dhcp::Mode::Proxy
                && let Some(mac) = r.mac
            {
                shared.record_pxe_exchange(mac, None);
            }
            if let Some(e) = r.effect {
                leases
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .apply(e);
            }
            count(shared, msg, r.msg_type.label());
            tracing::info!(
                src = %ingress.src,
                msg,
                reply = r.msg_type.label(),
                address = %r.address.map(|a| a.to_string()).unwrap_or_default(),
                boot = r.boot.as_deref().unwrap_or(""),
                "answered (dhcpv6)"
            );
            Some((r.bytes, r.dest))
        }
        Decision6::Drop { reason } => {
            if let DropReason6::Malformed(m) = reason {
                shared
                    .metrics
                    .malformed
                    .get_or_create(&ReasonLabels {
                        reason: m.label().into(),
                    })
                    .inc();
            }
            count(shared, msg, &format!("drop_{}", reason.label()));
            tracing::info!(src = %ingress.src, msg, len = bytes.len(), why = %reason, "no answer (dhcpv6)");
            None
        }
    }
}

/// Serves DHCPv6 on `sock` until cancelled.
pub async fn serve(
    shared: Arc<Shared>,
    sock: UdpSocket,
    opts: Dhcp6Options,
    server_mac: Mac,
    http_port: u16,
    cancel: CancellationToken,
) {
    let leases = &shared.leases6;
    let _ = shared
        .http_base6
        .set(format!("http://[{}]:{http_port}", opts.server_ip));
    let mut buf = vec![0u8; 65536];
    let mut collected_at = 0u64;
    loop {
        let r = tokio::select! {
            () = cancel.cancelled() => return,
            r = sock.recv_from(&mut buf) => r,
        };
        let (n, src) = match r {
            Ok((n, SocketAddr::V6(src))) => (n, src),
            Ok(_) => continue,
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "dhcpv6 receive failed");
                continue;
            }
        };
        let now = crate::unix_now();
        if now >= collected_at + crate::LEASE_COLLECT_INTERVAL.as_secs() {
            leases
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .collect(now);
            collected_at = now;
        }
        let table = table6(&shared, &opts, server_mac, http_port);
        let ingress = Ingress6 {
            src,
            link_mac: None,
        };
        if let Some((bytes, to)) = handle(&shared, &table, leases, &buf[..n], ingress, now)
            && let Err(e) = sock.send_to(&bytes, to).await
        {
            tracing::warn!(to = %to, error = %error_chain(&e), "dhcpv6 send failed");
        }
    }
}
