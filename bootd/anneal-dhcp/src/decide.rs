//! The decision: one request in, one [`Decision`] out. Pure.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::net::{Ipv4Addr, SocketAddrV4};

use dhcproto::v4::{
    DhcpOption, Flags, HType, Message, MessageType, Opcode, OptionCode, UnknownOption,
};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};

use crate::Mac;
use crate::lease::{Lease, LeaseEffect, Leases};
use crate::options::{IpxeOptions, PXE_BOOT_ITEM, PxeVendorOptions, parse_suboptions};
use crate::table::{Arch, BootTable, Loader, Mode};
use crate::wire::{ClientKind, Malformed, Request, ServerPort};

/// Replies are padded to the BOOTP minimum some firmware insists on.
const MIN_REPLY: usize = 300;

/// Where a reply goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dest {
    /// 255.255.255.255:68 on the serving interface.
    Broadcast,
    /// A unicast address and port (a relay's giaddr:67, a renewing client's
    /// ciaddr:68, or a port 4011 client's source).
    Unicast(SocketAddrV4),
    /// RFC 2131 4.1: an OFFER or ACK to a client without the broadcast
    /// flag, giaddr and ciaddr: unicast to `yiaddr:68` at `chaddr`. The
    /// client answers no ARP for an address it does not hold yet, so the
    /// shell sets the neighbour entry first (and broadcasts if it cannot).
    Client { addr: SocketAddrV4, mac: Mac },
}

/// A reply to send.
#[derive(Debug, Clone)]
pub struct Reply {
    pub message: Message,
    /// The encoded datagram.
    pub bytes: Vec<u8>,
    pub dest: Dest,
    pub msg_type: MessageType,
    /// Lease state to commit once the reply is sent.
    pub effect: Option<LeaseEffect>,
    /// The boot file or URL handed out, for the log line.
    pub boot: Option<String>,
}

/// Why a request got no reply. Every variant is counted and logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// The datagram did not decode.
    Malformed(Malformed),
    /// No Machine of this Subnet enrolls the MAC and the Subnet does not answer all.
    NotEnrolled,
    /// Proxy mode: the client is not a PXE, HTTP boot or iPXE client.
    NotBootClient,
    /// The request names another server (or is for the segment's own DHCP server).
    NotForUs,
    /// Lease mode: the machine has no address reservation.
    NoReservation,
    /// Option 93 names an architecture we have no first stage for.
    UnsupportedArch,
    /// A relay forwarded it from a network that is not this Subnet.
    ForeignRelay,
    /// A message type a server does not answer here.
    UnsupportedMessage,
    /// The reserved address is leased to another MAC.
    AddressInUse,
    /// The reserved address was declined recently.
    AddressDeclined,
    /// No free address in the lease range.
    PoolExhausted,
    /// A REQUEST with no requested address.
    NoRequestedAddress,
    /// The boot file name does not fit the BOOTP file field.
    BootFileTooLong,
    /// The reply would exceed the client's maximum message size.
    ReplyTooLarge,
    /// The reply failed to encode.
    Encode,
    /// A DECLINE for an address outside the Subnet's cidr.
    DeclineOutsideSubnet,
    /// A DECLINE for an address this MAC neither holds nor would be offered.
    DeclineNotOffered,
}

