//! The DHCP shell: sockets on 67 and 4011, decode, decide, send, account.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;

use anneal_api::error_chain;
use anneal_dhcp::{Decision, Dest, DropReason, Ingress, Request, ServerPort, decide};
use dhcproto::v4::MessageType;
use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use crate::durable::Commit;
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

/// A reply to send.
#[derive(Debug)]
pub struct Answer {
    pub bytes: Vec<u8>,
    pub to: SocketAddrV4,
    /// Unicast to a client that holds no address yet (RFC 2131 4.1): the
    /// neighbour entry `to` → this MAC is set before sending.
    pub arp: Option<anneal_dhcp::Mac>,
    /// An ACK binding a lease: sent only once the lease file holds it.
    pub needs_commit: bool,
    mac: anneal_dhcp::Mac,
    msg: &'static str,
    reply: &'static str,
    yiaddr: Ipv4Addr,
    boot: Option<String>,
    port: ServerPort,
}

impl Answer {
    /// Counts the reply and logs its one line.
    fn account(&self, shared: &Shared) {
        count(shared, self.msg, self.reply);
        tracing::info!(
            mac = %self.mac,
            msg = self.msg,
            reply = self.reply,
            yiaddr = %self.yiaddr,
            boot = self.boot.as_deref().unwrap_or(""),
            to = %self.to,
            port = ?self.port,
            "answered"
        );
    }
}

/// The address of the host doing a PXE exchange, when its request names
/// one: the datagram's source when it came from an address and not
/// through a relay (a port 4011 request, an INFORM), else its `ciaddr`;
/// `None` for a client that holds no address yet (a DISCOVER from
/// 0.0.0.0): see [`Shared::record_pxe_exchange`].
fn pxe_host(req: &anneal_dhcp::Request) -> Option<std::net::IpAddr> {
    let src = *req.ingress.src.ip();
    let ciaddr = req.header.ciaddr();
    if req.header.giaddr().is_unspecified() && !src.is_unspecified() {
        Some(src.into())
    } else if !ciaddr.is_unspecified() {
        Some(ciaddr.into())
    } else {
        None
    }
}

/// Handles one datagram; returns what to send. A reply that needs no
/// commit is counted and logged here; one that does, by [`release`].
pub fn handle(shared: &Shared, bytes: &[u8], ingress: Ingress, now: u64) -> Option<Answer> {
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
            if snap.table.mode == anneal_dhcp::Mode::Proxy {
                shared.record_pxe_exchange(req.mac, pxe_host(&req));
            }
            let needs_commit = r.effect.is_some() && shared.lease_log.is_some();
            if let Some(e) = r.effect {
                shared.leases().apply(e, now);
            }
            let (to, arp) = match r.dest {
                Dest::Broadcast => (SocketAddrV4::new(Ipv4Addr::BROADCAST, 68), None),
                Dest::Unicast(a) => (a, None),
                Dest::Client { addr, mac } => (addr, Some(mac)),
            };
            let a = Answer {
                bytes: r.bytes,
                to,
                arp,
                needs_commit,
                mac: req.mac,
                msg,
                reply: type_label(r.msg_type),
                yiaddr: r.message.yiaddr(),
                boot: r.boot,
                port: ingress.port,
            };
            if !needs_commit {
                a.account(shared);
            }
            Some(a)
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

/// Decides what becomes of answers that waited for a commit: sent
/// (`Durable`; `MemoryOnly`, counted as not durable) or withheld
/// (`Failed`: `drop_not_durable`, the client retries). Returns those to send.
pub fn release(shared: &Shared, answers: Vec<Answer>, commit: Commit) -> Vec<Answer> {
    match commit {
        Commit::Durable => {}
        Commit::MemoryOnly => {
            shared.metrics.acks_not_durable.inc_by(answers.len() as u64);
        }
        Commit::Failed => {
            for a in &answers {
                count(shared, a.msg, "drop_not_durable");
                tracing::info!(mac = %a.mac, msg = a.msg, yiaddr = %a.yiaddr,
                    why = "the lease file cannot be written: the lease is not durable", "no answer");
            }
            return Vec::new();
        }
    }
    for a in &answers {
        a.account(shared);
    }
    answers
}

/// At most this many datagrams are read before their ACKs are committed
/// (one journal write and one `fdatasync`) and sent.
pub const BATCH: usize = 64;

/// Sends `a`. A unicast to a client without an address first sets the
/// neighbour entry for it (on `iface`, or the interface routing to it);
/// when that fails the answer is broadcast, as to a client with the
/// broadcast flag, and counted in `bootd_dhcp_unicast_fallback_total`.
async fn send(shared: &Shared, sock: &UdpSocket, iface: Option<&str>, a: &Answer) {
    let mut to = a.to;
    if let Some(mac) = a.arp
        && let Err(e) = crate::sys::set_arp(sock, iface, *a.to.ip(), mac.0)
    {
        shared
            .metrics
            .unicast_fallback
            .get_or_create(&ReasonLabels {
                reason: "arp_failed".into(),
            })
            .inc();
        tracing::info!(mac = %mac, yiaddr = %a.to.ip(), error = %error_chain(&e),
            "cannot set the client's neighbour entry (bootd needs CAP_NET_ADMIN): broadcasting the answer");
        to = SocketAddrV4::new(Ipv4Addr::BROADCAST, 68);
    }
    if let Err(e) = sock.send_to(&a.bytes, to).await {
        tracing::warn!(to = %to, error = %error_chain(&e), "dhcp send failed");
    }
}

/// [`serve`] on a thread of its own, with its own single-threaded runtime:
/// the loop commits its batch's leases (a write and an `fdatasync`) on that
/// thread, so no other task waits behind the disk and no hand-off to a
/// blocking pool sits between a REQUEST and its ACK. For
/// `JoinSet::spawn_blocking` (the thread ends when `cancel` fires).
pub fn serve_thread(
    shared: Arc<Shared>,
    sock: std::net::UdpSocket,
    port: ServerPort,
    iface: Option<String>,
    cancel: CancellationToken,
) -> impl FnOnce() + Send + 'static {
    move || {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                tracing::error!(?port, error = %error_chain(&e), "cannot start the dhcp thread's runtime: not serving");
                return;
            }
        };
        rt.block_on(async move {
            match UdpSocket::from_std(sock) {
                Ok(sock) => serve(shared, sock, port, iface, cancel).await,
                Err(e) => {
                    tracing::error!(?port, error = %error_chain(&e), "cannot register the dhcp socket: not serving");
                }
            }
        });
    }
}

