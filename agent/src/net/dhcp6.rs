//! A DHCPv6 client for one address (RFC 8415: Solicit → Advertise →
//! Request → Reply with an IA_NA; Renew at T1), for machines whose agent
//! API is reached over IPv6.
//!
//! Messages are built and parsed by pure functions on the shared wire code
//! of `anneal_dhcp::v6`; [`acquire`] and [`renew`] run the exchanges on a
//! UDP socket bound to `[::]:546` on one interface (SO_BINDTODEVICE),
//! sending to All_DHCP_Relay_Agents_and_Servers (`ff02::1:2`) from the
//! link-local address. The client identifier is a DUID-LL of the boot MAC,
//! so bootd's MAC gate recognises the machine the firmware booted.
//!
//! The address is added as a /128: the on-link prefix and the default
//! router come from router advertisements (RFC 8415 18.2.10.1 leaves
//! both to them), which the kernel applies.

use std::io;
use std::net::{Ipv6Addr, SocketAddrV6, UdpSocket};
use std::time::{Duration, Instant};

use anneal_dhcp::v6::{Duid, Message6, MsgType, Options, Packet6, opt, status};

use anneal_api::Mac;

use super::udp::left;

/// The DHCPv6 client port.
pub const CLIENT_PORT6: u16 = 546;
/// The DHCPv6 server and relay port.
pub const SERVER_PORT6: u16 = 547;
/// All_DHCP_Relay_Agents_and_Servers (RFC 8415 7.1).
pub const ALL_SERVERS: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 1, 2);
/// The IAID of the one IA_NA the agent asks for.
const IAID: [u8; 4] = *b"anl1";

/// A DHCPv6 failure.
#[derive(Debug, thiserror::Error)]
pub enum Dhcp6Error {
    /// Socket set-up or I/O.
    #[error("dhcpv6 socket on {ifname}")]
    Socket {
        /// The interface.
        ifname: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// No Advertise with an address before the deadline.
    #[error(
        "no DHCPv6 server advertised an address on {ifname} within {secs} s{}",
        refusal.as_ref().map(|r| format!(" (last answer: {r})")).unwrap_or_default()
    )]
    NoAdvertise {
        /// The interface.
        ifname: String,
        /// The timeout.
        secs: u64,
        /// The status a server answered instead of an address, if one did.
        refusal: Option<String>,
    },
    /// An Advertise but no Reply before the deadline.
    #[error("no DHCPv6 Reply on {ifname} within {secs} s (advertised {address})")]
    NoReply {
        /// The interface.
        ifname: String,
        /// The timeout.
        secs: u64,
        /// What was advertised.
        address: Ipv6Addr,
    },
}

/// What a server granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease6 {
    /// Our address.
    pub address: Ipv6Addr,
    /// Seconds the address is preferred.
    pub preferred: u32,
    /// Seconds the address is valid.
    pub valid: u32,
    /// Renewal time (T1) in seconds; 0 leaves it to the client.
    pub t1: u32,
    /// The server's DUID (option 2 body), echoed in Request and Renew.
    pub server_id: Vec<u8>,
    /// DNS recursive name servers (option 23).
    pub dns: Vec<Ipv6Addr>,
    /// Server preference (option 7), 0 when absent.
    pub preference: u8,
}

impl Lease6 {
    /// When to renew: T1, else half the preferred lifetime (RFC 8415
    /// 21.4), at least 30 s.
    pub fn renew_after(&self) -> Duration {
        let t1 = if self.t1 == 0 || self.t1 == u32::MAX {
            self.preferred / 2
        } else {
            self.t1
        };
        Duration::from_secs(u64::from(t1.max(30)))
    }
}

/// A parsed server message for our transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply6 {
    /// An Advertise carrying an address.
    Advertise(Lease6),
    /// A Reply binding an address.
    Bound(Lease6),
    /// An Advertise or Reply with no address: the status the server gave.
    Refused(String),
}