impl DropReason {
    /// A fixed label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            DropReason::Malformed(m) => m.label(),
            DropReason::NotEnrolled => "not_enrolled",
            DropReason::NotBootClient => "not_boot_client",
            DropReason::NotForUs => "not_for_us",
            DropReason::NoReservation => "no_reservation",
            DropReason::UnsupportedArch => "unsupported_arch",
            DropReason::ForeignRelay => "foreign_relay",
            DropReason::UnsupportedMessage => "unsupported_message",
            DropReason::AddressInUse => "address_in_use",
            DropReason::AddressDeclined => "address_declined",
            DropReason::PoolExhausted => "pool_exhausted",
            DropReason::NoRequestedAddress => "no_requested_address",
            DropReason::BootFileTooLong => "boot_file_too_long",
            DropReason::ReplyTooLarge => "reply_too_large",
            DropReason::Encode => "encode",
            DropReason::DeclineOutsideSubnet => "decline_outside_subnet",
            DropReason::DeclineNotOffered => "decline_not_offered",
        }
    }

    /// True for a datagram that did not decode.
    pub fn is_malformed(self) -> bool {
        matches!(self, DropReason::Malformed(_))
    }
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DropReason::Malformed(m) => return write!(f, "malformed packet: {m}"),
            DropReason::NotEnrolled => "mac is not enrolled by any machine of this subnet",
            DropReason::NotBootClient => "proxy mode answers only pxe, http boot and ipxe clients",
            DropReason::NotForUs => "request is addressed to another dhcp server",
            DropReason::NoReservation => "machine has no address reservation on this subnet",
            DropReason::UnsupportedArch => "no first stage for the client architecture",
            DropReason::ForeignRelay => "relay address is outside this subnet",
            DropReason::UnsupportedMessage => "message type is not answered here",
            DropReason::AddressInUse => "reserved address is leased to another mac",
            DropReason::AddressDeclined => "reserved address was declined recently",
            DropReason::PoolExhausted => "no free address in the lease range",
            DropReason::NoRequestedAddress => "request names no address",
            DropReason::BootFileTooLong => "boot file name does not fit the file field",
            DropReason::ReplyTooLarge => "reply exceeds the client's maximum message size",
            DropReason::Encode => "reply failed to encode",
            DropReason::DeclineOutsideSubnet => "declined address is outside this subnet",
            DropReason::DeclineNotOffered => {
                "declined address is neither leased nor offered to this mac"
            }
        };
        f.write_str(s)
    }
}

/// The outcome for one request.
#[derive(Debug, Clone)]
pub enum Decision {
    /// Send this.
    Reply(Box<Reply>),
    /// No reply, but the lease state changes (RELEASE, DECLINE).
    Update(LeaseEffect),
    /// Silence, for a counted reason.
    Drop { reason: DropReason },
}

fn drop(reason: DropReason) -> Decision {
    Decision::Drop { reason }
}

/// What to boot.
struct BootTarget {
    file: String,
    /// UEFI HTTP boot: option 60 `HTTPClient` in every reply.
    http: bool,
    ipxe: bool,
    pxe: bool,
}

fn boot_target(req: &Request, table: &BootTable) -> Result<Option<BootTarget>, DropReason> {
    let kind = req.client_kind();
    let t = match kind {
        ClientKind::Plain => return Ok(None),
        ClientKind::Ipxe => BootTarget {
            file: table.script_url(req.mac),
            http: false,
            ipxe: true,
            pxe: false,
        },
        ClientKind::Pxe | ClientKind::Http => {
            let f = &table.boot_files;
            let shim = table
                .machines
                .get(&req.mac)
                .is_some_and(|m| m.loader == Loader::Shim);
            let (x64, arm64) = if shim {
                (&f.uefi_x64_shim, &f.uefi_arm64_shim)
            } else {
                (&f.uefi_x64, &f.uefi_arm64)
            };
            let (file, http) = match Arch::from_option(req.arch()) {
                Arch::Bios => (f.bios.clone(), false),
                Arch::UefiX64 => (x64.clone(), false),
                Arch::UefiArm64 => (arm64.clone(), false),
                Arch::HttpX64 => (table.file_url(x64), true),
                Arch::HttpArm64 => (table.file_url(arm64), true),
                Arch::Other(_) => return Err(DropReason::UnsupportedArch),
            };
            BootTarget {
                file,
                http,
                ipxe: false,
                pxe: !http,
            }
        }
    };
    if t.file.len() > 127 {
        return Err(DropReason::BootFileTooLong);
    }
    Ok(Some(t))
}

