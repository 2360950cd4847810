//! A DHCPv4 client (DISCOVER → OFFER → REQUEST → ACK) on dhcproto.
//!
//! Messages are built and parsed by pure functions; [`acquire`] runs the
//! exchange on a UDP socket bound to one interface (SO_BINDTODEVICE) with the
//! broadcast flag set, so replies reach a link that has no address yet.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use dhcproto::v4::{
    self, CLIENT_PORT, DhcpOption, Flags, Message, MessageType, Opcode, OptionCode, SERVER_PORT,
};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};

use anneal_api::Mac;

use super::udp::left;

/// A DHCP failure.
#[derive(Debug, thiserror::Error)]
pub enum DhcpError {
    /// Socket set-up or I/O.
    #[error("dhcp socket on {ifname}")]
    Socket {
        /// The interface.
        ifname: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// No usable offer before the deadline.
    #[error("no DHCP offer on {ifname} within {secs} s")]
    NoOffer {
        /// The interface.
        ifname: String,
        /// The timeout.
        secs: u64,
    },
    /// An offer but no ACK before the deadline.
    #[error("no DHCP ACK on {ifname} within {secs} s (offer from {server})")]
    NoAck {
        /// The interface.
        ifname: String,
        /// The timeout.
        secs: u64,
        /// Who offered.
        server: Ipv4Addr,
    },
    /// Encoding failed (cannot happen for the messages built here).
    #[error("dhcp encode")]
    Encode,
}

/// What a server granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Our address.
    pub address: Ipv4Addr,
    /// Prefix length from the subnet mask (24 when absent).
    pub prefix: u8,
    /// First router, if any.
    pub router: Option<Ipv4Addr>,
    /// DNS servers.
    pub dns: Vec<Ipv4Addr>,
    /// Lease time in seconds.
    pub lease_secs: Option<u32>,
    /// The server identifier.
    pub server: Ipv4Addr,
}

/// A parsed server reply for our transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// An offer of an address.
    Offer(Lease),
    /// The address is ours.
    Ack(Lease),
    /// Refused; start over.
    Nak,
}

fn base_message(mac: Mac, xid: u32, secs: u16) -> Message {
    let mut msg = Message::new_with_id(
        xid,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        &mac.0,
    );
    msg.set_flags(Flags::default().set_broadcast());
    msg.set_secs(secs);
    let mut client_id = vec![1u8];
    client_id.extend_from_slice(&mac.0);
    let opts = msg.opts_mut();
    opts.insert(DhcpOption::ClientIdentifier(client_id));
    opts.insert(DhcpOption::ClassIdentifier(b"anneal-agent".to_vec()));
    opts.insert(DhcpOption::ParameterRequestList(vec![
        OptionCode::SubnetMask,
        OptionCode::Router,
        OptionCode::DomainNameServer,
        OptionCode::DomainName,
        OptionCode::AddressLeaseTime,
        OptionCode::ServerIdentifier,
    ]));
    opts.insert(DhcpOption::MaxMessageSize(1500));
    msg
}

fn encode(msg: &Message) -> Result<Vec<u8>, DhcpError> {
    let mut buf = Vec::with_capacity(576);
    msg.encode(&mut Encoder::new(&mut buf))
        .map_err(|_| DhcpError::Encode)?;
    // BOOTP relays and old servers drop messages shorter than 300 bytes;
    // pad after the end option (0 is the pad option).
    if buf.len() < v4::MIN_PACKET_SIZE {
        buf.resize(v4::MIN_PACKET_SIZE, 0);
    }
    Ok(buf)
}

/// A DHCPDISCOVER.
pub fn discover(mac: Mac, xid: u32, secs: u16) -> Result<Vec<u8>, DhcpError> {
    let mut msg = base_message(mac, xid, secs);
    msg.opts_mut()
        .insert(DhcpOption::MessageType(MessageType::Discover));
    encode(&msg)
}