/// The client identifier: a DUID-LL of the boot MAC.
pub fn client_id(mac: Mac) -> Vec<u8> {
    Duid::ll_ethernet(mac)
}

fn centiseconds(elapsed: Duration) -> [u8; 2] {
    u16::try_from(elapsed.as_millis() / 10)
        .unwrap_or(u16::MAX)
        .to_be_bytes()
}

fn ia_na(address: Option<&Lease6>) -> Vec<u8> {
    let mut b = IAID.to_vec();
    b.extend_from_slice(&0u32.to_be_bytes()); // T1: server's choice
    b.extend_from_slice(&0u32.to_be_bytes()); // T2
    if let Some(l) = address {
        let mut a = l.address.octets().to_vec();
        a.extend_from_slice(&0u32.to_be_bytes());
        a.extend_from_slice(&0u32.to_be_bytes());
        b.extend_from_slice(&opt::IAADDR.to_be_bytes());
        b.extend_from_slice(&u16::try_from(a.len()).unwrap_or(24).to_be_bytes());
        b.extend_from_slice(&a);
    }
    b
}

fn message(
    kind: MsgType,
    xid: [u8; 3],
    mac: Mac,
    elapsed: Duration,
    lease: Option<&Lease6>,
) -> Vec<u8> {
    let mut options = Options::default();
    options.push(opt::CLIENTID, client_id(mac));
    if let Some(l) = lease {
        options.push(opt::SERVERID, l.server_id.clone());
    }
    options.push(opt::IA_NA, ia_na(lease));
    options.push(opt::ELAPSED_TIME, centiseconds(elapsed).to_vec());
    let mut oro = Vec::new();
    oro.extend_from_slice(&opt::DNS_SERVERS.to_be_bytes());
    options.push(opt::ORO, oro);
    let mut vendor = 0u32.to_be_bytes().to_vec(); // enterprise 0: none registered
    let class = b"anneal-agent";
    vendor.extend_from_slice(&u16::try_from(class.len()).unwrap_or(0).to_be_bytes());
    vendor.extend_from_slice(class);
    options.push(opt::VENDOR_CLASS, vendor);
    Message6 {
        msg_type: kind,
        xid,
        options,
    }
    .encode()
}

/// A Solicit for one IA_NA.
pub fn solicit(mac: Mac, xid: [u8; 3], elapsed: Duration) -> Vec<u8> {
    message(MsgType::Solicit, xid, mac, elapsed, None)
}

/// A Request for an advertised address.
pub fn request(mac: Mac, xid: [u8; 3], elapsed: Duration, advertised: &Lease6) -> Vec<u8> {
    message(MsgType::Request, xid, mac, elapsed, Some(advertised))
}

