//! The DHCPv6 decision: one datagram in, one [`Decision6`] out. Pure.
//!
//! RFC 8415 for the exchanges (Solicit/Advertise, Request/Renew/Rebind/Reply,
//! Confirm, Release, Decline, Information-Request, relays), RFC 5970 for the
//! boot file URL (59), parameters (60) and architecture (61), and the UEFI
//! specification (24.7, HTTP boot) for the `HTTPClient` vendor class.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{Ipv6Addr, SocketAddrV6};

use super::wire::{
    Duid, Malformed6, Message6, MsgType, Options, Packet6, RelayHop, eui64_mac, opt,
};
use crate::Mac;
use crate::table::{Arch, BootFiles, Mode};

/// IANA enterprise number the UEFI specification uses in option 16.
const UEFI_ENTERPRISE: u32 = 343;

/// Status codes (RFC 8415 21.13).
pub mod status {
    pub const SUCCESS: u16 = 0;
    pub const NO_ADDRS_AVAIL: u16 = 2;
    pub const NOT_ON_LINK: u16 = 4;
}

/// An IPv6 prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr6 {
    pub addr: Ipv6Addr,
    pub prefix: u8,
}

impl Cidr6 {
    /// True if `ip` is inside.
    pub fn contains(&self, ip: Ipv6Addr) -> bool {
        let p = u32::from(self.prefix.min(128));
        let mask = if p == 0 { 0 } else { u128::MAX << (128 - p) };
        u128::from(ip) & mask == u128::from(self.addr) & mask
    }
}

/// A prefix string that does not parse (`2001:db8::/64`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid ipv6 prefix {input:?} (write it like 2001:db8:77::/64)")]
pub struct Cidr6ParseError {
    input: String,
}

impl std::str::FromStr for Cidr6 {
    type Err = Cidr6ParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || Cidr6ParseError { input: s.into() };
        let (a, p) = s.split_once('/').ok_or_else(err)?;
        let addr: Ipv6Addr = a.parse().map_err(|_| err())?;
        let prefix: u8 = p.parse().map_err(|_| err())?;
        if prefix > 128 {
            return Err(err());
        }
        Ok(Cidr6 { addr, prefix })
    }
}

impl fmt::Display for Cidr6 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// One enrolled machine of the Subnet, as DHCPv6 sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineEntry6 {
    /// `namespace/name`.
    pub name: String,
    /// Reserved IPv6 address (lease mode).
    pub address: Option<Ipv6Addr>,
}

/// Everything one Subnet's DHCPv6 answers depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootTable6 {
    pub mode: Mode,
    /// Our DUID (option 2), e.g. [`Duid::ll_ethernet`] of the serving link.
    pub server_duid: Vec<u8>,
    /// bootd's address on the segment: the host of `tftp://[…]/` URLs.
    pub server_ip: Ipv6Addr,
    /// The on-link prefix (Confirm, relays, the range).
    pub prefix: Cidr6,
    pub dns: Vec<Ipv6Addr>,
    /// Seconds.
    pub preferred_lifetime: u32,
    /// Seconds.
    pub valid_lifetime: u32,
    /// Dynamic range (inclusive) for machines without an IPv6 reservation
    /// and, with `answer_all`, for anyone.
    pub lease_range: Option<(Ipv6Addr, Ipv6Addr)>,
    /// Disables the MAC gate.
    pub answer_all: bool,
    pub boot_files: BootFiles,
    /// Base URL of bootd's HTTP server, e.g. `http://[2001:db8::1]:8080`.
    pub http_base: String,
    /// Boot file parameters (option 60), in order; none by default.
    pub boot_params: Vec<String>,
    /// Enrolled machines by boot MAC.
    pub machines: BTreeMap<Mac, MachineEntry6>,
}

impl BootTable6 {
    fn script_url(&self, mac: Mac) -> String {
        format!(
            "{}/ipxe/{}",
            self.http_base.trim_end_matches('/'),
            mac.dashed()
        )
    }

    fn file_url(&self, name: &str) -> String {
        format!("{}/files/{}", self.http_base.trim_end_matches('/'), name)
    }

    fn is_infra(&self, a: Ipv6Addr) -> bool {
        a == self.server_ip || a == self.prefix.addr || a.is_unspecified()
    }
}