fn base_reply(req: &Request, table: &BootTable, msg_type: MessageType) -> Message {
    let h = &req.header;
    let mut m = Message::default();
    m.set_opcode(Opcode::BootReply)
        .set_htype(HType::Eth)
        .set_chaddr(h.chaddr())
        .set_xid(h.xid())
        .set_flags(h.flags())
        .set_giaddr(h.giaddr());
    let o = m.opts_mut();
    o.insert(DhcpOption::MessageType(msg_type));
    o.insert(DhcpOption::ServerIdentifier(table.server_ip));
    if let Some(cid) = req.options.get(&61) {
        o.insert(DhcpOption::ClientIdentifier(cid.clone()));
    }
    // RFC 3046: echo the relay agent information unchanged.
    if let Some(ri) = req.options.get(&82)
        && ri.len() <= 255
    {
        let mut raw = vec![82u8, ri.len() as u8];
        raw.extend_from_slice(ri);
        if let Ok(opt) = DhcpOption::decode(&mut Decoder::new(&raw)) {
            o.insert(opt);
        }
    }
    m
}

fn add_boot(m: &mut Message, req: &Request, table: &BootTable, t: &BootTarget, proxy: bool) {
    m.set_siaddr(table.server_ip);
    m.set_fname_str(&t.file);
    let o = m.opts_mut();
    // Option 60: HTTPClient marks an HTTP boot offer; in proxy mode
    // PXEClient marks a proxyDHCP offer (firmware and iPXE both look for it).
    // A lease-mode PXE offer is a plain DHCP offer with a boot file.
    if t.http {
        o.insert(DhcpOption::ClassIdentifier(b"HTTPClient".to_vec()));
    } else if proxy {
        o.insert(DhcpOption::ClassIdentifier(b"PXEClient".to_vec()));
    }
    if t.pxe && proxy {
        let mut pxe = PxeVendorOptions::boot_file_only();
        if req.ingress.port == ServerPort::PxeBoot {
            // echo the boot item the client asked for
            let item = req
                .options
                .get(&43)
                .and_then(|v| parse_suboptions(v).ok())
                .and_then(|subs| {
                    subs.into_iter()
                        .find(|(c, b)| *c == PXE_BOOT_ITEM && b.len() == 4)
                        .map(|(_, b)| {
                            (
                                u16::from_be_bytes([b[0], b[1]]),
                                u16::from_be_bytes([b[2], b[3]]),
                            )
                        })
                });
            pxe.boot_item = item;
        }
        if let Ok(v) = pxe.encode() {
            o.insert(DhcpOption::VendorExtensions(v));
        }
    }
    if t.ipxe
        && let Ok(v) = (IpxeOptions { no_pxedhcp: true }).encode()
    {
        o.insert(DhcpOption::Unknown(UnknownOption::new(
            OptionCode::from(175u8),
            v,
        )));
    }
}

fn add_lease_opts(m: &mut Message, table: &BootTable, with_time: bool) {
    let o = m.opts_mut();
    o.insert(DhcpOption::SubnetMask(table.cidr.mask()));
    o.insert(DhcpOption::BroadcastAddr(table.cidr.broadcast()));
    if let Some(r) = table.router {
        o.insert(DhcpOption::Router(vec![r]));
    }
    if !table.dns.is_empty() {
        o.insert(DhcpOption::DomainNameServer(table.dns.clone()));
    }
    if with_time {
        let t = table.lease_time;
        o.insert(DhcpOption::AddressLeaseTime(t));
        o.insert(DhcpOption::Renewal(t / 2));
        o.insert(DhcpOption::Rebinding(t / 8 * 7));
    }
}

