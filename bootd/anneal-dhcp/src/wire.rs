//! Strict decoding of a client's datagram into a [`Request`].

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};

use dhcproto::v4::{Message, MessageType, Opcode};
use dhcproto::{Decodable, Decoder};

use crate::Mac;

/// Largest datagram accepted: the largest UDP payload over IPv4 (65535
/// minus the IP and UDP headers). A DHCP message may exceed an Ethernet MTU
/// (RFC 2131 allows it with option 57; the IP layer fragments and
/// reassembles it), so anything a socket delivers is read.
pub const MAX_PACKET: usize = 65535 - IP_UDP_HEADERS;
/// An IPv4 header without options plus a UDP header: option 57 and the 576
/// minimum count them (RFC 2131 2: 576 octets is an IP datagram).
pub const IP_UDP_HEADERS: usize = 28;
/// Fixed BOOTP header plus the magic cookie.
const HEADER_LEN: usize = 240;
/// The `sname` field (64 bytes), which option 52 may give to options.
const SNAME: std::ops::Range<usize> = 44..108;
/// The `file` field (128 bytes), which option 52 may give to options.
const FILE: std::ops::Range<usize> = 108..236;
/// Option 52, option overload (RFC 2132 9.3).
const OVERLOAD: u8 = 52;
const MAGIC: [u8; 4] = [99, 130, 83, 99];

/// Which server port a datagram arrived on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerPort {
    /// UDP 67: DHCP and proxyDHCP.
    Dhcp,
    /// UDP 4011: PXE boot server discovery (proxyDHCP REQUEST).
    PxeBoot,
}

/// Where a datagram came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ingress {
    /// The port it arrived on.
    pub port: ServerPort,
    /// Its source address and port.
    pub src: SocketAddrV4,
}

/// Why a datagram is not a DHCP request we can read. Each is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Malformed {
    #[error("shorter than a bootp header")]
    Truncated,
    #[error("larger than the maximum datagram")]
    Oversized,
    #[error("not a boot request")]
    NotBootRequest,
    #[error("hardware type is not ethernet")]
    NotEthernet,
    #[error("bad magic cookie")]
    BadMagic,
    #[error("an option runs past the end of the packet")]
    OptionOverflow,
    #[error("no message type option")]
    NoMessageType,
    #[error("an option has an invalid length")]
    BadOptionLength,
    #[error("header does not decode")]
    BadHeader,
    #[error("option 52 (overload) is repeated, not 1 byte, not 1, 2 or 3, or inside file/sname")]
    BadOverload,
    #[error("an overloaded file or sname field has no end option")]
    OverloadNoEnd,
}

impl Malformed {
    /// A fixed label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Malformed::Truncated => "truncated",
            Malformed::Oversized => "oversized",
            Malformed::NotBootRequest => "not_boot_request",
            Malformed::NotEthernet => "not_ethernet",
            Malformed::BadMagic => "bad_magic",
            Malformed::OptionOverflow => "option_overflow",
            Malformed::NoMessageType => "no_message_type",
            Malformed::BadOptionLength => "bad_option_length",
            Malformed::BadHeader => "bad_header",
            Malformed::BadOverload => "bad_overload",
            Malformed::OverloadNoEnd => "overload_no_end",
        }
    }
}

/// What kind of boot client sent the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientKind {
    /// iPXE (user class `iPXE` or option 175): gets the per-machine script URL.
    Ipxe,
    /// Firmware PXE (option 60 starts with `PXEClient`): gets the first stage over TFTP.
    Pxe,
    /// Firmware HTTP boot (option 60 starts with `HTTPClient`): gets an http URL.
    Http,
    /// Anything else (an installed OS renewing its lease).
    Plain,
}

/// A decoded, validated client request.
#[derive(Debug, Clone)]
pub struct Request {
    /// The BOOTP header as `dhcproto` decoded it (options ignored: see `options`).
    pub header: Message,
    /// Options by code, RFC 3396 concatenated; pad and end removed. With
    /// option 52 (overload) this includes the options carried in `file`
    /// and/or `sname`, read in the order options, file, sname (RFC 2131
    /// 4.1); those fields are then cleared in `header`.
    pub options: BTreeMap<u8, Vec<u8>>,
    /// Option 53.
    pub msg_type: MessageType,
    /// Client hardware address.
    pub mac: Mac,
    /// Where it came from.
    pub ingress: Ingress,
}