/// Where a datagram came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ingress6 {
    /// Its source address and port (a client's link-local address, or a
    /// relay's address).
    pub src: SocketAddrV6,
    /// The sender's link-layer address if the shell knows it (neighbour
    /// table); used when neither a relay nor the DUID names one.
    pub link_mac: Option<Mac>,
}

/// One IA_NA of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IaNa {
    pub iaid: [u8; 4],
    /// Addresses the client names in it.
    pub addrs: Vec<Ipv6Addr>,
}

/// What the client is, for the boot URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientKind6 {
    /// No boot markers: an address only.
    Plain,
    /// Firmware PXE over IPv6 (`PXEClient` or an architecture option).
    Pxe,
    /// UEFI HTTP boot (`HTTPClient`, or architecture 16/19).
    Http,
    /// iPXE (user class `iPXE`): the per-machine script.
    Ipxe,
}

/// A decoded, checked request.
#[derive(Debug, Clone)]
pub struct Request6 {
    pub packet: Packet6,
    pub ingress: Ingress6,
    /// Option 1's body (absent only in an Information-Request).
    pub client_id: Option<Vec<u8>>,
    pub duid: Option<Duid>,
    /// The client's link-layer address: a relay's option 79, else the
    /// DUID's, else the shell's, else the EUI-64 of the link-local source.
    pub mac: Option<Mac>,
    pub server_id: Option<Vec<u8>>,
    pub ia_na: Vec<IaNa>,
    /// Option 61's architecture types.
    pub arch: Vec<u16>,
    /// Option 16's data items (enterprise number dropped).
    pub vendor_class: Vec<Vec<u8>>,
    /// Option 15's items.
    pub user_class: Vec<Vec<u8>>,
    pub rapid_commit: bool,
}

fn items(b: &[u8]) -> Result<Vec<Vec<u8>>, Malformed6> {
    let mut out = Vec::new();
    let mut b = b;
    while !b.is_empty() {
        if b.len() < 2 {
            return Err(Malformed6::BadOptionLength);
        }
        let n = usize::from(u16::from_be_bytes([b[0], b[1]]));
        let v = b.get(2..2 + n).ok_or(Malformed6::BadOptionLength)?;
        out.push(v.to_vec());
        b = &b[2 + n..];
    }
    Ok(out)
}

fn ia_na(b: &[u8]) -> Result<IaNa, Malformed6> {
    if b.len() < 12 {
        return Err(Malformed6::BadOptionLength);
    }
    let mut iaid = [0u8; 4];
    iaid.copy_from_slice(&b[..4]);
    let mut addrs = Vec::new();
    for (code, body) in Options::parse(&b[12..])?.0 {
        if code == opt::IAADDR {
            if body.len() < 24 {
                return Err(Malformed6::BadOptionLength);
            }
            let mut a = [0u8; 16];
            a.copy_from_slice(&body[..16]);
            addrs.push(Ipv6Addr::from(a));
        }
    }
    Ok(IaNa { iaid, addrs })
}