/// A DHCPREQUEST for an offer (SELECTING state).
pub fn request(mac: Mac, xid: u32, secs: u16, offer: &Lease) -> Result<Vec<u8>, DhcpError> {
    let mut msg = base_message(mac, xid, secs);
    let opts = msg.opts_mut();
    opts.insert(DhcpOption::MessageType(MessageType::Request));
    opts.insert(DhcpOption::RequestedIpAddress(offer.address));
    opts.insert(DhcpOption::ServerIdentifier(offer.server));
    encode(&msg)
}

/// A DHCPREQUEST extending a bound lease (RFC 2131 4.3.2 REBINDING form:
/// `ciaddr` set, no requested-address or server-identifier option, sent by
/// broadcast so that any server holding the lease may answer).
pub fn renew_request(mac: Mac, xid: u32, lease: &Lease) -> Result<Vec<u8>, DhcpError> {
    let mut msg = base_message(mac, xid, 0);
    msg.set_ciaddr(lease.address);
    msg.opts_mut()
        .insert(DhcpOption::MessageType(MessageType::Request));
    encode(&msg)
}

/// Extends `lease` on `ifname`; Ok(new lease) on ACK, an error on NAK (as
/// `NoAck`) or silence.
pub fn renew(ifname: &str, mac: Mac, lease: &Lease, timeout: Duration) -> Result<Lease, DhcpError> {
    let io_err = |source: io::Error| DhcpError::Socket {
        ifname: ifname.to_string(),
        source,
    };
    let sock = socket_for(ifname)?;
    let dest = SocketAddrV4::new(Ipv4Addr::BROADCAST, SERVER_PORT);
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; 1500];
    while Instant::now() < deadline {
        let xid: u32 = rand::random();
        sock.send_to(&renew_request(mac, xid, lease)?, dest)
            .map_err(io_err)?;
        let wait = Duration::from_secs(2).min(left(deadline));
        match wait_for(&sock, &mut buf, xid, mac, wait, |r| {
            matches!(r, Reply::Ack(_) | Reply::Nak)
        })? {
            Some(Reply::Ack(l)) => return Ok(l),
            Some(_) => break,
            None => continue,
        }
    }
    Err(DhcpError::NoAck {
        ifname: ifname.to_string(),
        secs: timeout.as_secs(),
        server: lease.server,
    })
}

fn prefix_of(mask: Ipv4Addr) -> u8 {
    let m = u32::from(mask);
    // A non-contiguous mask is invalid; count leading ones.
    m.leading_ones() as u8
}

/// Parses a server reply; None when it is not a reply to `xid`/`mac` or not
/// usable (e.g. a proxyDHCP offer with no address).
pub fn parse_reply(buf: &[u8], xid: u32, mac: Mac) -> Option<Reply> {
    let msg = Message::decode(&mut Decoder::new(buf)).ok()?;
    if msg.opcode() != Opcode::BootReply || msg.xid() != xid {
        return None;
    }
    if msg.chaddr().get(..6) != Some(&mac.0[..]) {
        return None;
    }
    let opts = msg.opts();
    let kind = opts.msg_type()?;
    if kind == MessageType::Nak {
        return Some(Reply::Nak);
    }
    let address = msg.yiaddr();
    if address.is_unspecified() {
        return None; // proxyDHCP: boot information only
    }
    let server = match opts.get(OptionCode::ServerIdentifier) {
        Some(DhcpOption::ServerIdentifier(s)) => *s,
        _ => msg.siaddr(),
    };
    let prefix = match opts.get(OptionCode::SubnetMask) {
        Some(DhcpOption::SubnetMask(m)) => prefix_of(*m),
        _ => 24,
    };
    let router = match opts.get(OptionCode::Router) {
        Some(DhcpOption::Router(r)) => r.first().copied().filter(|r| !r.is_unspecified()),
        _ => None,
    };
    let dns = match opts.get(OptionCode::DomainNameServer) {
        Some(DhcpOption::DomainNameServer(d)) => d.clone(),
        _ => Vec::new(),
    };
    let lease_secs = match opts.get(OptionCode::AddressLeaseTime) {
        Some(DhcpOption::AddressLeaseTime(t)) => Some(*t),
        _ => None,
    };
    let lease = Lease {
        address,
        prefix,
        router,
        dns,
        lease_secs,
        server,
    };
    match kind {
        MessageType::Offer => Some(Reply::Offer(lease)),
        MessageType::Ack => Some(Reply::Ack(lease)),
        _ => None,
    }
}