impl Request {
    /// Validates and decodes one datagram.
    pub fn parse(bytes: &[u8], ingress: Ingress) -> Result<Request, Malformed> {
        if bytes.len() > MAX_PACKET {
            return Err(Malformed::Oversized);
        }
        if bytes.len() < HEADER_LEN {
            return Err(Malformed::Truncated);
        }
        if bytes[0] != 1 {
            return Err(Malformed::NotBootRequest);
        }
        if bytes[1] != 1 || bytes[2] != 6 {
            return Err(Malformed::NotEthernet);
        }
        if bytes[236..240] != MAGIC {
            return Err(Malformed::BadMagic);
        }
        let mut options = BTreeMap::new();
        walk_options(&bytes[HEADER_LEN..], &mut options, false)?;
        // Option 52 (RFC 2132 9.3): 1 = file, 2 = sname, 3 = both hold
        // options, read after the options field, file before sname (RFC
        // 2131 4.1). A repeated 52 concatenates to a length other than 1.
        let overload = match options.get(&OVERLOAD).map(Vec::as_slice) {
            None => 0,
            Some(&[v @ 1..=3]) => v,
            Some(_) => return Err(Malformed::BadOverload),
        };
        if overload & 1 != 0 {
            walk_options(&bytes[FILE], &mut options, true)?;
        }
        if overload & 2 != 0 {
            walk_options(&bytes[SNAME], &mut options, true)?;
        }
        if overload != 0 && options.get(&OVERLOAD).is_none_or(|v| v.len() != 1) {
            // 52 again inside file/sname: not allowed there, and never followed.
            return Err(Malformed::BadOverload);
        }
        // Only the header: options were walked above, strictly.
        let mut header = Message::decode(&mut Decoder::new(&bytes[..HEADER_LEN]))
            .map_err(|_| Malformed::BadHeader)?;
        // Fields that hold options are not a boot file or server name.
        if overload & 1 != 0 {
            header.clear_fname();
        }
        if overload & 2 != 0 {
            header.clear_sname();
        }
        if header.opcode() != Opcode::BootRequest {
            return Err(Malformed::NotBootRequest);
        }
        let msg_type = match options.get(&53) {
            None => return Err(Malformed::NoMessageType),
            Some(v) if v.len() == 1 => MessageType::from(v[0]),
            Some(_) => return Err(Malformed::BadOptionLength),
        };
        for (code, len) in [(50u8, 4usize), (54, 4), (57, 2)] {
            if options.get(&code).is_some_and(|v| v.len() != len) {
                return Err(Malformed::BadOptionLength);
            }
        }
        if options
            .get(&93)
            .is_some_and(|v| v.is_empty() || v.len() % 2 != 0)
        {
            return Err(Malformed::BadOptionLength);
        }
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&bytes[28..34]);
        Ok(Request {
            header,
            options,
            msg_type,
            mac: Mac(mac),
            ingress,
        })
    }

    fn ip_opt(&self, code: u8) -> Option<Ipv4Addr> {
        let v = self.options.get(&code)?;
        let b: [u8; 4] = v.as_slice().try_into().ok()?;
        Some(Ipv4Addr::from(b))
    }

    /// Option 50.
    pub fn requested_ip(&self) -> Option<Ipv4Addr> {
        self.ip_opt(50)
    }

    /// Option 54.
    pub fn server_id(&self) -> Option<Ipv4Addr> {
        self.ip_opt(54)
    }

    /// Option 57, clamped to the RFC 2131 minimum of 576 (576 without it):
    /// the largest IP datagram the client accepts.
    pub fn max_message_size(&self) -> usize {
        self.options
            .get(&57)
            .and_then(|v| <[u8; 2]>::try_from(v.as_slice()).ok())
            .map_or(576, |b| usize::from(u16::from_be_bytes(b)).max(576))
    }

    /// The largest reply (DHCP message, the UDP payload) the client
    /// accepts: [`Request::max_message_size`] less the IP and UDP headers
    /// (548 without option 57).
    pub fn max_reply_len(&self) -> usize {
        self.max_message_size() - IP_UDP_HEADERS
    }

    /// First architecture type of option 93, if any.
    pub fn arch(&self) -> Option<u16> {
        let v = self.options.get(&93)?;
        Some(u16::from_be_bytes([*v.first()?, *v.get(1)?]))
    }

    /// Option 60 as bytes.
    pub fn vendor_class(&self) -> &[u8] {
        self.options.get(&60).map_or(&[], Vec::as_slice)
    }

    /// True if option 77 says `iPXE`, raw (as iPXE sends it) or RFC 3004 framed.
    pub fn user_class_ipxe(&self) -> bool {
        let Some(v) = self.options.get(&77) else {
            return false;
        };
        if v.as_slice() == b"iPXE" {
            return true;
        }
        let mut rest = v.as_slice();
        while let Some((&len, tail)) = rest.split_first() {
            let len = usize::from(len);
            if len == 0 || tail.len() < len {
                return false;
            }
            if &tail[..len] == b"iPXE" {
                return true;
            }
            rest = &tail[len..];
        }
        false
    }

    /// Classifies the client.
    pub fn client_kind(&self) -> ClientKind {
        if self.user_class_ipxe() || self.options.contains_key(&175) {
            ClientKind::Ipxe
        } else if self.vendor_class().starts_with(b"HTTPClient") {
            ClientKind::Http
        } else if self.vendor_class().starts_with(b"PXEClient") {
            ClientKind::Pxe
        } else {
            ClientKind::Plain
        }
    }
}