impl Request6 {
    /// Decodes and checks a datagram.
    pub fn parse(b: &[u8], ingress: Ingress6) -> Result<Request6, Malformed6> {
        let packet = Packet6::parse(b)?;
        let o = &packet.message.options;
        let client_id = o.once(opt::CLIENTID)?.map(<[u8]>::to_vec);
        let duid = client_id.as_deref().map(Duid::parse).transpose()?;
        let server_id = o.once(opt::SERVERID)?.map(<[u8]>::to_vec);
        if let Some(s) = &server_id {
            Duid::parse(s)?;
        }
        if client_id.is_none() && packet.message.msg_type != MsgType::InformationRequest {
            return Err(Malformed6::NoClientId);
        }
        let ia = o
            .all(opt::IA_NA)
            .map(ia_na)
            .collect::<Result<Vec<_>, _>>()?;
        let arch = match o.once(opt::CLIENT_ARCH_TYPE)? {
            None => Vec::new(),
            Some(b) if b.len() % 2 == 0 && !b.is_empty() => b
                .chunks_exact(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]]))
                .collect(),
            Some(_) => return Err(Malformed6::BadOptionLength),
        };
        let vendor_class = match o.once(opt::VENDOR_CLASS)? {
            None => Vec::new(),
            Some(b) if b.len() >= 4 => items(&b[4..])?,
            Some(_) => return Err(Malformed6::BadOptionLength),
        };
        let user_class = match o.once(opt::USER_CLASS)? {
            None => Vec::new(),
            Some(b) => items(b)?,
        };
        let rapid_commit = o.get(opt::RAPID_COMMIT).is_some();
        // the relay closest to the client is the last one peeled
        let relay_mac = packet.relays.last().and_then(|r| {
            let b = r.options.get(opt::CLIENT_LINKLAYER_ADDR)?;
            if b.len() == 8 && b[..2] == [0, 1] {
                let m: [u8; 6] = b[2..].try_into().ok()?;
                Some(Mac(m))
            } else {
                None
            }
        });
        let source_mac = match packet.relays.last() {
            Some(r) => eui64_mac(r.peer),
            None => ingress.link_mac.or_else(|| eui64_mac(*ingress.src.ip())),
        };
        let mac = relay_mac
            .or_else(|| duid.as_ref().and_then(Duid::mac))
            .or(source_mac);
        Ok(Request6 {
            packet,
            ingress,
            client_id,
            duid,
            mac,
            server_id,
            ia_na: ia,
            arch,
            vendor_class,
            user_class,
            rapid_commit,
        })
    }

    /// The message type.
    pub fn msg_type(&self) -> MsgType {
        self.packet.message.msg_type
    }

    /// What kind of client sent it.
    pub fn client_kind(&self) -> ClientKind6 {
        if self.user_class.iter().any(|c| c.as_slice() == b"iPXE") {
            return ClientKind6::Ipxe;
        }
        let class = |p: &[u8]| self.vendor_class.iter().any(|c| c.starts_with(p));
        if class(b"HTTPClient") || self.arch.iter().any(|a| matches!(a, 16 | 19)) {
            return ClientKind6::Http;
        }
        if class(b"PXEClient") || !self.arch.is_empty() {
            return ClientKind6::Pxe;
        }
        ClientKind6::Plain
    }
}

/// Why a request got no reply. Every variant is counted and logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason6 {
    /// The datagram did not decode.
    Malformed(Malformed6),
    /// A message type a server does not answer.
    UnsupportedMessage,
    /// A server identifier that is not ours, or one where none may be.
    NotForUs,
    /// No link-layer address to gate on (no relay option 79, no DUID-LL/LLT,
    /// no EUI-64 source) and the Subnet does not answer all.
    NoLinkAddress,
    /// No Machine of this Subnet enrolls the MAC.
    NotEnrolled,
    /// Proxy mode: not a PXE, HTTP boot or iPXE client.
    NotBootClient,
    /// Option 61 names an architecture we have no first stage for.
    UnsupportedArch,
    /// A relay's link address is outside the Subnet's prefix.
    ForeignRelay,
    /// Lease mode: the machine has no IPv6 reservation and the Subnet no
    /// IPv6 range.
    NoReservation,
    /// A Confirm or Decline naming no address.
    NoAddress,
}

impl DropReason6 {
    /// A fixed label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            DropReason6::Malformed(m) => m.label(),
            DropReason6::UnsupportedMessage => "v6_unsupported_message",
            DropReason6::NotForUs => "v6_not_for_us",
            DropReason6::NoLinkAddress => "v6_no_link_address",
            DropReason6::NotEnrolled => "v6_not_enrolled",
            DropReason6::NotBootClient => "v6_not_boot_client",
            DropReason6::UnsupportedArch => "v6_unsupported_arch",
            DropReason6::ForeignRelay => "v6_foreign_relay",
            DropReason6::NoReservation => "v6_no_reservation",
            DropReason6::NoAddress => "v6_no_address",
        }
    }
}

