//! LLDP (IEEE 802.1AB) frames: what the switch at the other end of a link
//! says about itself (docs/api.md, MachineHardware `nics[].lldp`). A pure
//! parser over one Ethernet frame, no I/O; the listener is
//! `inventory::lldp`.
//!
//! A frame is a destination MAC (one of [`DESTINATIONS`]), a source MAC,
//! EtherType 0x88cc (after at most one 802.1Q tag), then TLVs of a 7-bit
//! type and a 9-bit length: Chassis ID, Port ID and TTL first and in that
//! order, optional TLVs after them, End of LLDPDU (type 0) last. A frame
//! that breaks those rules is refused with an [`LldpError`]; nothing in a
//! frame can make the parser panic or allocate more than a frame's size.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

/// The LLDP EtherType.
pub const ETHERTYPE: u16 = 0x88cc;
/// The 802.1Q tag EtherType (one tag is looked through).
const VLAN_ETHERTYPE: u16 = 0x8100;

/// Destination MACs of LLDP: nearest bridge, nearest non-TPMR bridge,
/// nearest customer bridge.
pub const DESTINATIONS: [[u8; 6]; 3] = [
    [0x01, 0x80, 0xc2, 0x00, 0x00, 0x0e],
    [0x01, 0x80, 0xc2, 0x00, 0x00, 0x03],
    [0x01, 0x80, 0xc2, 0x00, 0x00, 0x00],
];

/// TLV types this parser reads.
mod tlv {
    pub const END: u8 = 0;
    pub const CHASSIS_ID: u8 = 1;
    pub const PORT_ID: u8 = 2;
    pub const TTL: u8 = 3;
    pub const PORT_DESCRIPTION: u8 = 4;
    pub const SYSTEM_NAME: u8 = 5;
}

/// A frame that is not a well-formed LLDPDU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LldpError {
    /// Shorter than an Ethernet header.
    #[error("frame of {0} bytes is shorter than an Ethernet header")]
    Short(usize),
    /// Not sent to an LLDP group address.
    #[error("destination {0} is not an LLDP group address")]
    Destination(String),
    /// Another protocol.
    #[error("EtherType {0:#06x} is not LLDP")]
    EtherType(u16),
    /// A TLV header or value runs past the end of the frame.
    #[error("TLV at byte {offset} runs past the end of the frame")]
    Truncated {
        /// Offset of the TLV header in the frame.
        offset: usize,
    },
    /// A TLV whose length its type does not allow.
    #[error("TLV type {tlv} has length {len}, outside {min}..={max}")]
    Length {
        /// The TLV type.
        tlv: u8,
        /// Its length.
        len: usize,
        /// Smallest allowed.
        min: usize,
        /// Largest allowed.
        max: usize,
    },
    /// The LLDPDU does not start with Chassis ID, Port ID, TTL.
    #[error("TLV type {found} where the mandatory TLV type {expected} must come")]
    Order {
        /// The mandatory TLV expected at this position.
        expected: u8,
        /// What came instead (0 for End of LLDPDU or the end of the frame).
        found: u8,
    },
    /// A mandatory TLV appears a second time.
    #[error("TLV type {0} appears more than once")]
    Duplicate(u8),
}

/// The neighbour one LLDPDU describes, rendered for an operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Neighbor {
    /// Chassis ID (a MAC as `aa:bb:cc:dd:ee:ff`, an address as an IP, a
    /// name as text, anything else as colon-separated hex).
    pub chassis_id: String,
    /// Port ID, rendered like the chassis ID.
    pub port_id: String,
    /// Seconds the information stays valid; 0 announces a shutdown.
    pub ttl: u16,
    /// Port Description TLV.
    pub port_description: Option<String>,
    /// System Name TLV.
    pub system_name: Option<String>,
}

/// Chassis ID subtypes rendered as text (chassis component, interface
/// alias, port component, interface name, locally assigned); 4 is a MAC,
/// 5 a network address.
const CHASSIS_TEXT: [u8; 5] = [1, 2, 3, 6, 7];
/// Port ID subtypes rendered as text (interface alias, port component,
/// interface name, locally assigned); 3 is a MAC, 4 a network address, 6
/// an agent circuit ID (binary).
const PORT_TEXT: [u8; 4] = [1, 2, 5, 7];
const SUBTYPE_MAC_CHASSIS: u8 = 4;
const SUBTYPE_ADDR_CHASSIS: u8 = 5;
const SUBTYPE_MAC_PORT: u8 = 3;
const SUBTYPE_ADDR_PORT: u8 = 4;