fn socket_for(ifname: &str) -> Result<UdpSocket, DhcpError> {
    let addr = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, CLIENT_PORT);
    super::udp::device_socket(ifname, addr.into()).map_err(|e| DhcpError::Socket {
        ifname: ifname.to_string(),
        source: e.into(),
    })
}

/// Runs DISCOVER/OFFER/REQUEST/ACK on `ifname` until a lease or `timeout`.
/// Retransmits with a 1, 2, 4, 4… second backoff.
pub fn acquire(ifname: &str, mac: Mac, timeout: Duration) -> Result<Lease, DhcpError> {
    let io_err = |source: io::Error| DhcpError::Socket {
        ifname: ifname.to_string(),
        source,
    };
    let sock = socket_for(ifname)?;
    let start = Instant::now();
    let deadline = start + timeout;
    let dest = SocketAddrV4::new(Ipv4Addr::BROADCAST, SERVER_PORT);
    let mut buf = vec![0u8; 1500];
    let mut offered: Option<Lease> = None;
    let mut attempt = 0u32;
    while Instant::now() < deadline {
        let xid: u32 = rand::random();
        let secs = u16::try_from(start.elapsed().as_secs()).unwrap_or(u16::MAX);
        sock.send_to(&discover(mac, xid, secs)?, dest)
            .map_err(io_err)?;
        let wait = Duration::from_secs(1 << attempt.min(2));
        attempt += 1;
        let Some(offer) = wait_for(&sock, &mut buf, xid, mac, wait.min(left(deadline)), |r| {
            matches!(r, Reply::Offer(_))
        })?
        else {
            continue;
        };
        let Reply::Offer(offer) = offer else { continue };
        offered = Some(offer.clone());
        // REQUEST, retransmitted twice before starting over.
        for _ in 0..3 {
            if Instant::now() >= deadline {
                break;
            }
            sock.send_to(&request(mac, xid, secs, &offer)?, dest)
                .map_err(io_err)?;
            match wait_for(
                &sock,
                &mut buf,
                xid,
                mac,
                Duration::from_secs(2).min(left(deadline)),
                |r| matches!(r, Reply::Ack(_) | Reply::Nak),
            )? {
                Some(Reply::Ack(lease)) => return Ok(lease),
                Some(_) => break, // NAK: start over
                None => continue,
            }
        }
    }
    let secs = timeout.as_secs();
    Err(match offered {
        Some(o) => DhcpError::NoAck {
            ifname: ifname.to_string(),
            secs,
            server: o.server,
        },
        None => DhcpError::NoOffer {
            ifname: ifname.to_string(),
            secs,
        },
    })
}

fn wait_for(
    sock: &UdpSocket,
    buf: &mut [u8],
    xid: u32,
    mac: Mac,
    wait: Duration,
    want: impl Fn(&Reply) -> bool,
) -> Result<Option<Reply>, DhcpError> {
    super::udp::receive_until(sock, buf, wait, |p| {
        parse_reply(p, xid, mac).filter(|r| want(r))
    })
    .map_err(|source| DhcpError::Socket {
        ifname: String::new(),
        source,
    })
}