impl fmt::Display for DropReason6 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DropReason6::Malformed(m) => return write!(f, "malformed dhcpv6 packet: {m}"),
            DropReason6::UnsupportedMessage => "message type is not answered by a server",
            DropReason6::NotForUs => "server identifier is not ours (or not allowed here)",
            DropReason6::NoLinkAddress => {
                "no link-layer address to gate on (no relay option 79, duid-ll/llt or eui-64 source)"
            }
            DropReason6::NotEnrolled => "mac is not enrolled by any machine of this subnet",
            DropReason6::NotBootClient => "proxy mode answers only pxe, http boot and ipxe clients",
            DropReason6::UnsupportedArch => "no first stage for the client architecture",
            DropReason6::ForeignRelay => "relay link address is outside this subnet",
            DropReason6::NoReservation => "machine has no ipv6 reservation on this subnet",
            DropReason6::NoAddress => "message names no address",
        };
        f.write_str(s)
    }
}

/// A lease-state change, applied by the shell once the reply is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEffect6 {
    /// `addr` is bound to `mac` until `expires` (seconds).
    Bind {
        mac: Mac,
        addr: Ipv6Addr,
        expires: u64,
    },
    /// The client gave `addr` back.
    Release { mac: Mac, addr: Ipv6Addr },
    /// The client found `addr` in use: nobody gets it until `until`.
    Decline { addr: Ipv6Addr, until: u64 },
}

/// IPv6 bindings of the dynamic range (reservations need none).
#[derive(Debug, Clone, Default)]
pub struct Leases6 {
    by_addr: BTreeMap<Ipv6Addr, (Option<Mac>, u64)>,
    by_mac: BTreeMap<Mac, Ipv6Addr>,
}

impl Leases6 {
    /// Who holds `addr` at `now` (`Some(None)`: declined).
    pub fn holder(&self, addr: Ipv6Addr, now: u64) -> Option<Option<Mac>> {
        self.by_addr
            .get(&addr)
            .filter(|(_, exp)| *exp > now)
            .map(|(m, _)| *m)
    }

    /// The address bound to `mac`, if still valid.
    pub fn of(&self, mac: Mac, now: u64) -> Option<Ipv6Addr> {
        self.by_mac
            .get(&mac)
            .copied()
            .filter(|a| self.holder(*a, now) == Some(Some(mac)))
    }

    /// Number of bindings kept (expired ones included until collected).
    pub fn len(&self) -> usize {
        self.by_addr.len()
    }

    /// True when nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.by_addr.is_empty()
    }

    /// Applies an effect.
    pub fn apply(&mut self, e: LeaseEffect6) {
        match e {
            LeaseEffect6::Bind { mac, addr, expires } => {
                if let Some(old) = self.by_mac.insert(mac, addr)
                    && old != addr
                {
                    self.by_addr.remove(&old);
                }
                self.by_addr.insert(addr, (Some(mac), expires));
            }
            LeaseEffect6::Release { mac, addr } => {
                if self.by_mac.get(&mac) == Some(&addr) {
                    self.by_mac.remove(&mac);
                    self.by_addr.remove(&addr);
                }
            }
            LeaseEffect6::Decline { addr, until } => {
                if let Some((Some(m), _)) = self.by_addr.get(&addr)
                    && self.by_mac.get(m) == Some(&addr)
                {
                    self.by_mac.remove(m);
                }
                self.by_addr.insert(addr, (None, until));
            }
        }
    }

    /// Drops expired bindings; returns how many.
    pub fn collect(&mut self, now: u64) -> usize {
        let dead: Vec<Ipv6Addr> = self
            .by_addr
            .iter()
            .filter(|(_, (_, exp))| *exp <= now)
            .map(|(a, _)| *a)
            .collect();
        for a in &dead {
            if let Some((Some(m), _)) = self.by_addr.remove(a)
                && self.by_mac.get(&m) == Some(a)
            {
                self.by_mac.remove(&m);
            }
        }
        dead.len()
    }
}

/// A reply to send.
#[derive(Debug, Clone)]
pub struct Reply6 {
    pub msg_type: MsgType,
    /// The encoded datagram (Relay-Reply wrapped when relayed).
    pub bytes: Vec<u8>,
    /// The ingress source at port 546 (direct) or 547 (a relay).
    pub dest: SocketAddrV6,
    /// Lease state to commit once the reply is sent.
    pub effect: Option<LeaseEffect6>,
    /// The boot URL handed out, for the log line.
    pub boot: Option<String>,
    /// The address handed out.
    pub address: Option<Ipv6Addr>,
    /// The client's link-layer address, when known ([`Request6::mac`]).
    pub mac: Option<Mac>,
}