/// Parses one Ethernet frame as received on an `AF_PACKET` socket.
pub fn parse(frame: &[u8]) -> Result<Neighbor, LldpError> {
    let Some((dst, mut ethertype, mut rest)) = ethernet(frame) else {
        return Err(LldpError::Short(frame.len()));
    };
    if !DESTINATIONS.contains(&dst) {
        return Err(LldpError::Destination(render_mac(&dst)));
    }
    if ethertype == VLAN_ETHERTYPE {
        let Some((tag, after)) = rest.split_first_chunk::<4>() else {
            return Err(LldpError::Short(frame.len()));
        };
        ethertype = u16::from_be_bytes([tag[2], tag[3]]);
        rest = after;
    }
    if ethertype != ETHERTYPE {
        return Err(LldpError::EtherType(ethertype));
    }
    parse_lldpdu(rest, frame.len() - rest.len())
}

/// Destination, EtherType and payload of an Ethernet II frame (the
/// source is not used).
fn ethernet(frame: &[u8]) -> Option<([u8; 6], u16, &[u8])> {
    let (dst, rest) = frame.split_first_chunk::<6>()?;
    let (_src, rest) = rest.split_first_chunk::<6>()?;
    let (ty, rest) = rest.split_first_chunk::<2>()?;
    Some((*dst, u16::from_be_bytes(*ty), rest))
}

/// The TLVs of an LLDPDU; `base` is its offset in the frame (for errors).
fn parse_lldpdu(pdu: &[u8], base: usize) -> Result<Neighbor, LldpError> {
    let mut tlvs = Tlvs { pdu, pos: 0, base };
    let chassis = tlvs.mandatory(tlv::CHASSIS_ID)?;
    let chassis_id = render_id(chassis, tlv::CHASSIS_ID)?;
    let port = tlvs.mandatory(tlv::PORT_ID)?;
    let port_id = render_id(port, tlv::PORT_ID)?;
    let ttl = tlvs.mandatory(tlv::TTL)?;
    let ttl = match ttl {
        [a, b, ..] => u16::from_be_bytes([*a, *b]),
        _ => return Err(length(tlv::TTL, ttl.len(), 2, 2)),
    };
    let mut n = Neighbor {
        chassis_id,
        port_id,
        ttl,
        port_description: None,
        system_name: None,
    };
    while let Some((ty, value)) = tlvs.next_tlv()? {
        match ty {
            tlv::END => break,
            tlv::CHASSIS_ID | tlv::PORT_ID | tlv::TTL => return Err(LldpError::Duplicate(ty)),
            tlv::PORT_DESCRIPTION if n.port_description.is_none() => {
                n.port_description = text(value);
            }
            tlv::SYSTEM_NAME if n.system_name.is_none() => n.system_name = text(value),
            // system description, capabilities, management address,
            // organisation-specific: not reported
            _ => {}
        }
    }
    Ok(n)
}

/// A cursor over the TLVs of an LLDPDU.
struct Tlvs<'a> {
    pdu: &'a [u8],
    pos: usize,
    base: usize,
}

impl<'a> Tlvs<'a> {
    /// The next TLV, `None` at the end of the frame (an LLDPDU padded to
    /// the Ethernet minimum ends with zeros, which read as End of LLDPDU).
    fn next_tlv(&mut self) -> Result<Option<(u8, &'a [u8])>, LldpError> {
        let rest = self.pdu.get(self.pos..).unwrap_or_default();
        if rest.is_empty() {
            return Ok(None);
        }
        let offset = self.base + self.pos;
        let Some((head, body)) = rest.split_first_chunk::<2>() else {
            return Err(LldpError::Truncated { offset });
        };
        let word = u16::from_be_bytes(*head);
        // 7 bits of type, 9 bits of length: both fit their targets
        let ty = u8::try_from(word >> 9).unwrap_or(u8::MAX);
        let len = usize::from(word & 0x01ff);
        let Some(value) = body.get(..len) else {
            return Err(LldpError::Truncated { offset });
        };
        self.pos += 2 + len;
        Ok(Some((ty, value)))
    }

