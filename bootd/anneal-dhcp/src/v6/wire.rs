//! Strict decoding and encoding of DHCPv6 messages (RFC 8415 section 8 and
//! 9): the client/server form, the relay form with its nested Relay-Message,
//! options as (code, bytes) in wire order, DUIDs.

use std::net::Ipv6Addr;

use crate::Mac;

/// Largest datagram read: a DHCPv6 message may use the whole UDP payload
/// over IPv6 (the IP layer fragments it).
pub const MAX_PACKET6: usize = 65535 - 8;
/// RFC 8415 7.6 HOP_COUNT_LIMIT: relays nest at most this deep.
pub const HOP_COUNT_LIMIT: u8 = 8;
/// Options read from one message at most (a datagram of 4-byte empty
/// options would be 16,000 of them).
pub const MAX_OPTIONS: usize = 256;

/// Option codes used here (IANA "DHCPv6 Option Codes").
pub mod opt {
    pub const CLIENTID: u16 = 1;
    pub const SERVERID: u16 = 2;
    pub const IA_NA: u16 = 3;
    pub const IA_TA: u16 = 4;
    pub const IAADDR: u16 = 5;
    pub const ORO: u16 = 6;
    pub const ELAPSED_TIME: u16 = 8;
    pub const RELAY_MSG: u16 = 9;
    pub const STATUS_CODE: u16 = 13;
    pub const RAPID_COMMIT: u16 = 14;
    pub const USER_CLASS: u16 = 15;
    pub const VENDOR_CLASS: u16 = 16;
    pub const INTERFACE_ID: u16 = 18;
    pub const DNS_SERVERS: u16 = 23;
    pub const IA_PD: u16 = 25;
    /// RFC 5970.
    pub const BOOTFILE_URL: u16 = 59;
    /// RFC 5970.
    pub const BOOTFILE_PARAM: u16 = 60;
    /// RFC 5970: client system architecture types (RFC 4578 values).
    pub const CLIENT_ARCH_TYPE: u16 = 61;
    /// RFC 5970: client network interface identifier (UNDI type, version).
    pub const NII: u16 = 62;
    /// RFC 6939: client link-layer address, added by a relay.
    pub const CLIENT_LINKLAYER_ADDR: u16 = 79;
}

/// Message types (RFC 8415 7.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgType {
    Solicit,
    Advertise,
    Request,
    Confirm,
    Renew,
    Rebind,
    Reply,
    Release,
    Decline,
    Reconfigure,
    InformationRequest,
    RelayForw,
    RelayRepl,
    Other(u8),
}

impl MsgType {
    /// From the first octet.
    pub fn from_u8(v: u8) -> MsgType {
        match v {
            1 => MsgType::Solicit,
            2 => MsgType::Advertise,
            3 => MsgType::Request,
            4 => MsgType::Confirm,
            5 => MsgType::Renew,
            6 => MsgType::Rebind,
            7 => MsgType::Reply,
            8 => MsgType::Release,
            9 => MsgType::Decline,
            10 => MsgType::Reconfigure,
            11 => MsgType::InformationRequest,
            12 => MsgType::RelayForw,
            13 => MsgType::RelayRepl,
            n => MsgType::Other(n),
        }
    }

    /// The first octet.
    pub fn to_u8(self) -> u8 {
        match self {
            MsgType::Solicit => 1,
            MsgType::Advertise => 2,
            MsgType::Request => 3,
            MsgType::Confirm => 4,
            MsgType::Renew => 5,
            MsgType::Rebind => 6,
            MsgType::Reply => 7,
            MsgType::Release => 8,
            MsgType::Decline => 9,
            MsgType::Reconfigure => 10,
            MsgType::InformationRequest => 11,
            MsgType::RelayForw => 12,
            MsgType::RelayRepl => 13,
            MsgType::Other(n) => n,
        }
    }

    /// A fixed label for logs and metrics.
    pub fn label(self) -> &'static str {
        match self {
            MsgType::Solicit => "solicit",
            MsgType::Advertise => "advertise",
            MsgType::Request => "request",
            MsgType::Confirm => "confirm",
            MsgType::Renew => "renew",
            MsgType::Rebind => "rebind",
            MsgType::Reply => "reply",
            MsgType::Release => "release",
            MsgType::Decline => "decline",
            MsgType::Reconfigure => "reconfigure",
            MsgType::InformationRequest => "information_request",
            MsgType::RelayForw => "relay_forw",
            MsgType::RelayRepl => "relay_repl",
            MsgType::Other(_) => "other",
        }
    }
}

