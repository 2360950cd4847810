//! rtnetlink, just the requests the agent needs: set a link up, add an
//! IPv4 or IPv6 address, add a default route. Message building and ack parsing are
//! pure; [`Netlink`] is the socket.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, OwnedFd};

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, sendto,
    socket,
};

/// An error talking to the kernel over netlink.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// Socket-level failure.
    #[error("netlink socket")]
    Socket(#[source] io::Error),
    /// The kernel refused the request.
    #[error("kernel refused {what}")]
    Refused {
        /// The request.
        what: &'static str,
        /// The errno the kernel answered.
        #[source]
        source: io::Error,
    },
    /// An answer that does not parse.
    #[error("malformed netlink answer")]
    Malformed,
}

const NLMSG_ERROR: u16 = 2;
const RTM_NEWLINK: u16 = 16;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_REPLACE: u16 = 0x100;
const NLM_F_CREATE: u16 = 0x400;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const IFA_CACHEINFO: u16 = 6;
const AF_UNSPEC: u8 = 0;
const IFF_UP: u32 = 0x1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_BROADCAST: u16 = 4;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RTN_UNICAST: u8 = 1;

fn header(buf: &mut Vec<u8>, kind: u16, flags: u16, seq: u32) {
    buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched in finish()
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it
}

fn attr(buf: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let len = 4 + data.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(data);
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

fn finish(mut buf: Vec<u8>) -> Vec<u8> {
    let len = buf.len() as u32;
    buf[0..4].copy_from_slice(&len.to_ne_bytes());
    buf
}

/// `RTM_NEWLINK` setting IFF_UP on a link.
pub fn link_up_msg(seq: u32, ifindex: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(32);
    header(&mut b, RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK, seq);
    b.push(AF_UNSPEC);
    b.push(0); // pad
    b.extend_from_slice(&0u16.to_ne_bytes()); // type
    b.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    b.extend_from_slice(&IFF_UP.to_ne_bytes()); // flags
    b.extend_from_slice(&IFF_UP.to_ne_bytes()); // change mask
    finish(b)
}

/// `RTM_NEWADDR` for `addr/prefix` on a link (replacing an equal one).
pub fn addr_add_msg(seq: u32, ifindex: u32, addr: Ipv4Addr, prefix: u8) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    header(
        &mut b,
        RTM_NEWADDR,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        seq,
    );
    b.push(AF_INET);
    b.push(prefix);
    b.push(0); // flags
    b.push(RT_SCOPE_UNIVERSE);
    b.extend_from_slice(&ifindex.to_ne_bytes());
    attr(&mut b, IFA_LOCAL, &addr.octets());
    attr(&mut b, IFA_ADDRESS, &addr.octets());
    if prefix < 31 {
        let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
        let brd = Ipv4Addr::from(u32::from(addr) | !mask);
        attr(&mut b, IFA_BROADCAST, &brd.octets());
    }
    finish(b)
}

/// `RTM_NEWADDR` for an IPv6 `addr/prefix` on a link with its preferred and
/// valid lifetimes (IFA_CACHEINFO), so the kernel drops the address when
/// it is not renewed. Duplicate address detection runs as usual.
pub fn addr6_add_msg(
    seq: u32,
    ifindex: u32,
    addr: Ipv6Addr,
    prefix: u8,
    preferred: u32,
    valid: u32,
) -> Vec<u8> {
    let mut b = Vec::with_capacity(80);
    header(
        &mut b,
        RTM_NEWADDR,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        seq,
    );
    b.push(AF_INET6);
    b.push(prefix);
    b.push(0); // flags
    b.push(RT_SCOPE_UNIVERSE);
    b.extend_from_slice(&ifindex.to_ne_bytes());
    attr(&mut b, IFA_ADDRESS, &addr.octets());
    let mut cache = Vec::with_capacity(16);
    cache.extend_from_slice(&preferred.to_ne_bytes());
    cache.extend_from_slice(&valid.to_ne_bytes());
    cache.extend_from_slice(&[0u8; 8]); // cstamp, tstamp: the kernel's
    attr(&mut b, IFA_CACHEINFO, &cache);
    finish(b)
}