/// Walks one option area into `out`: every option must fit; same-code runs
/// are concatenated (RFC 3396), also across the options, file and sname
/// fields. In the options field a missing end option is tolerated only when
/// the last option ends exactly at the end of the packet; an overloaded
/// `file` or `sname` field (`need_end`) must hold an end option.
fn walk_options(
    mut area: &[u8],
    out: &mut BTreeMap<u8, Vec<u8>>,
    need_end: bool,
) -> Result<(), Malformed> {
    while let Some((&code, rest)) = area.split_first() {
        match code {
            0 => area = rest,
            255 => return Ok(()),
            _ => {
                let (&len, rest) = rest.split_first().ok_or(Malformed::OptionOverflow)?;
                let len = usize::from(len);
                if rest.len() < len {
                    return Err(Malformed::OptionOverflow);
                }
                out.entry(code).or_default().extend_from_slice(&rest[..len]);
                area = &rest[len..];
            }
        }
    }
    if need_end {
        Err(Malformed::OverloadNoEnd)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ingress() -> Ingress {
        Ingress {
            port: ServerPort::Dhcp,
            src: SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 68),
        }
    }

    fn base(opts: &[u8]) -> Vec<u8> {
        let mut p = vec![0u8; 240];
        p[0] = 1;
        p[1] = 1;
        p[2] = 6;
        p[28..34].copy_from_slice(&[0x52, 0x54, 0, 1, 2, 3]);
        p[236..240].copy_from_slice(&MAGIC);
        p.extend_from_slice(opts);
        p
    }

    #[test]
    fn rejects_hostile_shapes() {
        let ok = base(&[53, 1, 1, 255]);
        assert!(Request::parse(&ok, ingress()).is_ok());
        assert_eq!(
            Request::parse(&ok[..100], ingress()).err(),
            Some(Malformed::Truncated)
        );
        let mut big = ok.clone();
        big.resize(MAX_PACKET + 1, 0);
        assert_eq!(
            Request::parse(&big, ingress()).err(),
            Some(Malformed::Oversized)
        );
        assert_eq!(
            Request::parse(&base(&[53, 1, 1, 60, 200, b'P']), ingress()).err(),
            Some(Malformed::OptionOverflow)
        );
        assert_eq!(
            Request::parse(&base(&[53, 1, 1, 60]), ingress()).err(),
            Some(Malformed::OptionOverflow)
        );
        assert_eq!(
            Request::parse(&base(&[255]), ingress()).err(),
            Some(Malformed::NoMessageType)
        );
        assert_eq!(
            Request::parse(&base(&[53, 2, 1, 1, 255]), ingress()).err(),
            Some(Malformed::BadOptionLength)
        );
        assert_eq!(
            Request::parse(&base(&[53, 1, 1, 93, 3, 0, 7, 0, 255]), ingress()).err(),
            Some(Malformed::BadOptionLength)
        );
        let mut reply = ok.clone();
        reply[0] = 2;
        assert_eq!(
            Request::parse(&reply, ingress()).err(),
            Some(Malformed::NotBootRequest)
        );
        let mut magic = ok.clone();
        magic[236] = 0;
        assert_eq!(
            Request::parse(&magic, ingress()).err(),
            Some(Malformed::BadMagic)
        );
        let mut ib = ok;
        ib[1] = 32;
        assert_eq!(
            Request::parse(&ib, ingress()).err(),
            Some(Malformed::NotEthernet)
        );
    }

    /// Option 57 and the 576 default count the IP and UDP headers.
    #[test]
    fn reply_limit_is_option_57_less_headers() {
        let len = |opts: &[u8]| {
            Request::parse(&base(opts), ingress())
                .unwrap_or_else(|e| panic!("{e}"))
                .max_reply_len()
        };
        assert_eq!(len(&[53, 1, 1, 255]), 548);
        assert_eq!(len(&[53, 1, 1, 57, 2, 0x05, 0xdc, 255]), 1472);
        assert_eq!(len(&[53, 1, 1, 57, 2, 0x01, 0x00, 255]), 548);
        assert_eq!(len(&[53, 1, 1, 57, 2, 0xff, 0xff, 255]), MAX_PACKET);
        // a datagram larger than an Ethernet MTU is read
        let mut big = base(&[53, 1, 1, 57, 2, 0x09, 0xc4]);
        for _ in 0..8 {
            big.extend_from_slice(&[224, 250]);
            big.extend_from_slice(&[0xaa; 250]);
        }
        big.push(255);
        assert!(big.len() > 2000);
        let r = Request::parse(&big, ingress()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.options.get(&224).map(Vec::len), Some(2000));
    }

    #[test]
    fn concatenates_split_options_and_survives_bad_utf8() {
        // hostname with invalid UTF-8 before the architecture option
        let p = base(&[
            53, 1, 1, 12, 2, 0xff, 0xfe, 60, 3, b'P', b'X', b'E', 60, 6, b'C', b'l', b'i', b'e',
            b'n', b't', 93, 2, 0, 7, 255,
        ]);
        let r = Request::parse(&p, ingress()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.vendor_class(), b"PXEClient");
        assert_eq!(r.arch(), Some(7));
        assert_eq!(r.client_kind(), ClientKind::Pxe);
        assert_eq!(r.mac.to_string(), "52:54:00:01:02:03");
    }

    #[test]
    fn ipxe_user_class_raw_and_framed() {
        let raw = base(&[53, 1, 1, 77, 4, b'i', b'P', b'X', b'E', 255]);
        let framed = base(&[53, 1, 1, 77, 5, 4, b'i', b'P', b'X', b'E', 255]);
        let other = base(&[53, 1, 1, 77, 5, 4, b'i', b'P', b'X', b'F', 255]);
        let o175 = base(&[53, 1, 1, 175, 3, 19, 1, 1, 255]);
        for (p, want) in [(raw, true), (framed, true), (other, false), (o175, true)] {
            let r = Request::parse(&p, ingress()).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(r.client_kind() == ClientKind::Ipxe, want);
        }
    }

    /// A packet whose options field is `opts`, with `file` and `sname`
    /// filled from the given bytes (the rest of each field zero).
    fn overloaded(opts: &[u8], file: &[u8], sname: &[u8]) -> Vec<u8> {
        let mut p = base(opts);
        p[FILE][..file.len()].copy_from_slice(file);
        p[SNAME][..sname.len()].copy_from_slice(sname);
        p
    }

    #[test]
    fn overload_reads_file_then_sname() {
        // message type only in `file`: a DISCOVER
        let p = overloaded(&[52, 1, 1, 255], &[53, 1, 1, 255], b"");
        let r = Request::parse(&p, ingress()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.msg_type, MessageType::Discover);
        assert_eq!(r.header.fname(), None, "file held options, not a boot file");
        // both: vendor class split across options, file and sname, in that order
        let p = overloaded(
            &[52, 1, 3, 60, 3, b'P', b'X', b'E', 255],
            &[60, 3, b'C', b'l', b'i', 0, 0, 255],
            &[53, 1, 3, 60, 3, b'e', b'n', b't', 255, 0],
        );
        let r = Request::parse(&p, ingress()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.msg_type, MessageType::Request);
        assert_eq!(r.vendor_class(), b"PXEClient");
        assert_eq!(r.client_kind(), ClientKind::Pxe);
        assert_eq!(r.header.fname(), None);
        assert_eq!(r.header.sname(), None);
        // sname only: `file` stays a file name and is not walked
        let p = overloaded(&[52, 1, 2, 255], b"pxelinux.0", &[53, 1, 1, 255]);
        let r = Request::parse(&p, ingress()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.msg_type, MessageType::Discover);
        assert!(
            r.header
                .fname()
                .is_some_and(|f| f.starts_with(b"pxelinux.0"))
        );
        assert_eq!(r.header.sname(), None);
        // without option 52, file and sname are never read as options
        let p = overloaded(&[255], &[53, 1, 1, 255], &[53, 1, 1, 255]);
        assert_eq!(
            Request::parse(&p, ingress()).err(),
            Some(Malformed::NoMessageType)
        );
    }

    #[test]
    fn overload_hostile_shapes_are_dropped() {
        let cases: [(Vec<u8>, Malformed); 8] = [
            // value out of range, empty, two bytes
            (
                overloaded(&[52, 1, 4, 53, 1, 1, 255], b"", b""),
                Malformed::BadOverload,
            ),
            (
                overloaded(&[52, 0, 53, 1, 1, 255], b"", b""),
                Malformed::BadOverload,
            ),
            (
                overloaded(&[52, 2, 1, 1, 53, 1, 1, 255], b"", b""),
                Malformed::BadOverload,
            ),
            // repeated in the options field
            (
                overloaded(&[52, 1, 1, 52, 1, 1, 255], &[53, 1, 1, 255], b""),
                Malformed::BadOverload,
            ),
            // repeated inside `file`
            (
                overloaded(&[52, 1, 1, 255], &[52, 1, 2, 53, 1, 1, 255], &[255]),
                Malformed::BadOverload,
            ),
            // pointing at garbage: an option running past the end of `file`
            (
                overloaded(&[52, 1, 1, 255], &[53, 1, 1, 60, 200, b'P'], b""),
                Malformed::OptionOverflow,
            ),
            // `file` full of options with no end
            (
                overloaded(
                    &[52, 1, 1, 255],
                    &[[53, 1, 1].as_slice(), &[12, 123], &[b'x'; 123]].concat(),
                    b"",
                ),
                Malformed::OverloadNoEnd,
            ),
            // `sname` all zeros (pads) and no end
            (
                overloaded(&[52, 1, 3, 255], &[53, 1, 1, 255], b""),
                Malformed::OverloadNoEnd,
            ),
        ];
        for (i, (p, want)) in cases.iter().enumerate() {
            assert_eq!(Request::parse(p, ingress()).err(), Some(*want), "case {i}");
        }
        // every byte of an overloaded `file` set to every value: no panic
        let good = overloaded(
            &[52, 1, 3, 255],
            &[53, 1, 1, 60, 3, b'P', b'X', b'E', 255],
            &[255],
        );
        assert!(Request::parse(&good, ingress()).is_ok());
        for i in 44..236 {
            for v in 0..=255u8 {
                let mut b = good.clone();
                b[i] = v;
                let _ = Request::parse(&b, ingress());
            }
        }
    }
}