/// Why a datagram is not a DHCPv6 message we can read. Each is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Malformed6 {
    #[error("shorter than a dhcpv6 header")]
    Truncated,
    #[error("larger than the maximum datagram")]
    Oversized,
    #[error("an option runs past the end of its message")]
    OptionOverflow,
    #[error("more options than a message may carry here")]
    TooManyOptions,
    #[error("an option has an invalid length")]
    BadOptionLength,
    #[error("relay messages nest deeper than the hop count limit")]
    RelayTooDeep,
    #[error("a relay-forward message carries no relay message option")]
    RelayNoMessage,
    #[error("a client message carries no client identifier")]
    NoClientId,
    #[error("a duid is shorter than its type requires or longer than 130 bytes")]
    BadDuid,
    #[error("an option that may appear once appears twice")]
    Repeated,
}

impl Malformed6 {
    /// A fixed label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Malformed6::Truncated => "v6_truncated",
            Malformed6::Oversized => "v6_oversized",
            Malformed6::OptionOverflow => "v6_option_overflow",
            Malformed6::TooManyOptions => "v6_too_many_options",
            Malformed6::BadOptionLength => "v6_bad_option_length",
            Malformed6::RelayTooDeep => "v6_relay_too_deep",
            Malformed6::RelayNoMessage => "v6_relay_no_message",
            Malformed6::NoClientId => "v6_no_client_id",
            Malformed6::BadDuid => "v6_bad_duid",
            Malformed6::Repeated => "v6_repeated_option",
        }
    }
}

/// Options in wire order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options(pub Vec<(u16, Vec<u8>)>);

impl Options {
    /// Walks `b` as a sequence of options, strictly.
    pub fn parse(mut b: &[u8]) -> Result<Options, Malformed6> {
        let mut out = Vec::new();
        while !b.is_empty() {
            if b.len() < 4 {
                return Err(Malformed6::OptionOverflow);
            }
            let code = u16::from_be_bytes([b[0], b[1]]);
            let len = usize::from(u16::from_be_bytes([b[2], b[3]]));
            let body = b.get(4..4 + len).ok_or(Malformed6::OptionOverflow)?;
            if out.len() == MAX_OPTIONS {
                return Err(Malformed6::TooManyOptions);
            }
            out.push((code, body.to_vec()));
            b = &b[4 + len..];
        }
        Ok(Options(out))
    }

    /// The first option `code`.
    pub fn get(&self, code: u16) -> Option<&[u8]> {
        self.0
            .iter()
            .find(|(c, _)| *c == code)
            .map(|(_, v)| v.as_slice())
    }

    /// Every option `code`, in order.
    pub fn all(&self, code: u16) -> impl Iterator<Item = &[u8]> {
        self.0
            .iter()
            .filter(move |(c, _)| *c == code)
            .map(|(_, v)| v.as_slice())
    }

    /// The option at most once.
    pub fn once(&self, code: u16) -> Result<Option<&[u8]>, Malformed6> {
        let mut it = self.all(code);
        let first = it.next();
        if it.next().is_some() {
            return Err(Malformed6::Repeated);
        }
        Ok(first)
    }

    /// Appends an option.
    pub fn push(&mut self, code: u16, body: Vec<u8>) {
        self.0.push((code, body));
    }

    /// The wire form.
    pub fn encode(&self, out: &mut Vec<u8>) {
        for (code, body) in &self.0 {
            out.extend_from_slice(&code.to_be_bytes());
            // bodies built here stay far below 64 KiB; a longer one is cut
            let len = u16::try_from(body.len()).unwrap_or(u16::MAX);
            out.extend_from_slice(&len.to_be_bytes());
            out.extend_from_slice(&body[..usize::from(len)]);
        }
    }
}

/// A client/server message (RFC 8415 8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message6 {
    pub msg_type: MsgType,
    pub xid: [u8; 3],
    pub options: Options,
}

impl Message6 {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(256);
        out.push(self.msg_type.to_u8());
        out.extend_from_slice(&self.xid);
        self.options.encode(&mut out);
        out
    }
}

/// One relay hop (RFC 8415 9): the fields a Relay-Reply echoes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayHop {
    pub hop_count: u8,
    pub link: Ipv6Addr,
    pub peer: Ipv6Addr,
    /// Every option but the Relay Message.
    pub options: Options,
}

/// A decoded datagram: the client's message and the relays it came
/// through, outermost first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet6 {
    pub relays: Vec<RelayHop>,
    pub message: Message6,
}

impl Packet6 {
    /// Decodes a datagram received on port 547 (relays are Relay-Forward).
    pub fn parse(b: &[u8]) -> Result<Packet6, Malformed6> {
        Self::parse_as(b, MsgType::RelayForw)
    }

    /// Decodes a datagram whose relay hops are `relay_type` messages
    /// (Relay-Reply for what a server sends).
    pub fn parse_as(b: &[u8], relay_type: MsgType) -> Result<Packet6, Malformed6> {
        if b.len() > MAX_PACKET6 {
            return Err(Malformed6::Oversized);
        }
        let mut relays = Vec::new();
        let message = Self::unwrap(b, relay_type, &mut relays)?;
        Ok(Packet6 { relays, message })
    }