/// Builds a reply as a server would (tests and the fuzz corpus use it).
pub fn server_reply(
    kind: MessageType,
    xid: u32,
    mac: Mac,
    yiaddr: Ipv4Addr,
    server: Ipv4Addr,
    router: Option<Ipv4Addr>,
) -> Vec<u8> {
    let mut msg = Message::new_with_id(
        xid,
        Ipv4Addr::UNSPECIFIED,
        yiaddr,
        server,
        Ipv4Addr::UNSPECIFIED,
        &mac.0,
    );
    msg.set_opcode(Opcode::BootReply);
    let opts = msg.opts_mut();
    opts.insert(DhcpOption::MessageType(kind));
    opts.insert(DhcpOption::ServerIdentifier(server));
    opts.insert(DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)));
    opts.insert(DhcpOption::AddressLeaseTime(1800));
    if let Some(r) = router {
        opts.insert(DhcpOption::Router(vec![r]));
    }
    opts.insert(DhcpOption::DomainNameServer(vec![server]));
    let mut buf = Vec::new();
    // Encoding a message built from valid parts does not fail.
    let _ = msg.encode(&mut Encoder::new(&mut buf));
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: Mac = Mac([0x52, 0x54, 0, 0x12, 0x34, 0x56]);

    #[test]
    fn discover_has_broadcast_flag_and_options() {
        let d = discover(MAC, 0xdead_beef, 3).unwrap();
        let msg = Message::decode(&mut Decoder::new(&d)).unwrap();
        assert_eq!(msg.opcode(), Opcode::BootRequest);
        assert_eq!(msg.xid(), 0xdead_beef);
        assert!(msg.flags().broadcast());
        assert_eq!(&msg.chaddr()[..6], &MAC.0);
        assert_eq!(msg.opts().msg_type(), Some(MessageType::Discover));
        assert!(d.len() >= 300, "padded to the BOOTP minimum: {}", d.len());
    }

    #[test]
    fn offer_ack_nak_and_foreign_replies() {
        let srv = Ipv4Addr::new(10, 77, 0, 1);
        let me = Ipv4Addr::new(10, 77, 0, 50);
        let offer = server_reply(MessageType::Offer, 7, MAC, me, srv, Some(srv));
        let Some(Reply::Offer(l)) = parse_reply(&offer, 7, MAC) else {
            panic!("offer not parsed")
        };
        assert_eq!(l.address, me);
        assert_eq!(l.prefix, 24);
        assert_eq!(l.router, Some(srv));
        assert_eq!(l.server, srv);
        assert_eq!(l.lease_secs, Some(1800));
        let req = request(MAC, 7, 0, &l).unwrap();
        let msg = Message::decode(&mut Decoder::new(&req)).unwrap();
        assert_eq!(
            msg.opts().get(OptionCode::RequestedIpAddress),
            Some(&DhcpOption::RequestedIpAddress(me))
        );
        // Wrong xid, wrong MAC, proxy offer without an address: ignored.
        assert_eq!(parse_reply(&offer, 8, MAC), None);
        assert_eq!(parse_reply(&offer, 7, Mac([1, 2, 3, 4, 5, 6])), None);
        let proxy = server_reply(MessageType::Offer, 7, MAC, Ipv4Addr::UNSPECIFIED, srv, None);
        assert_eq!(parse_reply(&proxy, 7, MAC), None);
        let nak = server_reply(MessageType::Nak, 7, MAC, Ipv4Addr::UNSPECIFIED, srv, None);
        assert_eq!(parse_reply(&nak, 7, MAC), Some(Reply::Nak));
        // Garbage never panics.
        assert_eq!(parse_reply(&[0u8; 10], 7, MAC), None);
        assert_eq!(parse_reply(&offer[..offer.len() / 2], 7, MAC), None);
    }

    #[test]
    fn renewal_is_a_request_with_ciaddr_and_no_server_id() {
        let lease = Lease {
            address: Ipv4Addr::new(10, 77, 0, 50),
            prefix: 24,
            router: None,
            dns: vec![],
            lease_secs: Some(600),
            server: Ipv4Addr::new(10, 77, 0, 1),
        };
        let r = renew_request(MAC, 9, &lease).unwrap();
        let msg = Message::decode(&mut Decoder::new(&r)).unwrap();
        assert_eq!(msg.ciaddr(), lease.address);
        assert_eq!(msg.opts().msg_type(), Some(MessageType::Request));
        assert!(msg.opts().get(OptionCode::ServerIdentifier).is_none());
        assert!(msg.opts().get(OptionCode::RequestedIpAddress).is_none());
    }

    #[test]
    fn masks_to_prefixes() {
        assert_eq!(prefix_of(Ipv4Addr::new(255, 255, 255, 0)), 24);
        assert_eq!(prefix_of(Ipv4Addr::new(255, 255, 0, 0)), 16);
        assert_eq!(prefix_of(Ipv4Addr::new(0, 0, 0, 0)), 0);
    }
}