/// A Renew of a bound address, to the server that granted it.
pub fn renew_message(mac: Mac, xid: [u8; 3], lease: &Lease6) -> Vec<u8> {
    message(MsgType::Renew, xid, mac, Duration::ZERO, Some(lease))
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn status_text(body: &[u8]) -> String {
    if body.len() < 2 {
        return "a malformed status".into();
    }
    let code = u16::from_be_bytes([body[0], body[1]]);
    let text = String::from_utf8_lossy(&body[2..]);
    let name = match code {
        status::SUCCESS => "Success",
        status::NO_ADDRS_AVAIL => "NoAddrsAvail",
        status::NOT_ON_LINK => "NotOnLink",
        1 => "UnspecFail",
        3 => "NoBinding",
        5 => "UseMulticast",
        _ => "status",
    };
    if text.is_empty() {
        format!("{name} ({code})")
    } else {
        format!("{name} ({code}): {text}")
    }
}

/// Parses a server message; None when it is not for `xid` and `mac`, or
/// not an Advertise or Reply.
pub fn parse_reply(buf: &[u8], xid: [u8; 3], mac: Mac) -> Option<Reply6> {
    let msg = Packet6::parse_as(buf, MsgType::RelayRepl).ok()?.message;
    let advertise = match msg.msg_type {
        MsgType::Advertise => true,
        MsgType::Reply => false,
        _ => return None,
    };
    if msg.xid != xid || msg.options.get(opt::CLIENTID) != Some(client_id(mac).as_slice()) {
        return None;
    }
    let server_id = msg.options.get(opt::SERVERID)?.to_vec();
    if let Some(s) = msg.options.get(opt::STATUS_CODE)
        && s.len() >= 2
        && u16::from_be_bytes([s[0], s[1]]) != status::SUCCESS
    {
        return Some(Reply6::Refused(status_text(s)));
    }
    let preference = msg
        .options
        .get(7)
        .and_then(|p| p.first().copied())
        .unwrap_or(0);
    let dns = msg
        .options
        .get(opt::DNS_SERVERS)
        .map(|d| {
            d.chunks_exact(16)
                .filter_map(|c| <[u8; 16]>::try_from(c).ok().map(Ipv6Addr::from))
                .collect()
        })
        .unwrap_or_default();
    let mut refusal = None;
    for ia in msg.options.all(opt::IA_NA) {
        if ia.len() < 12 || ia[..4] != IAID {
            continue;
        }
        let t1 = be32(&ia[4..8]);
        let Ok(inner) = Options::parse(&ia[12..]) else {
            continue;
        };
        if let Some(s) = inner.get(opt::STATUS_CODE)
            && s.len() >= 2
            && u16::from_be_bytes([s[0], s[1]]) != status::SUCCESS
        {
            refusal = Some(status_text(s));
            continue;
        }
        for a in inner.all(opt::IAADDR) {
            if a.len() < 24 {
                continue;
            }
            let Ok(octets) = <[u8; 16]>::try_from(&a[..16]) else {
                continue;
            };
            let (preferred, valid) = (be32(&a[16..20]), be32(&a[20..24]));
            if valid == 0 || preferred > valid {
                continue; // withdrawn, or invalid per RFC 8415 21.6
            }
            let lease = Lease6 {
                address: Ipv6Addr::from(octets),
                preferred,
                valid,
                t1,
                server_id,
                dns,
                preference,
            };
            return Some(if advertise {
                Reply6::Advertise(lease)
            } else {
                Reply6::Bound(lease)
            });
        }
    }
    Some(Reply6::Refused(
        refusal.unwrap_or_else(|| "no address in the IA_NA".into()),
    ))
}

fn socket_for(ifname: &str) -> Result<UdpSocket, Dhcp6Error> {
    let addr = SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, CLIENT_PORT6, 0, 0);
    super::udp::device_socket(ifname, addr.into()).map_err(|e| Dhcp6Error::Socket {
        ifname: ifname.to_string(),
        source: e.into(),
    })
}

/// Waits up to `wait` for a message `want` accepts; returns it, or the
/// last refusal seen in `refused`.
fn wait_for(
    sock: &UdpSocket,
    ifname: &str,
    xid: [u8; 3],
    mac: Mac,
    wait: Duration,
    refused: &mut Option<String>,
    want: impl Fn(&Reply6) -> bool,
) -> Result<Option<Reply6>, Dhcp6Error> {
    let mut buf = vec![0u8; 2048];
    super::udp::receive_until(sock, &mut buf, wait, |p| match parse_reply(p, xid, mac) {
        Some(Reply6::Refused(r)) => {
            *refused = Some(r);
            None
        }
        Some(r) if want(&r) => Some(r),
        _ => None,
    })
    .map_err(|source| Dhcp6Error::Socket {
        ifname: ifname.to_string(),
        source,
    })
}

fn xid() -> [u8; 3] {
    let r: u32 = rand::random();
    let b = r.to_be_bytes();
    [b[1], b[2], b[3]]
}