/// `RTM_NEWROUTE` for `dst/dst_len via gateway dev ifindex` (dst 0.0.0.0/0:
/// the default route).
pub fn route_add_msg(
    seq: u32,
    ifindex: u32,
    dst: Ipv4Addr,
    dst_len: u8,
    gateway: Ipv4Addr,
) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    header(
        &mut b,
        RTM_NEWROUTE,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        seq,
    );
    b.push(AF_INET);
    b.push(dst_len);
    b.push(0); // src_len
    b.push(0); // tos
    b.push(RT_TABLE_MAIN);
    b.push(RTPROT_BOOT);
    b.push(RT_SCOPE_UNIVERSE);
    b.push(RTN_UNICAST);
    b.extend_from_slice(&0u32.to_ne_bytes()); // flags
    if dst_len > 0 {
        attr(&mut b, RTA_DST, &dst.octets());
    }
    attr(&mut b, RTA_GATEWAY, &gateway.octets());
    attr(&mut b, RTA_OIF, &ifindex.to_ne_bytes());
    finish(b)
}

/// Parses the acknowledgement for `seq`: Ok(None) for another message,
/// Ok(Some(0)) for success, Ok(Some(errno)) for a refusal.
pub fn parse_ack(buf: &[u8], seq: u32) -> Result<Option<i32>, NetlinkError> {
    let mut at = 0usize;
    while at + 16 <= buf.len() {
        let rd32 = |o: usize| -> Result<u32, NetlinkError> {
            buf.get(o..o + 4)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_ne_bytes)
                .ok_or(NetlinkError::Malformed)
        };
        let len = rd32(at)? as usize;
        if len < 16 || at + len > buf.len() {
            return Err(NetlinkError::Malformed);
        }
        let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
        let mseq = rd32(at + 8)?;
        if kind == NLMSG_ERROR && mseq == seq {
            let code = rd32(at + 16)? as i32;
            return Ok(Some(-code));
        }
        at += (len + 3) & !3;
    }
    Ok(None)
}

/// A `NETLINK_ROUTE` socket.
#[derive(Debug)]
pub struct Netlink {
    fd: OwnedFd,
    seq: u32,
}

