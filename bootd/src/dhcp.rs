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
            let needs_commit = r.effect.is_some() && shared.lease_log.is_some();
            if let Some(e) = r.effect {
                shared.leases().apply(e, now);
            }
            let to = match r.dest {
                Dest::Broadcast => SocketAddrV4::new(Ipv4Addr::BROADCAST, 68),
                Dest::Unicast(a) => a,
            };
            let a = Answer {
                bytes: r.bytes,
                to,
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

async fn send(sock: &UdpSocket, a: &Answer) {
    if let Err(e) = sock.send_to(&a.bytes, a.to).await {
        tracing::warn!(to = %a.to, error = %error_chain(&e), "dhcp send failed");
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
    cancel: CancellationToken,
) {
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
                            send(&sock, &a).await;
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
        let s = shared.clone();
        let commit = match tokio::task::spawn_blocking(move || s.commit_leases()).await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %error_chain(&e), "lease writer panicked");
                Commit::Failed
            }
        };
        for a in release(&shared, std::mem::take(&mut waiting), commit) {
            send(&sock, &a).await;
        }
    }
}