/// Runs Solicit/Advertise/Request/Reply on `ifname` (index `ifindex`) until
/// an address is bound or `timeout` passes. The Solicit is retransmitted
/// after 1, 2, 4, 4… s; Advertises are collected for the first second
/// (RFC 8415 18.2.1) unless one has preference 255, and the most preferred
/// is requested.
pub fn acquire(
    ifname: &str,
    ifindex: u32,
    mac: Mac,
    timeout: Duration,
) -> Result<Lease6, Dhcp6Error> {
    let io_err = |source: io::Error| Dhcp6Error::Socket {
        ifname: ifname.to_string(),
        source,
    };
    let sock = socket_for(ifname)?;
    let dest = SocketAddrV6::new(ALL_SERVERS, SERVER_PORT6, 0, ifindex);
    let start = Instant::now();
    let deadline = start + timeout;
    let mut refused = None;
    let mut advertised: Option<Lease6> = None;
    let mut attempt = 0u32;
    while Instant::now() < deadline {
        let x = xid();
        sock.send_to(&solicit(mac, x, start.elapsed()), dest)
            .map_err(io_err)?;
        let window = Duration::from_secs(1 << attempt.min(2)).min(left(deadline));
        attempt += 1;
        let until = Instant::now() + window;
        let mut best: Option<Lease6> = None;
        // the first window collects; later ones take the first Advertise
        loop {
            let got = wait_for(&sock, ifname, x, mac, left(until), &mut refused, |r| {
                matches!(r, Reply6::Advertise(_))
            })?;
            let Some(Reply6::Advertise(l)) = got else {
                break;
            };
            let top = l.preference == 255;
            if best.as_ref().is_none_or(|b| l.preference > b.preference) {
                best = Some(l);
            }
            if top || attempt > 1 {
                break;
            }
        }
        let Some(offer) = best else { continue };
        advertised = Some(offer.clone());
        // Request: 1 s, then doubling, up to 3 transmissions (REQ_TIMEOUT,
        // REQ_MAX_RC is 10; the Solicit starts over sooner here).
        for n in 0..3u32 {
            if Instant::now() >= deadline {
                break;
            }
            sock.send_to(&request(mac, x, start.elapsed(), &offer), dest)
                .map_err(io_err)?;
            let wait = Duration::from_secs(1 << n).min(left(deadline));
            match wait_for(&sock, ifname, x, mac, wait, &mut refused, |r| {
                matches!(r, Reply6::Bound(_))
            })? {
                Some(Reply6::Bound(l)) => return Ok(l),
                _ => continue,
            }
        }
    }
    let secs = timeout.as_secs();
    Err(match advertised {
        Some(a) => Dhcp6Error::NoReply {
            ifname: ifname.to_string(),
            secs,
            address: a.address,
        },
        None => Dhcp6Error::NoAdvertise {
            ifname: ifname.to_string(),
            secs,
            refusal: refused,
        },
    })
}

/// Extends `lease` with Renew messages to its server until `timeout`.
pub fn renew(
    ifname: &str,
    ifindex: u32,
    mac: Mac,
    lease: &Lease6,
    timeout: Duration,
) -> Result<Lease6, Dhcp6Error> {
    let io_err = |source: io::Error| Dhcp6Error::Socket {
        ifname: ifname.to_string(),
        source,
    };
    let sock = socket_for(ifname)?;
    let dest = SocketAddrV6::new(ALL_SERVERS, SERVER_PORT6, 0, ifindex);
    let deadline = Instant::now() + timeout;
    let mut refused = None;
    while Instant::now() < deadline {
        let x = xid();
        sock.send_to(&renew_message(mac, x, lease), dest)
            .map_err(io_err)?;
        let wait = Duration::from_secs(2).min(left(deadline));
        if let Some(Reply6::Bound(l)) = wait_for(&sock, ifname, x, mac, wait, &mut refused, |r| {
            matches!(r, Reply6::Bound(_))
        })? {
            return Ok(l);
        }
    }
    Err(Dhcp6Error::NoReply {
        ifname: ifname.to_string(),
        secs: timeout.as_secs(),
        address: lease.address,
    })
}