impl Netlink {
    /// Opens and binds the socket.
    pub fn open() -> Result<Self, NetlinkError> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkRoute,
        )
        .map_err(|e| NetlinkError::Socket(e.into()))?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))
            .map_err(|e| NetlinkError::Socket(e.into()))?;
        Ok(Self { fd, seq: 1 })
    }

    fn request(&mut self, what: &'static str, msg: Vec<u8>) -> Result<(), NetlinkError> {
        let seq = u32::from_ne_bytes([msg[8], msg[9], msg[10], msg[11]]);
        sendto(
            self.fd.as_raw_fd(),
            &msg,
            &NetlinkAddr::new(0, 0),
            MsgFlags::empty(),
        )
        .map_err(|e| NetlinkError::Socket(e.into()))?;
        let mut buf = vec![0u8; 8192];
        for _ in 0..16 {
            let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty())
                .map_err(|e| NetlinkError::Socket(e.into()))?;
            match parse_ack(&buf[..n], seq)? {
                Some(0) => return Ok(()),
                Some(errno) => {
                    return Err(NetlinkError::Refused {
                        what,
                        source: io::Error::from_raw_os_error(errno),
                    });
                }
                None => continue,
            }
        }
        Err(NetlinkError::Malformed)
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Sets a link administratively up.
    pub fn link_up(&mut self, ifindex: u32) -> Result<(), NetlinkError> {
        let seq = self.next_seq();
        self.request("link up", link_up_msg(seq, ifindex))
    }

    /// Adds an IPv4 address.
    pub fn add_address(
        &mut self,
        ifindex: u32,
        addr: Ipv4Addr,
        prefix: u8,
    ) -> Result<(), NetlinkError> {
        let seq = self.next_seq();
        self.request("address", addr_add_msg(seq, ifindex, addr, prefix))
    }

    /// Adds an IPv6 address with its lifetimes.
    pub fn add_address6(
        &mut self,
        ifindex: u32,
        addr: Ipv6Addr,
        prefix: u8,
        preferred: u32,
        valid: u32,
    ) -> Result<(), NetlinkError> {
        let seq = self.next_seq();
        self.request(
            "IPv6 address",
            addr6_add_msg(seq, ifindex, addr, prefix, preferred, valid),
        )
    }

    /// Adds the default route.
    pub fn add_default_route(
        &mut self,
        ifindex: u32,
        gateway: Ipv4Addr,
    ) -> Result<(), NetlinkError> {
        let seq = self.next_seq();
        self.request(
            "default route",
            route_add_msg(seq, ifindex, Ipv4Addr::UNSPECIFIED, 0, gateway),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addr_message_layout() {
        let m = addr_add_msg(7, 3, Ipv4Addr::new(10, 77, 0, 50), 24);
        assert_eq!(m.len(), 16 + 8 + 8 * 3);
        assert_eq!(
            u32::from_ne_bytes(m[0..4].try_into().unwrap()) as usize,
            m.len()
        );
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), RTM_NEWADDR);
        assert_eq!(u32::from_ne_bytes(m[8..12].try_into().unwrap()), 7);
        assert_eq!(&m[16..20], &[AF_INET, 24, 0, 0]);
        assert_eq!(u32::from_ne_bytes(m[20..24].try_into().unwrap()), 3);
        // IFA_LOCAL, IFA_ADDRESS, IFA_BROADCAST
        assert_eq!(&m[24..32], &[8, 0, 2, 0, 10, 77, 0, 50]);
        assert_eq!(&m[40..48], &[8, 0, 4, 0, 10, 77, 0, 255]);
    }

    #[test]
    fn addr6_message_layout() {
        let a: Ipv6Addr = "fd77::150".parse().unwrap();
        let m = addr6_add_msg(8, 2, a, 128, 600, 900);
        assert_eq!(m.len(), 16 + 8 + 20 + 20);
        assert_eq!(&m[16..20], &[AF_INET6, 128, 0, 0]);
        assert_eq!(u32::from_ne_bytes(m[20..24].try_into().unwrap()), 2);
        // IFA_ADDRESS, then IFA_CACHEINFO {preferred, valid, 0, 0}
        assert_eq!(&m[24..28], &[20, 0, 1, 0]);
        assert_eq!(&m[28..44], &a.octets());
        assert_eq!(&m[44..48], &[20, 0, 6, 0]);
        assert_eq!(u32::from_ne_bytes(m[48..52].try_into().unwrap()), 600);
        assert_eq!(u32::from_ne_bytes(m[52..56].try_into().unwrap()), 900);
    }

    #[test]
    fn route_and_link_layout() {
        let m = route_add_msg(9, 2, Ipv4Addr::UNSPECIFIED, 0, Ipv4Addr::new(10, 77, 0, 1));
        assert_eq!(m.len(), 16 + 12 + 8 + 8);
        assert_eq!(&m[28..36], &[8, 0, 5, 0, 10, 77, 0, 1]);
        let l = link_up_msg(1, 5);
        assert_eq!(l.len(), 32);
        assert_eq!(i32::from_ne_bytes(l[20..24].try_into().unwrap()), 5);
    }

    #[test]
    fn acks() {
        let mut ack = Vec::new();
        header(&mut ack, NLMSG_ERROR, 0, 42);
        ack.extend_from_slice(&(-17i32).to_ne_bytes());
        ack.extend_from_slice(&[0u8; 16]);
        let ack = finish(ack);
        assert_eq!(parse_ack(&ack, 42).unwrap(), Some(17));
        assert_eq!(parse_ack(&ack, 41).unwrap(), None);
        assert!(parse_ack(&[0xff; 20], 1).is_err());
        assert_eq!(parse_ack(&[], 1).unwrap(), None);
    }
}