/// The outcome for one request.
#[derive(Debug, Clone)]
pub enum Decision6 {
    Reply(Box<Reply6>),
    Drop { reason: DropReason6 },
}

fn drop6(reason: DropReason6) -> Decision6 {
    Decision6::Drop { reason }
}

fn boot_url(req: &Request6, t: &BootTable6, mac: Mac) -> Result<Option<String>, DropReason6> {
    let kind = req.client_kind();
    let f = &t.boot_files;
    let arch = Arch::from_option(req.arch.first().copied());
    Ok(match kind {
        ClientKind6::Plain => None,
        ClientKind6::Ipxe => Some(t.script_url(mac)),
        ClientKind6::Http => Some(match arch {
            Arch::HttpArm64 | Arch::UefiArm64 => t.file_url(&f.uefi_arm64),
            _ => t.file_url(&f.uefi_x64),
        }),
        ClientKind6::Pxe => {
            let file = match arch {
                Arch::UefiX64 => &f.uefi_x64,
                Arch::UefiArm64 => &f.uefi_arm64,
                _ => return Err(DropReason6::UnsupportedArch),
            };
            Some(format!("tftp://[{}]/{}", t.server_ip, file))
        }
    })
}

fn status_opt(code: u16, msg: &str) -> Vec<u8> {
    let mut v = code.to_be_bytes().to_vec();
    v.extend_from_slice(msg.as_bytes());
    v
}

fn ia_body(
    iaid: [u8; 4],
    t: &BootTable6,
    addrs: &[(Ipv6Addr, u32, u32)],
    st: Option<(u16, &str)>,
) -> Vec<u8> {
    let mut v = iaid.to_vec();
    let (t1, t2) = if addrs.iter().any(|(_, p, _)| *p > 0) {
        (t.preferred_lifetime / 2, t.preferred_lifetime / 5 * 4)
    } else {
        (0, 0)
    };
    v.extend_from_slice(&t1.to_be_bytes());
    v.extend_from_slice(&t2.to_be_bytes());
    let mut o = Options::default();
    for (a, pref, valid) in addrs {
        let mut b = a.octets().to_vec();
        b.extend_from_slice(&pref.to_be_bytes());
        b.extend_from_slice(&valid.to_be_bytes());
        o.push(opt::IAADDR, b);
    }
    if let Some((code, msg)) = st {
        o.push(opt::STATUS_CODE, status_opt(code, msg));
    }
    o.encode(&mut v);
    v
}

fn fnv(mac: Mac) -> u128 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in mac.0 {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    u128::from(h)
}

/// The address lease mode gives `mac`: its reservation, else its binding
/// in the range, else a free address of the range picked from its MAC (an
/// enrolled machine without an IPv6 reservation gets one from the range
/// too, never another machine's reservation); no reservation and no range:
/// [`DropReason6::NoReservation`].
fn address_for(
    mac: Mac,
    entry: Option<&MachineEntry6>,
    t: &BootTable6,
    leases: &Leases6,
    now: u64,
) -> Result<Option<Ipv6Addr>, DropReason6> {
    if let Some(a) = entry.and_then(|e| e.address) {
        return Ok(match leases.holder(a, now) {
            Some(Some(m)) if m != mac => None,
            Some(None) => None,
            _ => Some(a),
        });
    }
    if let Some(a) = leases.of(mac, now) {
        return Ok(Some(a));
    }
    let Some((lo, hi)) = t.lease_range else {
        return Err(DropReason6::NoReservation);
    };
    let (lo, hi) = (u128::from(lo), u128::from(hi));
    if hi < lo {
        return Ok(None);
    }
    let size = hi - lo + 1;
    let start = fnv(mac) % size;
    // probe a bounded number of candidates: a huge range is never walked
    for i in 0..size.min(256) {
        let a = Ipv6Addr::from(lo + (start + i) % size);
        if !t.is_infra(a)
            && leases.holder(a, now).is_none()
            && !t.machines.values().any(|e| e.address == Some(a))
        {
            return Ok(Some(a));
        }
    }
    Ok(None)
}