/// The state of `addr` on the interface with index `ifindex` in
/// `/proc/net/if_inet6` text: None when absent, else Some(flags).
pub fn address_flags(if_inet6: &str, ifindex: u32, addr: Ipv6Addr) -> Option<u32> {
    let hex: String = addr.octets().iter().map(|b| format!("{b:02x}")).collect();
    if_inet6.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 6 || f[0] != hex || u32::from_str_radix(f[1], 16).ok()? != ifindex {
            return None;
        }
        u32::from_str_radix(f[4], 16).ok()
    })
}

/// `IFA_F_TENTATIVE`: duplicate address detection still running.
pub const IFA_F_TENTATIVE: u32 = 0x40;
/// `IFA_F_DADFAILED`: another node on the link has the address.
pub const IFA_F_DADFAILED: u32 = 0x08;

/// True once the interface has a link-local address that passed duplicate
/// address detection (a DHCPv6 client sends from it, RFC 8415 13.1).
pub fn link_local_ready(if_inet6: &str, ifindex: u32) -> bool {
    if_inet6.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() >= 6
            && f[0].starts_with("fe80")
            && u32::from_str_radix(f[1], 16).ok() == Some(ifindex)
            && u32::from_str_radix(f[4], 16)
                .is_ok_and(|fl| fl & (IFA_F_TENTATIVE | IFA_F_DADFAILED) == 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: Mac = Mac([0x52, 0x54, 0, 0x12, 0x34, 0x56]);
    const ADDR: Ipv6Addr = Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 0x150);

    /// A server's Advertise or Reply as RFC 8415 lays it out.
    fn server_msg(kind: MsgType, xid: [u8; 3], client: &[u8], ia_status: Option<u16>) -> Vec<u8> {
        let mut o = Options::default();
        o.push(opt::SERVERID, Duid::ll_ethernet(Mac([2, 0, 0, 0, 0, 1])));
        o.push(opt::CLIENTID, client.to_vec());
        let mut ia = IAID.to_vec();
        ia.extend_from_slice(&300u32.to_be_bytes());
        ia.extend_from_slice(&480u32.to_be_bytes());
        match ia_status {
            Some(code) => {
                let mut s = code.to_be_bytes().to_vec();
                s.extend_from_slice(b"no addresses for you");
                ia.extend_from_slice(&opt::STATUS_CODE.to_be_bytes());
                ia.extend_from_slice(&(s.len() as u16).to_be_bytes());
                ia.extend_from_slice(&s);
            }
            None => {
                ia.extend_from_slice(&opt::IAADDR.to_be_bytes());
                ia.extend_from_slice(&24u16.to_be_bytes());
                ia.extend_from_slice(&ADDR.octets());
                ia.extend_from_slice(&600u32.to_be_bytes());
                ia.extend_from_slice(&900u32.to_be_bytes());
            }
        }
        o.push(opt::IA_NA, ia);
        o.push(
            opt::DNS_SERVERS,
            Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 1).octets().to_vec(),
        );
        Message6 {
            msg_type: kind,
            xid,
            options: o,
        }
        .encode()
    }

    #[test]
    fn solicit_carries_a_duid_ll_of_the_mac_and_an_ia_na() {
        let s = solicit(MAC, [1, 2, 3], Duration::from_millis(1500));
        let m = Packet6::parse(&s).unwrap().message;
        assert_eq!(m.msg_type, MsgType::Solicit);
        assert_eq!(m.xid, [1, 2, 3]);
        let duid = Duid::parse(m.options.get(opt::CLIENTID).unwrap()).unwrap();
        assert_eq!(duid.mac(), Some(MAC));
        assert_eq!(m.options.get(opt::ELAPSED_TIME), Some(&[0u8, 150][..]));
        let ia = m.options.get(opt::IA_NA).unwrap();
        assert_eq!(ia.len(), 12, "no address asked for in a Solicit");
        assert!(m.options.get(opt::SERVERID).is_none());
    }

    #[test]
    fn advertise_then_request_names_the_server_and_the_address() {
        let client = client_id(MAC);
        let adv = server_msg(MsgType::Advertise, [4, 5, 6], &client, None);
        let Some(Reply6::Advertise(l)) = parse_reply(&adv, [4, 5, 6], MAC) else {
            panic!("advertise not parsed")
        };
        assert_eq!(l.address, ADDR);
        assert_eq!((l.preferred, l.valid, l.t1), (600, 900, 300));
        assert_eq!(l.dns, vec![Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 1)]);
        assert_eq!(l.renew_after(), Duration::from_secs(300));
        let r = request(MAC, [4, 5, 6], Duration::ZERO, &l);
        let m = Packet6::parse(&r).unwrap().message;
        assert_eq!(m.msg_type, MsgType::Request);
        assert_eq!(m.options.get(opt::SERVERID), Some(l.server_id.as_slice()));
        let ia = Options::parse(&m.options.get(opt::IA_NA).unwrap()[12..]).unwrap();
        assert_eq!(&ia.get(opt::IAADDR).unwrap()[..16], &ADDR.octets());
        let reply = server_msg(MsgType::Reply, [4, 5, 6], &client, None);
        assert!(
            matches!(parse_reply(&reply, [4, 5, 6], MAC), Some(Reply6::Bound(b)) if b.address == ADDR)
        );
        let renew = renew_message(MAC, [7, 7, 7], &l);
        let m = Packet6::parse(&renew).unwrap().message;
        assert_eq!(m.msg_type, MsgType::Renew);
        assert_eq!(m.options.get(opt::SERVERID), Some(l.server_id.as_slice()));
    }

    #[test]
    fn foreign_refused_and_hostile_messages() {
        let client = client_id(MAC);
        let adv = server_msg(MsgType::Advertise, [4, 5, 6], &client, None);
        // another transaction, another client, a message a server never sends
        assert_eq!(parse_reply(&adv, [4, 5, 7], MAC), None);
        assert_eq!(parse_reply(&adv, [4, 5, 6], Mac([2, 2, 2, 2, 2, 2])), None);
        let sol = solicit(MAC, [4, 5, 6], Duration::ZERO);
        assert_eq!(parse_reply(&sol, [4, 5, 6], MAC), None);
        // NoAddrsAvail inside the IA_NA is reported with its text
        let none = server_msg(
            MsgType::Advertise,
            [4, 5, 6],
            &client,
            Some(status::NO_ADDRS_AVAIL),
        );
        match parse_reply(&none, [4, 5, 6], MAC) {
            Some(Reply6::Refused(r)) => {
                assert!(
                    r.contains("NoAddrsAvail") && r.contains("no addresses for you"),
                    "{r}"
                )
            }
            other => panic!("{other:?}"),
        }
        // every truncation of a valid message is refused without a panic
        for n in 0..adv.len() {
            let _ = parse_reply(&adv[..n], [4, 5, 6], MAC);
        }
        assert_eq!(parse_reply(&[], [4, 5, 6], MAC), None);
        assert_eq!(
            parse_reply(&[2, 4, 5, 6, 0, 1, 0, 200], [4, 5, 6], MAC),
            None
        );
    }

    #[test]
    fn link_local_and_address_states_from_proc() {
        let text = "fe80000000000000505400fffeb0000c 02 40 20 c0     eth0\n\
                    fd770000000000000000000000000150 02 80 00 c0     eth0\n\
                    00000000000000000000000000000001 01 80 10 80       lo\n";
        // the link-local address is tentative: not yet
        assert!(!link_local_ready(text, 2));
        let done = text.replacen(" c0     eth0", " 80     eth0", 1);
        assert!(link_local_ready(&done, 2));
        assert!(!link_local_ready(&done, 3));
        assert_eq!(address_flags(text, 2, ADDR), Some(0xc0));
        assert_eq!(address_flags(text, 3, ADDR), None);
    }
}