    /// Peels Relay-Forward messages off `b` into `relays` (outermost
    /// first) and decodes the client message inside.
    fn unwrap(
        b: &[u8],
        relay_type: MsgType,
        relays: &mut Vec<RelayHop>,
    ) -> Result<Message6, Malformed6> {
        let Some(&first) = b.first() else {
            return Err(Malformed6::Truncated);
        };
        if MsgType::from_u8(first) != relay_type {
            if b.len() < 4 {
                return Err(Malformed6::Truncated);
            }
            return Ok(Message6 {
                msg_type: MsgType::from_u8(first),
                xid: [b[1], b[2], b[3]],
                options: Options::parse(&b[4..])?,
            });
        }
        if b.len() < 34 {
            return Err(Malformed6::Truncated);
        }
        if relays.len() >= usize::from(HOP_COUNT_LIMIT) {
            return Err(Malformed6::RelayTooDeep);
        }
        let mut options = Options::parse(&b[34..])?;
        let inner_at = options
            .0
            .iter()
            .position(|(c, _)| *c == opt::RELAY_MSG)
            .ok_or(Malformed6::RelayNoMessage)?;
        let (_, inner) = options.0.remove(inner_at);
        if options.get(opt::RELAY_MSG).is_some() {
            return Err(Malformed6::Repeated);
        }
        relays.push(RelayHop {
            hop_count: b[1],
            link: addr(&b[2..18]),
            peer: addr(&b[18..34]),
            options,
        });
        Self::unwrap(&inner, relay_type, relays)
    }

    /// The wire form, relays wrapped around the message (a reply's relays
    /// become Relay-Reply messages).
    pub fn encode(&self, relay_type: MsgType) -> Vec<u8> {
        let mut bytes = self.message.encode();
        for hop in self.relays.iter().rev() {
            let mut out = Vec::with_capacity(bytes.len() + 64);
            out.push(relay_type.to_u8());
            out.push(hop.hop_count);
            out.extend_from_slice(&hop.link.octets());
            out.extend_from_slice(&hop.peer.octets());
            let mut o = hop.options.clone();
            o.push(opt::RELAY_MSG, bytes);
            o.encode(&mut out);
            bytes = out;
        }
        bytes
    }
}

fn addr(b: &[u8]) -> Ipv6Addr {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[..16]);
    Ipv6Addr::from(a)
}

/// A DHCP Unique Identifier (RFC 8415 11).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Duid {
    /// Type 1: link-layer address plus time.
    Llt { hw: u16, time: u32, ll: Vec<u8> },
    /// Type 2: enterprise number plus identifier.
    En { enterprise: u32, id: Vec<u8> },
    /// Type 3: link-layer address.
    Ll { hw: u16, ll: Vec<u8> },
    /// Type 4 (RFC 6355): a UUID (UEFI firmware uses the SMBIOS UUID).
    Uuid([u8; 16]),
    /// Any other type.
    Other { kind: u16, body: Vec<u8> },
}

impl Duid {
    /// Decodes a client or server identifier option's body.
    pub fn parse(b: &[u8]) -> Result<Duid, Malformed6> {
        if b.len() < 3 || b.len() > 130 {
            return Err(Malformed6::BadDuid);
        }
        let kind = u16::from_be_bytes([b[0], b[1]]);
        let rest = &b[2..];
        Ok(match kind {
            1 => {
                if rest.len() < 7 {
                    return Err(Malformed6::BadDuid);
                }
                Duid::Llt {
                    hw: u16::from_be_bytes([rest[0], rest[1]]),
                    time: u32::from_be_bytes([rest[2], rest[3], rest[4], rest[5]]),
                    ll: rest[6..].to_vec(),
                }
            }
            2 => {
                if rest.len() < 5 {
                    return Err(Malformed6::BadDuid);
                }
                Duid::En {
                    enterprise: u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]),
                    id: rest[4..].to_vec(),
                }
            }
            3 => {
                if rest.len() < 3 {
                    return Err(Malformed6::BadDuid);
                }
                Duid::Ll {
                    hw: u16::from_be_bytes([rest[0], rest[1]]),
                    ll: rest[2..].to_vec(),
                }
            }
            4 => {
                let u: [u8; 16] = rest.try_into().map_err(|_| Malformed6::BadDuid)?;
                Duid::Uuid(u)
            }
            _ => Duid::Other {
                kind,
                body: rest.to_vec(),
            },
        })
    }

    /// The Ethernet address inside a DUID-LL or DUID-LLT (hardware type 1).
    pub fn mac(&self) -> Option<Mac> {
        match self {
            Duid::Llt { hw: 1, ll, .. } | Duid::Ll { hw: 1, ll } => {
                let b: [u8; 6] = ll.as_slice().try_into().ok()?;
                Some(Mac(b))
            }
            _ => None,
        }
    }

    /// A DUID-LL for an Ethernet address (a server identifier).
    pub fn ll_ethernet(mac: Mac) -> Vec<u8> {
        let mut v = vec![0, 3, 0, 1];
        v.extend_from_slice(&mac.0);
        v
    }
}