/// Where a reply on port 67 goes (RFC 2131 4.1): to the relay; to a
/// client's `ciaddr`; to `yiaddr` at `chaddr` for a client without the
/// broadcast flag (not a NAK, which is broadcast); else broadcast.
fn dest67(req: &Request, nak: bool, yiaddr: Ipv4Addr) -> Dest {
    let h = &req.header;
    if !h.giaddr().is_unspecified() {
        Dest::Unicast(SocketAddrV4::new(h.giaddr(), 67))
    } else if !nak && !h.ciaddr().is_unspecified() {
        Dest::Unicast(SocketAddrV4::new(h.ciaddr(), 68))
    } else if !nak && !h.flags().broadcast() && !yiaddr.is_unspecified() {
        Dest::Client {
            addr: SocketAddrV4::new(yiaddr, 68),
            mac: req.mac,
        }
    } else {
        Dest::Broadcast
    }
}

fn finish(
    req: &Request,
    mut message: Message,
    msg_type: MessageType,
    dest: Dest,
    effect: Option<LeaseEffect>,
    boot: Option<String>,
) -> Decision {
    if msg_type == MessageType::Nak && !req.header.giaddr().is_unspecified() {
        message.set_flags(Flags::default().set_broadcast());
    }
    let mut bytes = Vec::with_capacity(576);
    if message.encode(&mut Encoder::new(&mut bytes)).is_err() {
        return drop(DropReason::Encode);
    }
    if bytes.len() < MIN_REPLY {
        bytes.resize(MIN_REPLY, 0);
    }
    if bytes.len() > req.max_reply_len() {
        return drop(DropReason::ReplyTooLarge);
    }
    Decision::Reply(Box::new(Reply {
        message,
        bytes,
        dest,
        msg_type,
        effect,
        boot,
    }))
}

/// Decides the answer to one request.
///
/// `now` is Unix seconds; `leases` is read only (apply the returned effect).
pub fn decide(req: &Request, table: &BootTable, leases: &Leases, now: u64) -> Decision {
    let giaddr = req.header.giaddr();
    if !giaddr.is_unspecified() && !table.cidr.contains(giaddr) {
        return drop(DropReason::ForeignRelay);
    }
    if !table.answer_all && !table.machines.contains_key(&req.mac) {
        return drop(DropReason::NotEnrolled);
    }
    match (req.ingress.port, table.mode) {
        (ServerPort::PxeBoot, _) => pxe_boot(req, table),
        (ServerPort::Dhcp, Mode::Proxy) => proxy(req, table),
        (ServerPort::Dhcp, Mode::Lease) => lease(req, table, leases, now),
    }
}

/// Port 4011: the PXE client, already addressed, asks the proxy for its boot file.
fn pxe_boot(req: &Request, table: &BootTable) -> Decision {
    if !matches!(req.msg_type, MessageType::Request | MessageType::Inform) {
        return drop(DropReason::UnsupportedMessage);
    }
    let t = match boot_target(req, table) {
        Ok(Some(t)) => t,
        Ok(None) => return drop(DropReason::NotBootClient),
        Err(r) => return drop(r),
    };
    let mut m = base_reply(req, table, MessageType::Ack);
    m.set_ciaddr(req.header.ciaddr());
    add_boot(&mut m, req, table, &t, true);
    let dest = if !req.header.giaddr().is_unspecified() {
        Dest::Unicast(SocketAddrV4::new(req.header.giaddr(), 4011))
    } else if req.ingress.src.ip().is_unspecified() {
        Dest::Broadcast
    } else {
        Dest::Unicast(req.ingress.src)
    };
    finish(req, m, MessageType::Ack, dest, None, Some(t.file))
}