    /// The value of the mandatory TLV `want`, which must come next.
    fn mandatory(&mut self, want: u8) -> Result<&'a [u8], LldpError> {
        match self.next_tlv()? {
            Some((ty, value)) if ty == want => Ok(value),
            Some((found, _)) => Err(LldpError::Order {
                expected: want,
                found,
            }),
            None => Err(LldpError::Order {
                expected: want,
                found: tlv::END,
            }),
        }
    }
}

fn length(tlv: u8, len: usize, min: usize, max: usize) -> LldpError {
    LldpError::Length { tlv, len, min, max }
}

/// A Chassis ID or Port ID value (subtype byte, then 1 to 255 bytes) as an
/// operator reads it.
fn render_id(value: &[u8], ty: u8) -> Result<String, LldpError> {
    let Some((&subtype, id)) = value.split_first() else {
        return Err(length(ty, 0, 2, 256));
    };
    if id.is_empty() || id.len() > 255 {
        return Err(length(ty, value.len(), 2, 256));
    }
    let (mac, addr, textual): (u8, u8, &[u8]) = if ty == tlv::CHASSIS_ID {
        (SUBTYPE_MAC_CHASSIS, SUBTYPE_ADDR_CHASSIS, &CHASSIS_TEXT)
    } else {
        (SUBTYPE_MAC_PORT, SUBTYPE_ADDR_PORT, &PORT_TEXT)
    };
    let rendered = if subtype == mac && id.len() == 6 {
        render_mac(id)
    } else if subtype == addr {
        render_address(id).unwrap_or_else(|| render_hex(id))
    } else if textual.contains(&subtype) {
        text(id).unwrap_or_else(|| render_hex(id))
    } else {
        render_hex(id)
    };
    Ok(rendered)
}

/// `aa:bb:cc:dd:ee:ff`, lowercase.
fn render_mac(b: &[u8]) -> String {
    render_hex(b)
}

/// Bytes as lowercase colon-separated hex.
fn render_hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 3);
    for (i, x) in b.iter().enumerate() {
        if i > 0 {
            s.push(':');
        }
        let _ = write!(s, "{x:02x}");
    }
    s
}

/// A network address subtype: an IANA address family number, then the
/// address (1 IPv4, 2 IPv6).
fn render_address(b: &[u8]) -> Option<String> {
    match b.split_first()? {
        (1, a) => <[u8; 4]>::try_from(a)
            .ok()
            .map(|a| Ipv4Addr::from(a).to_string()),
        (2, a) => <[u8; 16]>::try_from(a)
            .ok()
            .map(|a| Ipv6Addr::from(a).to_string()),
        _ => None,
    }
}

/// Text from a switch: UTF-8 (lossy), trailing NULs and surrounding spaces
/// removed, control characters replaced; `None` when nothing is left.
fn text(b: &[u8]) -> Option<String> {
    let s: String = String::from_utf8_lossy(b)
        .trim_end_matches('\0')
        .trim()
        .chars()
        .map(|c| if c.is_control() { '\u{fffd}' } else { c })
        .collect();
    (!s.is_empty()).then_some(s)
}

/// Helpers that build frames, for the tests.
#[cfg(test)]
pub(crate) mod build {
    /// A TLV of type `ty` (7 bits) and `value` (at most 511 bytes).
    pub fn tlv(ty: u8, value: &[u8]) -> Vec<u8> {
        let word = (u16::from(ty) << 9) | u16::try_from(value.len()).unwrap();
        let mut v = word.to_be_bytes().to_vec();
        v.extend_from_slice(value);
        v
    }

    /// A frame to the nearest-bridge address from `src` carrying `tlvs`.
    pub fn frame(src: [u8; 6], tlvs: &[Vec<u8>]) -> Vec<u8> {
        let mut f = super::DESTINATIONS[0].to_vec();
        f.extend_from_slice(&src);
        f.extend_from_slice(&super::ETHERTYPE.to_be_bytes());
        for t in tlvs {
            f.extend_from_slice(t);
        }
        f
    }

    /// The mandatory three TLVs.
    pub fn mandatory(chassis: &[u8], port: &[u8], ttl: u16) -> Vec<Vec<u8>> {
        vec![tlv(1, chassis), tlv(2, port), tlv(3, &ttl.to_be_bytes())]
    }
}

#[cfg(test)]
mod tests {
    use super::build::{frame, mandatory, tlv};
    use super::*;