/// Drops a request that names another server, or none where one is
/// required, and message types this server does not answer.
fn check_server_id(req: &Request6, t: &BootTable6, mt: MsgType) -> Result<(), DropReason6> {
    let server_ours = req.server_id.as_deref() == Some(t.server_duid.as_slice());
    match mt {
        MsgType::Solicit | MsgType::Rebind | MsgType::Confirm => {
            if req.server_id.is_some() {
                return Err(DropReason6::NotForUs);
            }
        }
        MsgType::Request | MsgType::Renew | MsgType::Release | MsgType::Decline => {
            if !server_ours {
                return Err(DropReason6::NotForUs);
            }
        }
        MsgType::InformationRequest => {
            if req.server_id.is_some() && !server_ours {
                return Err(DropReason6::NotForUs);
            }
        }
        _ => return Err(DropReason6::UnsupportedMessage),
    }
    Ok(())
}

/// The configuration a reply gives: the boot file URL, its parameters and
/// the HTTP boot vendor class when there is a boot file, the DNS servers.
fn push_config(o: &mut Options, req: &Request6, t: &BootTable6, boot: Option<&str>) {
    if let Some(url) = boot {
        o.push(opt::BOOTFILE_URL, url.as_bytes().to_vec());
        if !t.boot_params.is_empty() {
            let mut p = Vec::new();
            for s in &t.boot_params {
                let n = u16::try_from(s.len()).unwrap_or(u16::MAX);
                p.extend_from_slice(&n.to_be_bytes());
                p.extend_from_slice(&s.as_bytes()[..usize::from(n)]);
            }
            o.push(opt::BOOTFILE_PARAM, p);
        }
        if req.client_kind() == ClientKind6::Http {
            // UEFI 2.x 24.7.2: an HTTP boot offer carries HTTPClient
            let mut v = UEFI_ENTERPRISE.to_be_bytes().to_vec();
            v.extend_from_slice(&10u16.to_be_bytes());
            v.extend_from_slice(b"HTTPClient");
            o.push(opt::VENDOR_CLASS, v);
        }
    }
    if !t.dns.is_empty() {
        let mut v = Vec::with_capacity(16 * t.dns.len());
        for d in &t.dns {
            v.extend_from_slice(&d.octets());
        }
        o.push(opt::DNS_SERVERS, v);
    }
}

/// The request's relay hops for the reply, each keeping only its Interface-ID.
fn reply_relays(req: &Request6) -> Vec<RelayHop> {
    let mut relays = req.packet.relays.clone();
    for hop in &mut relays {
        // RFC 8415 19.3: only the Interface-ID is copied back
        hop.options = Options(
            hop.options
                .0
                .iter()
                .filter(|(c, _)| *c == opt::INTERFACE_ID)
                .cloned()
                .collect(),
        );
    }
    relays
}