fn proxy(req: &Request, table: &BootTable) -> Decision {
    let reply_type = match req.msg_type {
        MessageType::Discover => MessageType::Offer,
        MessageType::Request if req.server_id() == Some(table.server_ip) => MessageType::Ack,
        MessageType::Request => return drop(DropReason::NotForUs),
        MessageType::Inform => MessageType::Ack,
        _ => return drop(DropReason::UnsupportedMessage),
    };
    let t = match boot_target(req, table) {
        Ok(Some(t)) => t,
        Ok(None) => return drop(DropReason::NotBootClient),
        Err(r) => return drop(r),
    };
    let mut m = base_reply(req, table, reply_type);
    m.set_ciaddr(req.header.ciaddr());
    add_boot(&mut m, req, table, &t, true);
    finish(
        req,
        m,
        reply_type,
        dest67(req, false, Ipv4Addr::UNSPECIFIED),
        None,
        Some(t.file),
    )
}

fn mac_hash(mac: Mac) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    mac.hash(&mut h);
    h.finish()
}

/// The address this client may hold, or why none.
fn address_for(
    req: &Request,
    table: &BootTable,
    leases: &Leases,
    now: u64,
) -> Result<Ipv4Addr, DropReason> {
    let mac = req.mac;
    if let Some(a) = table.machines.get(&mac).and_then(|e| e.address) {
        if leases.holder(a, now).is_some_and(|h| h != mac) {
            return Err(DropReason::AddressInUse);
        }
        if leases.is_declined(a, now) {
            return Err(DropReason::AddressDeclined);
        }
        return Ok(a);
    }
    if !table.answer_all || table.mode != Mode::Lease {
        return Err(DropReason::NoReservation);
    }
    let Some((start, end)) = table.lease_range else {
        return Err(DropReason::NoReservation);
    };
    let usable = |a: Ipv4Addr| {
        table.cidr.contains(a)
            && u32::from(a) >= u32::from(start)
            && u32::from(a) <= u32::from(end)
            && !table.is_reserved_infra(a)
            && !leases.is_declined(a, now)
            && leases.holder(a, now).is_none_or(|h| h == mac)
            && !table.machines.values().any(|e| e.address == Some(a))
    };
    if let Some(l) = leases.get(&mac)
        && usable(l.address)
    {
        return Ok(l.address);
    }
    if let Some(a) = req.requested_ip()
        && usable(a)
    {
        return Ok(a);
    }
    // the pool, inside the subnet
    let (s, e) = (
        u32::from(start).max(u32::from(table.cidr.addr) & u32::from(table.cidr.mask())),
        u32::from(end).min(u32::from(table.cidr.broadcast())),
    );
    if e < s {
        return Err(DropReason::PoolExhausted);
    }
    let size = u64::from(e - s) + 1;
    // An address no lease was ever on, from the MAC's place in the pool
    // round to it: O(log n) per candidate however full the pool is (the
    // candidates that fail are the few infrastructure, declined and
    // reserved addresses).
    let first = s + (mac_hash(mac) % size) as u32;
    let mut ranges = vec![(first, e)];
    if first > s {
        ranges.push((s, first - 1));
    }
    for (lo, hi) in ranges {
        let mut c = lo;
        while let Some(a) = leases.next_unheld(Ipv4Addr::from(c), Ipv4Addr::from(hi)) {
            if usable(a) {
                return Ok(a);
            }
            match u32::from(a).checked_add(1) {
                Some(n) if n <= hi => c = n,
                _ => break,
            }
        }
    }
    // then one whose lease expired, the longest expired first
    leases
        .expired(now)
        .map(|l| l.address)
        .find(|&a| (s..=e).contains(&u32::from(a)) && usable(a))
        .ok_or(DropReason::PoolExhausted)
}