    const SRC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];
    const SWITCH_MAC: [u8; 7] = [4, 0x0c, 0xA1, 0xB2, 0xC3, 0xD4, 0xE5];

    #[test]
    fn a_switch_frame_renders_for_an_operator() {
        let mut tlvs = mandatory(&SWITCH_MAC, b"\x05Ethernet1/17", 120);
        tlvs.push(tlv(4, b"uplink to rack 7\0"));
        tlvs.push(tlv(5, b"leaf-07.dc2"));
        tlvs.push(tlv(6, b"Arista Networks EOS")); // system description
        tlvs.push(tlv(127, &[0x00, 0x80, 0xc2, 1, 0, 1])); // 802.1 PVID
        tlvs.push(tlv(0, b""));
        let mut f = frame(SRC, &tlvs);
        f.extend_from_slice(&[0xde, 0xad]); // after End: ignored
        let n = parse(&f).unwrap();
        assert_eq!(
            n,
            Neighbor {
                chassis_id: "0c:a1:b2:c3:d4:e5".into(),
                port_id: "Ethernet1/17".into(),
                ttl: 120,
                port_description: Some("uplink to rack 7".into()),
                system_name: Some("leaf-07.dc2".into()),
            }
        );
    }

    #[test]
    fn id_subtypes() {
        let port = |p: &[u8]| parse(&frame(SRC, &mandatory(&SWITCH_MAC, p, 1))).unwrap();
        let chassis = |c: &[u8]| parse(&frame(SRC, &mandatory(c, b"\x05p", 1))).unwrap();
        // port: MAC, interface alias, locally assigned, network address
        assert_eq!(
            port(&[3, 0xAA, 0xBB, 0xCC, 0, 1, 2]).port_id,
            "aa:bb:cc:00:01:02"
        );
        assert_eq!(port(b"\x01Gi1/0/3 uplink").port_id, "Gi1/0/3 uplink");
        assert_eq!(port(b"\x0717").port_id, "17");
        assert_eq!(port(&[4, 1, 192, 0, 2, 7]).port_id, "192.0.2.7");
        // agent circuit ID and reserved subtypes: hex
        assert_eq!(port(&[6, 0, 0x1f]).port_id, "00:1f");
        assert_eq!(port(&[200, 0xff]).port_id, "ff");
        // chassis: network address IPv4 and IPv6, interface name, local
        assert_eq!(chassis(&[5, 1, 10, 0, 0, 1]).chassis_id, "10.0.0.1");
        let mut v6 = vec![5, 2];
        v6.extend_from_slice(&"2001:db8::1".parse::<Ipv6Addr>().unwrap().octets());
        assert_eq!(chassis(&v6).chassis_id, "2001:db8::1");
        assert_eq!(chassis(b"\x06eth0").chassis_id, "eth0");
        assert_eq!(chassis(b"\x07serial-42").chassis_id, "serial-42");
        // a MAC subtype of the wrong length, an unknown address family: hex
        assert_eq!(chassis(&[4, 1, 2, 3]).chassis_id, "01:02:03");
        assert_eq!(chassis(&[5, 9, 1, 2]).chassis_id, "09:01:02");
        // names: lossy UTF-8, control characters replaced
        assert_eq!(
            chassis(b"\x07sw\xffa\x1b[2J").chassis_id,
            "sw\u{fffd}a\u{fffd}[2J"
        );
        // a name of spaces only is shown as its bytes
        assert_eq!(chassis(b"\x07  ").chassis_id, "20:20");
    }

    #[test]
    fn group_addresses_and_a_vlan_tag() {
        let tlvs = mandatory(&SWITCH_MAC, b"\x05p1", 30);
        for dst in DESTINATIONS {
            let mut f = frame(SRC, &tlvs);
            f[..6].copy_from_slice(&dst);
            assert_eq!(parse(&f).unwrap().port_id, "p1");
        }
        let mut f = frame(SRC, &tlvs);
        f[..6].copy_from_slice(&[0xff; 6]);
        assert_eq!(
            parse(&f),
            Err(LldpError::Destination("ff:ff:ff:ff:ff:ff".into()))
        );
        // one 802.1Q tag (VLAN 10) before the EtherType
        let plain = frame(SRC, &tlvs);
        let mut tagged = plain[..12].to_vec();
        tagged.extend_from_slice(&[0x81, 0x00, 0x00, 0x0a]);
        tagged.extend_from_slice(&plain[12..]);
        assert_eq!(parse(&tagged).unwrap().port_id, "p1");
        let mut ip = plain.clone();
        ip[12..14].copy_from_slice(&[0x08, 0x00]);
        assert_eq!(parse(&ip), Err(LldpError::EtherType(0x0800)));
    }

    #[test]
    fn malformed_frames_are_refused() {
        assert_eq!(parse(&[0u8; 13]), Err(LldpError::Short(13)));
        // no TLVs at all
        assert_eq!(
            parse(&frame(SRC, &[])),
            Err(LldpError::Order {
                expected: 1,
                found: 0
            })
        );
        // port ID first
        assert_eq!(
            parse(&frame(SRC, &[tlv(2, b"\x05p"), tlv(1, &SWITCH_MAC)])),
            Err(LldpError::Order {
                expected: 1,
                found: 2
            })
        );
        // TTL missing (End instead)
        assert_eq!(
            parse(&frame(
                SRC,
                &[tlv(1, &SWITCH_MAC), tlv(2, b"\x05p"), tlv(0, b"")]
            )),
            Err(LldpError::Order {
                expected: 3,
                found: 0
            })
        );
        // a value running past the end
        let mut f = frame(SRC, &mandatory(&SWITCH_MAC, b"\x05p", 1));
        f.extend_from_slice(&[0x0a, 0x10, b'x']);
        let offset = f.len() - 3;
        assert_eq!(parse(&f), Err(LldpError::Truncated { offset }));
        // half a TLV header
        let mut f = frame(SRC, &mandatory(&SWITCH_MAC, b"\x05p", 1));
        f.push(0x0a);
        assert!(matches!(parse(&f), Err(LldpError::Truncated { .. })));
        // an empty ID, a subtype with no ID, a short TTL
        assert!(matches!(
            parse(&frame(SRC, &mandatory(b"", b"\x05p", 1))),
            Err(LldpError::Length { tlv: 1, .. })
        ));
        assert!(matches!(
            parse(&frame(SRC, &mandatory(&SWITCH_MAC, b"\x05", 1))),
            Err(LldpError::Length { tlv: 2, .. })
        ));
        assert!(matches!(
            parse(&frame(
                SRC,
                &[tlv(1, &SWITCH_MAC), tlv(2, b"\x05p"), tlv(3, &[1])]
            )),
            Err(LldpError::Length { tlv: 3, .. })
        ));
        // an ID of 256 bytes after its subtype
        let mut long = vec![7u8];
        long.extend_from_slice(&[b'a'; 256]);
        assert!(matches!(
            parse(&frame(SRC, &mandatory(&long, b"\x05p", 1))),
            Err(LldpError::Length {
                tlv: 1,
                len: 257,
                ..
            })
        ));
        // a second TTL
        let mut tlvs = mandatory(&SWITCH_MAC, b"\x05p", 1);
        tlvs.push(tlv(3, &[0, 9]));
        assert_eq!(parse(&frame(SRC, &tlvs)), Err(LldpError::Duplicate(3)));
    }

    #[test]
    fn padding_and_bounds() {
        // padded to the Ethernet minimum with zeros: End of LLDPDU
        let mut f = frame(SRC, &mandatory(&SWITCH_MAC, b"\x05p", 0));
        f.resize(60, 0);
        let n = parse(&f).unwrap();
        assert_eq!(n.ttl, 0);
        assert_eq!(n.system_name, None);
        // the longest IDs and names render within their bounds
        let mut id = vec![7u8];
        id.extend_from_slice(&[0xffu8; 255]);
        let mut tlvs = mandatory(&id, &id, 1);
        tlvs.push(tlv(5, &[b'n'; 511]));
        let n = parse(&frame(SRC, &tlvs)).unwrap();
        assert_eq!(n.chassis_id.chars().count(), 255);
        assert_eq!(n.system_name.unwrap().len(), 511);
        // every truncation of a good frame parses or fails, never panics
        let mut tlvs = mandatory(&SWITCH_MAC, b"\x05Ethernet1", 120);
        tlvs.push(tlv(4, b"desc"));
        tlvs.push(tlv(5, b"name"));
        let f = frame(SRC, &tlvs);
        for cut in 0..=f.len() {
            let _ = parse(&f[..cut]);
        }
    }
}
