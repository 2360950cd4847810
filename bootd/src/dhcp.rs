//! The DHCP shell: sockets on 67 and 4011, decode, decide, send, account.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;

use anneal_api::error_chain;
use anneal_dhcp::{Decision, Dest, DropReason, Ingress, Request, ServerPort, decide};
use dhcproto::v4::MessageType;
use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use crate::metrics::{PacketLabels, ReasonLabels};
use crate::state::Shared;

/// A UDP socket for DHCP: broadcast allowed, address reusable, optionally
/// bound to one interface (so broadcasts leave through it and only its
/// traffic is seen).
pub fn udp_socket(addr: SocketAddrV4, iface: Option<&str>) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    s.set_reuse_address(true)?;
    s.set_broadcast(true)?;
    if let Some(i) = iface {
        s.bind_device(Some(i.as_bytes()))?;
    }
    s.set_nonblocking(true)?;
    s.bind(&SocketAddr::V4(addr).into())?;
    Ok(s.into())
}

fn type_label(t: MessageType) -> &'static str {
    match t {
        MessageType::Discover => "discover",
        MessageType::Offer => "offer",
        MessageType::Request => "request",
        MessageType::Decline => "decline",
        MessageType::Ack => "ack",
        MessageType::Nak => "nak",
        MessageType::Release => "release",
        MessageType::Inform => "inform",
        _ => "other",
    }
}

fn count(shared: &Shared, msg: &str, outcome: &str) {
    shared
        .metrics
        .packets
        .get_or_create(&PacketLabels {
            msg_type: msg.into(),
            outcome: outcome.into(),
        })
        .inc();
}

/// Handles one datagram; returns what to send.
pub fn handle(
    shared: &Shared,
    bytes: &[u8],
    ingress: Ingress,
    now: u64,
) -> Option<(Vec<u8>, SocketAddrV4)> {
    let req = match Request::parse(bytes, ingress) {
        Ok(r) => r,
        Err(m) => {
            let reason = DropReason::Malformed(m);
            shared
                .metrics
                .malformed
                .get_or_create(&ReasonLabels {
                    reason: m.label().into(),
                })
                .inc();
            count(shared, "unknown", &format!("drop_{}", reason.label()));
            tracing::info!(src = %ingress.src, len = bytes.len(), why = %reason, "no answer");
            return None;
        }
    };
    let snap = shared.snapshot();
    let msg = type_label(req.msg_type);
    let decision = {
        let leases = shared.leases();
        decide(&req, &snap.table, &leases, now)
    };
    match decision {
        Decision::Reply(r) => {
            if let Some(e) = r.effect {
                shared.leases().apply(e, now);
                shared.lease_dirty.notify_one();
            }
            count(shared, msg, type_label(r.msg_type));
            let to = match r.dest {
                Dest::Broadcast => SocketAddrV4::new(Ipv4Addr::BROADCAST, 68),
                Dest::Unicast(a) => a,
            };
            tracing::info!(
                mac = %req.mac,
                msg,
                reply = type_label(r.msg_type),
                yiaddr = %r.message.yiaddr(),
                boot = r.boot.as_deref().unwrap_or(""),
                to = %to,
                port = ?ingress.port,
                "answered"
            );
            Some((r.bytes, to))
        }
        Decision::Update(e) => {
            shared.leases().apply(e, now);
            shared.lease_dirty.notify_one();
            count(shared, msg, "update");
            tracing::info!(mac = %req.mac, msg, effect = ?e, "lease updated");
            None
        }
        Decision::Drop { reason } => {
            count(shared, msg, &format!("drop_{}", reason.label()));
            tracing::info!(mac = %req.mac, msg, port = ?ingress.port, why = %reason, "no answer");
            None
        }
    }
}

/// Serves one socket until cancelled.
pub async fn serve(
    shared: Arc<Shared>,
    sock: UdpSocket,
    port: ServerPort,
    cancel: CancellationToken,
) {
    let mut buf = vec![0u8; 65536];
    loop {
        let (n, src) = tokio::select! {
            () = cancel.cancelled() => return,
            r = sock.recv_from(&mut buf) => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %error_chain(&e), "dhcp receive failed");
                    continue;
                }
            },
        };
        let SocketAddr::V4(src) = src else { continue };
        let ingress = Ingress { port, src };
        if let Some((bytes, to)) = handle(&shared, &buf[..n], ingress, crate::unix_now())
            && let Err(e) = sock.send_to(&bytes, to).await
        {
            tracing::warn!(to = %to, error = %error_chain(&e), "dhcp send failed");
        }
    }
}