fn lease(req: &Request, table: &BootTable, leases: &Leases, now: u64) -> Decision {
    let h = &req.header;
    match req.msg_type {
        MessageType::Discover => {
            let addr = match address_for(req, table, leases, now) {
                Ok(a) => a,
                Err(r) => return drop(r),
            };
            let target = match boot_target(req, table) {
                Ok(t) => t,
                Err(r) => return drop(r),
            };
            let mut m = base_reply(req, table, MessageType::Offer);
            m.set_yiaddr(addr);
            add_lease_opts(&mut m, table, true);
            let boot = target.map(|t| {
                add_boot(&mut m, req, table, &t, false);
                t.file
            });
            finish(
                req,
                m,
                MessageType::Offer,
                dest67(req, false, addr),
                None,
                boot,
            )
        }
        MessageType::Request => {
            let sid = req.server_id();
            if sid.is_some_and(|s| s != table.server_ip) {
                return drop(DropReason::NotForUs);
            }
            let requested = req
                .requested_ip()
                .or_else(|| (!h.ciaddr().is_unspecified()).then_some(h.ciaddr()));
            let Some(requested) = requested else {
                return drop(DropReason::NoRequestedAddress);
            };
            let nak = |req: &Request| {
                let m = base_reply(req, table, MessageType::Nak);
                finish(
                    req,
                    m,
                    MessageType::Nak,
                    dest67(req, true, Ipv4Addr::UNSPECIFIED),
                    None,
                    None,
                )
            };
            if !table.cidr.contains(requested) {
                return nak(req);
            }
            let addr = match address_for(req, table, leases, now) {
                Ok(a) => a,
                // RFC 2131 4.3.2: no record of the client and not selected: silence.
                Err(r) if sid.is_none() && r == DropReason::NoReservation => return drop(r),
                Err(_) => return nak(req),
            };
            if addr != requested {
                return nak(req);
            }
            let target = match boot_target(req, table) {
                Ok(t) => t,
                Err(r) => return drop(r),
            };
            let mut m = base_reply(req, table, MessageType::Ack);
            m.set_yiaddr(addr).set_ciaddr(h.ciaddr());
            add_lease_opts(&mut m, table, true);
            let boot = target.map(|t| {
                add_boot(&mut m, req, table, &t, false);
                t.file
            });
            let effect = LeaseEffect::Bind(Lease {
                mac: req.mac,
                address: addr,
                expires: now + u64::from(table.lease_time),
            });
            finish(
                req,
                m,
                MessageType::Ack,
                dest67(req, false, addr),
                Some(effect),
                boot,
            )
        }
        MessageType::Decline => {
            if req.server_id().is_some_and(|s| s != table.server_ip) {
                return drop(DropReason::NotForUs);
            }
            let Some(address) = req.requested_ip() else {
                return drop(DropReason::NoRequestedAddress);
            };
            if !table.cidr.contains(address) {
                return drop(DropReason::DeclineOutsideSubnet);
            }
            // Only the address this MAC holds, or the one it would be
            // offered now (its reservation, its lease, or a free pool
            // address): never another MAC's, never one it was not given.
            let holds = leases
                .get(&req.mac)
                .is_some_and(|l| l.address == address && l.expires > now);
            if !holds && address_for(req, table, leases, now) != Ok(address) {
                return drop(DropReason::DeclineNotOffered);
            }
            Decision::Update(LeaseEffect::Decline {
                mac: req.mac,
                address,
            })
        }
        MessageType::Release => {
            if req.server_id().is_some_and(|s| s != table.server_ip) {
                return drop(DropReason::NotForUs);
            }
            if h.ciaddr().is_unspecified() {
                return drop(DropReason::NoRequestedAddress);
            }
            Decision::Update(LeaseEffect::Release {
                mac: req.mac,
                address: h.ciaddr(),
            })
        }
        MessageType::Inform => {
            let target = match boot_target(req, table) {
                Ok(t) => t,
                Err(r) => return drop(r),
            };
            let mut m = base_reply(req, table, MessageType::Ack);
            m.set_ciaddr(h.ciaddr());
            add_lease_opts(&mut m, table, false);
            let boot = target.map(|t| {
                add_boot(&mut m, req, table, &t, false);
                t.file
            });
            finish(
                req,
                m,
                MessageType::Ack,
                dest67(req, false, Ipv4Addr::UNSPECIFIED),
                None,
                boot,
            )
        }
        _ => drop(DropReason::UnsupportedMessage),
    }
}