/// The Ethernet address of a modified EUI-64 interface identifier
/// (RFC 4291 appendix A): a link-local source address formed from a MAC,
/// as UEFI firmware forms it.
pub fn eui64_mac(a: Ipv6Addr) -> Option<Mac> {
    let o = a.octets();
    if o[11] != 0xff || o[12] != 0xfe {
        return None;
    }
    Some(Mac([o[8] ^ 0x02, o[9], o[10], o[13], o[14], o[15]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_walk_strictly() {
        assert_eq!(
            Options::parse(&[0, 1, 0, 2, 9, 9]).map(|o| o.0),
            Ok(vec![(1, vec![9, 9])])
        );
        assert_eq!(
            Options::parse(&[0, 1, 0, 3, 9, 9]),
            Err(Malformed6::OptionOverflow)
        );
        assert_eq!(Options::parse(&[0, 1, 0]), Err(Malformed6::OptionOverflow));
        let many: Vec<u8> = std::iter::repeat_n([0u8, 8, 0, 0], MAX_OPTIONS + 1)
            .flatten()
            .collect();
        assert_eq!(Options::parse(&many), Err(Malformed6::TooManyOptions));
    }

    #[test]
    fn duids() {
        let llt = [0, 1, 0, 1, 0x2a, 0x2b, 0x2c, 0x2d, 0x52, 0x54, 0, 1, 2, 3];
        assert_eq!(
            Duid::parse(&llt).ok().and_then(|d| d.mac()),
            Some(Mac([0x52, 0x54, 0, 1, 2, 3]))
        );
        let ll = Duid::ll_ethernet(Mac([2, 0, 0, 0, 0, 7]));
        assert_eq!(
            Duid::parse(&ll).ok().and_then(|d| d.mac()),
            Some(Mac([2, 0, 0, 0, 0, 7]))
        );
        let mut uuid = vec![0, 4];
        uuid.extend_from_slice(&[7u8; 16]);
        assert_eq!(Duid::parse(&uuid), Ok(Duid::Uuid([7u8; 16])));
        assert_eq!(Duid::parse(&uuid[..10]), Err(Malformed6::BadDuid));
        assert_eq!(Duid::parse(&[0, 1]), Err(Malformed6::BadDuid));
        assert_eq!(Duid::parse(&[0u8; 131]), Err(Malformed6::BadDuid));
    }

    #[test]
    fn eui64() {
        let a: Ipv6Addr = "fe80::5054:ff:fe12:3456"
            .parse()
            .unwrap_or(Ipv6Addr::UNSPECIFIED);
        assert_eq!(eui64_mac(a), Some(Mac([0x52, 0x54, 0, 0x12, 0x34, 0x56])));
        assert_eq!(eui64_mac(Ipv6Addr::LOCALHOST), None);
    }

    #[test]
    fn relays_nest_and_are_bounded() {
        let inner = Message6 {
            msg_type: MsgType::Solicit,
            xid: [1, 2, 3],
            options: Options(vec![(
                opt::CLIENTID,
                Duid::ll_ethernet(Mac([2, 0, 0, 0, 0, 1])),
            )]),
        };
        let hop = |n: u8| RelayHop {
            hop_count: n,
            link: Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1),
            peer: Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, u16::from(n) + 2),
            options: Options(vec![(opt::INTERFACE_ID, vec![n])]),
        };
        let p = Packet6 {
            relays: vec![hop(1), hop(0)],
            message: inner.clone(),
        };
        let bytes = p.encode(MsgType::RelayForw);
        assert_eq!(Packet6::parse(&bytes), Ok(p));
        let deep = Packet6 {
            relays: (0..=HOP_COUNT_LIMIT).map(hop).collect(),
            message: inner,
        };
        assert_eq!(
            Packet6::parse(&deep.encode(MsgType::RelayForw)),
            Err(Malformed6::RelayTooDeep)
        );
        // a relay-forward without a relay message
        let mut bare = vec![12u8, 0];
        bare.extend_from_slice(&[0u8; 32]);
        assert_eq!(Packet6::parse(&bare), Err(Malformed6::RelayNoMessage));
        assert_eq!(Packet6::parse(&[]), Err(Malformed6::Truncated));
        assert_eq!(Packet6::parse(&[1, 0]), Err(Malformed6::Truncated));
    }
}