/// Decides the answer to one request.
pub fn decide6(req: &Request6, t: &BootTable6, leases: &Leases6, now: u64) -> Decision6 {
    let mt = req.msg_type();
    if let Err(r) = check_server_id(req, t, mt) {
        return drop6(r);
    }
    if let Some(link) = req
        .packet
        .relays
        .iter()
        .rev()
        .map(|r| r.link)
        .find(|l| !l.is_unspecified())
        && !t.prefix.contains(link)
    {
        return drop6(DropReason6::ForeignRelay);
    }
    let Some(mac) = req.mac else {
        return drop6(DropReason6::NoLinkAddress);
    };
    let entry = t.machines.get(&mac);
    if entry.is_none() && !t.answer_all {
        return drop6(DropReason6::NotEnrolled);
    }
    let boot = match boot_url(req, t, mac) {
        Ok(b) => b,
        Err(r) => return drop6(r),
    };
    if boot.is_none() && t.mode == Mode::Proxy {
        return drop6(DropReason6::NotBootClient);
    }
    let mut o = Options::default();
    if let Some(c) = &req.client_id {
        o.push(opt::CLIENTID, c.clone());
    }
    o.push(opt::SERVERID, t.server_duid.clone());
    let mut effect = None;
    let mut address = None;
    let reply_type = match mt {
        MsgType::Solicit if !(req.rapid_commit && t.mode == Mode::Lease) => MsgType::Advertise,
        _ => MsgType::Reply,
    };
    match mt {
        MsgType::Solicit | MsgType::Request | MsgType::Renew | MsgType::Rebind => {
            let binds = mt != MsgType::Solicit || reply_type == MsgType::Reply;
            if req.rapid_commit && binds && mt == MsgType::Solicit {
                o.push(opt::RAPID_COMMIT, Vec::new());
            }
            let a = if t.mode == Mode::Lease {
                match address_for(mac, entry, t, leases, now) {
                    Ok(a) => a,
                    Err(r) => return drop6(r),
                }
            } else {
                None
            };
            for ia in &req.ia_na {
                match a {
                    Some(a) => {
                        let mut list = vec![(a, t.preferred_lifetime, t.valid_lifetime)];
                        // addresses the client names that are not its own
                        // any more: lifetimes 0 (RFC 8415 18.3.4)
                        if mt != MsgType::Solicit {
                            list.extend(ia.addrs.iter().filter(|x| **x != a).map(|x| (*x, 0, 0)));
                        }
                        o.push(opt::IA_NA, ia_body(ia.iaid, t, &list, None));
                        address = Some(a);
                    }
                    None => {
                        let msg = if t.mode == Mode::Proxy {
                            "addresses come from the segment's dhcpv6 server"
                        } else {
                            "no address available for this client"
                        };
                        o.push(
                            opt::IA_NA,
                            ia_body(ia.iaid, t, &[], Some((status::NO_ADDRS_AVAIL, msg))),
                        );
                    }
                }
            }
            if binds && let Some(addr) = address {
                effect = Some(LeaseEffect6::Bind {
                    mac,
                    addr,
                    expires: now + u64::from(t.valid_lifetime),
                });
            }
        }
        MsgType::Confirm => {
            let all: Vec<Ipv6Addr> = req.ia_na.iter().flat_map(|i| i.addrs.clone()).collect();
            if all.is_empty() {
                return drop6(DropReason6::NoAddress);
            }
            let (code, msg) = if all.iter().all(|a| t.prefix.contains(*a)) {
                (status::SUCCESS, "on link")
            } else {
                (status::NOT_ON_LINK, "an address is not on this link")
            };
            o.push(opt::STATUS_CODE, status_opt(code, msg));
        }
        MsgType::Release | MsgType::Decline => {
            let all: Vec<Ipv6Addr> = req.ia_na.iter().flat_map(|i| i.addrs.clone()).collect();
            let Some(&addr) = all.first() else {
                return drop6(DropReason6::NoAddress);
            };
            effect = Some(if mt == MsgType::Release {
                LeaseEffect6::Release { mac, addr }
            } else {
                LeaseEffect6::Decline {
                    addr,
                    until: now + u64::from(t.valid_lifetime),
                }
            });
            o.push(opt::STATUS_CODE, status_opt(status::SUCCESS, "done"));
        }
        _ => {}
    }
    let gives_config = !matches!(mt, MsgType::Release | MsgType::Decline | MsgType::Confirm);
    if gives_config {
        push_config(&mut o, req, t, boot.as_deref());
    }
    let relays = reply_relays(req);
    let packet = Packet6 {
        relays,
        message: Message6 {
            msg_type: reply_type,
            xid: req.packet.message.xid,
            options: o,
        },
    };
    let port = if req.packet.relays.is_empty() {
        546
    } else {
        547
    };
    let src = req.ingress.src;
    Decision6::Reply(Box::new(Reply6 {
        msg_type: reply_type,
        bytes: packet.encode(MsgType::RelayRepl),
        dest: SocketAddrV6::new(*src.ip(), port, src.flowinfo(), src.scope_id()),
        effect,
        boot: if gives_config { boot } else { None },
        address,
        mac: req.mac,
    }))
}

/// Decodes and decides: the one entry point of the shell.
pub fn handle6(
    b: &[u8],
    ingress: Ingress6,
    t: &BootTable6,
    leases: &Leases6,
    now: u64,
) -> Decision6 {
    match Request6::parse(b, ingress) {
        Ok(req) => decide6(&req, t, leases, now),
        Err(m) => drop6(DropReason6::Malformed(m)),
    }
}