/// Serves one socket until cancelled. Group commit: the datagrams waiting
/// on the socket (up to [`BATCH`]) are read and decided, replies without a
/// lease change (OFFERs, NAKs, proxy answers) sent at once, then the
/// batch's lease changes written with one `fdatasync` and only then its
/// ACKs sent, so an ACKed lease survives a crash.
pub async fn serve(
    shared: Arc<Shared>,
    sock: UdpSocket,
    port: ServerPort,
    iface: Option<String>,
    cancel: CancellationToken,
) {
    let iface = iface.as_deref();
    let mut buf = vec![0u8; 65536];
    let mut waiting = Vec::new();
    loop {
        let mut next = Some(tokio::select! {
            () = cancel.cancelled() => return,
            r = sock.recv_from(&mut buf) => r,
        });
        let mut read = 0;
        while let Some(r) = next.take() {
            read += 1;
            match r {
                Ok((n, SocketAddr::V4(src))) => {
                    let ingress = Ingress { port, src };
                    if let Some(a) = handle(&shared, &buf[..n], ingress, crate::unix_now()) {
                        if a.needs_commit {
                            waiting.push(a);
                        } else {
                            send(&shared, &sock, iface, &a).await;
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %error_chain(&e), "dhcp receive failed");
                    break;
                }
            }
            if read < BATCH {
                match sock.try_recv_from(&mut buf) {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    r => next = Some(r),
                }
            }
        }
        if waiting.is_empty() {
            continue;
        }
        // inline: this loop has its thread to itself (see `serve_thread`),
        // and waits for the commit before it reads on anyway; the datagrams
        // that arrive meanwhile are the next batch
        let commit =
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shared.commit_leases()))
            {
                Ok(c) => c,
                Err(_) => {
                    tracing::error!("lease writer panicked");
                    Commit::Failed
                }
            };
        for a in release(&shared, std::mem::take(&mut waiting), commit) {
            send(&shared, &sock, iface, &a).await;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// A unicast to a client whose neighbour entry cannot be set (here: no
    /// such interface) falls back to a broadcast, counted.
    #[test]
    fn unicast_falls_back_to_broadcast_when_arp_fails() {
        let snap = crate::StaticConfig::from_yaml(
            "serverIP: 10.77.0.2\ncidr: 10.77.0.0/24\ndhcp: {mode: lease, gateway: \"\"}\n",
        )
        .unwrap()
        .snapshot(8080, "t".into())
        .unwrap();
        let shared = Shared::new(snap, Default::default(), String::new());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let a = Answer {
                bytes: vec![0; 300],
                to: SocketAddrV4::new(Ipv4Addr::new(10, 77, 0, 9), 68),
                arp: Some(anneal_dhcp::Mac([2, 0, 0, 0, 0, 9])),
                needs_commit: false,
                mac: anneal_dhcp::Mac([2, 0, 0, 0, 0, 9]),
                msg: "discover",
                reply: "offer",
                yiaddr: Ipv4Addr::new(10, 77, 0, 9),
                boot: None,
                port: ServerPort::Dhcp,
            };
            send(&shared, &sock, Some("nosuchif0"), &a).await;
        });
        let text = shared.metrics.render();
        assert!(
            text.contains("bootd_dhcp_unicast_fallback_total{reason=\"arp_failed\"} 1"),
            "{text}"
        );
    }
}
