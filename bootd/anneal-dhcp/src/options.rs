//! Encapsulated vendor options: PXE (option 43, PXE 2.1 spec) and iPXE
//! (option 175). `dhcproto` carries both as raw bytes; their sub-options are
//! encoded here and pinned by golden vectors.

use std::net::Ipv4Addr;

/// PXE sub-option: discovery control.
pub const PXE_DISCOVERY_CONTROL: u8 = 6;
/// PXE sub-option: boot servers.
pub const PXE_BOOT_SERVERS: u8 = 8;
/// PXE sub-option: boot menu.
pub const PXE_BOOT_MENU: u8 = 9;
/// PXE sub-option: menu prompt.
pub const PXE_MENU_PROMPT: u8 = 10;
/// PXE sub-option: boot item (in the port 4011 exchange).
pub const PXE_BOOT_ITEM: u8 = 71;
/// Discovery control bit 3: a boot file in the offer is downloaded at once,
/// with no menu, prompt or boot server discovery.
pub const DISCOVERY_USE_BOOTFILE: u8 = 0x08;

/// iPXE encapsulated sub-option 176: no-pxedhcp (do not wait for proxyDHCP).
pub const IPXE_NO_PXEDHCP: u8 = 176;

/// A sub-option that does not fit a one-byte length, or a malformed blob.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    #[error("sub-option {code} is {len} bytes, more than 255")]
    TooLong { code: u8, len: usize },
    #[error("encapsulated option area is {len} bytes, more than 255")]
    AreaTooLong { len: usize },
    #[error("sub-option {code} runs past the end")]
    Overflow { code: u8 },
}

/// One PXE boot server entry (sub-option 8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootServer {
    pub server_type: u16,
    pub addrs: Vec<Ipv4Addr>,
}

/// One PXE boot menu entry (sub-option 9).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MenuItem {
    pub server_type: u16,
    pub description: String,
}

/// PXE vendor options carried in option 43.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PxeVendorOptions {
    pub discovery_control: Option<u8>,
    pub boot_servers: Vec<BootServer>,
    pub boot_menu: Vec<MenuItem>,
    /// (timeout in seconds, prompt)
    pub menu_prompt: Option<(u8, String)>,
    /// (server type, layer)
    pub boot_item: Option<(u16, u16)>,
}

fn push_sub(out: &mut Vec<u8>, code: u8, body: &[u8]) -> Result<(), OptionError> {
    let len = u8::try_from(body.len()).map_err(|_| OptionError::TooLong {
        code,
        len: body.len(),
    })?;
    out.push(code);
    out.push(len);
    out.extend_from_slice(body);
    Ok(())
}

impl PxeVendorOptions {
    /// The option 43 body a proxyDHCP offer carries: "boot the file in this
    /// offer, no menu, no discovery".
    pub fn boot_file_only() -> Self {
        PxeVendorOptions {
            discovery_control: Some(DISCOVERY_USE_BOOTFILE),
            ..Default::default()
        }
    }

    /// Encodes the sub-options, terminated by 255.
    pub fn encode(&self) -> Result<Vec<u8>, OptionError> {
        let mut out = Vec::new();
        if let Some(dc) = self.discovery_control {
            push_sub(&mut out, PXE_DISCOVERY_CONTROL, &[dc])?;
        }
        if !self.boot_servers.is_empty() {
            let mut body = Vec::new();
            for s in &self.boot_servers {
                body.extend_from_slice(&s.server_type.to_be_bytes());
                let n = u8::try_from(s.addrs.len()).map_err(|_| OptionError::TooLong {
                    code: PXE_BOOT_SERVERS,
                    len: s.addrs.len(),
                })?;
                body.push(n);
                for a in &s.addrs {
                    body.extend_from_slice(&a.octets());
                }
            }
            push_sub(&mut out, PXE_BOOT_SERVERS, &body)?;
        }
        if !self.boot_menu.is_empty() {
            let mut body = Vec::new();
            for m in &self.boot_menu {
                body.extend_from_slice(&m.server_type.to_be_bytes());
                let d = m.description.as_bytes();
                let n = u8::try_from(d.len()).map_err(|_| OptionError::TooLong {
                    code: PXE_BOOT_MENU,
                    len: d.len(),
                })?;
                body.push(n);
                body.extend_from_slice(d);
            }
            push_sub(&mut out, PXE_BOOT_MENU, &body)?;
        }
        if let Some((timeout, prompt)) = &self.menu_prompt {
            let mut body = vec![*timeout];
            body.extend_from_slice(prompt.as_bytes());
            push_sub(&mut out, PXE_MENU_PROMPT, &body)?;
        }
        if let Some((ty, layer)) = self.boot_item {
            let mut body = ty.to_be_bytes().to_vec();
            body.extend_from_slice(&layer.to_be_bytes());
            push_sub(&mut out, PXE_BOOT_ITEM, &body)?;
        }
        out.push(255);
        if out.len() > 255 {
            return Err(OptionError::AreaTooLong { len: out.len() });
        }
        Ok(out)
    }
}

/// iPXE settings carried in option 175.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IpxeOptions {
    /// Sub-option 176 = 1: skip the ~3 s wait for a proxyDHCP offer.
    pub no_pxedhcp: bool,
}

impl IpxeOptions {
    /// Encodes the sub-options (iPXE expects no end marker inside 175).
    pub fn encode(&self) -> Result<Vec<u8>, OptionError> {
        let mut out = Vec::new();
        if self.no_pxedhcp {
            push_sub(&mut out, IPXE_NO_PXEDHCP, &[1])?;
        }
        Ok(out)
    }
}

/// Splits an encapsulated option area into (code, body) pairs; pad skipped,
/// stops at 255.
pub fn parse_suboptions(mut area: &[u8]) -> Result<Vec<(u8, &[u8])>, OptionError> {
    let mut out = Vec::new();
    while let Some((&code, rest)) = area.split_first() {
        match code {
            0 => area = rest,
            255 => break,
            _ => {
                let (&len, rest) = rest.split_first().ok_or(OptionError::Overflow { code })?;
                let len = usize::from(len);
                let body = rest.get(..len).ok_or(OptionError::Overflow { code })?;
                out.push((code, body));
                area = &rest[len..];
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pxe_boot_file_only_vector() {
        assert_eq!(
            PxeVendorOptions::boot_file_only().encode(),
            Ok(vec![6, 1, 8, 255])
        );
    }

    #[test]
    fn pxe_menu_vector() {
        let o = PxeVendorOptions {
            discovery_control: Some(7),
            boot_servers: vec![BootServer {
                server_type: 0x8000,
                addrs: vec![Ipv4Addr::new(10, 77, 0, 2)],
            }],
            boot_menu: vec![MenuItem {
                server_type: 0x8000,
                description: "anneal".into(),
            }],
            menu_prompt: Some((0, "PXE".into())),
            boot_item: Some((0x8000, 0)),
        };
        let want = [
            6, 1, 7, // discovery control
            8, 7, 0x80, 0x00, 1, 10, 77, 0, 2, // boot servers
            9, 9, 0x80, 0x00, 6, b'a', b'n', b'n', b'e', b'a', b'l', // menu
            10, 4, 0, b'P', b'X', b'E', // prompt
            71, 4, 0x80, 0x00, 0, 0, // boot item
            255,
        ];
        assert_eq!(o.encode(), Ok(want.to_vec()));
        let subs = parse_suboptions(&want).unwrap_or_default();
        assert_eq!(subs.len(), 5);
        assert_eq!(subs[4], (71, &[0x80, 0, 0, 0][..]));
    }

    #[test]
    fn pxe_too_long_is_an_error() {
        let o = PxeVendorOptions {
            menu_prompt: Some((0, "x".repeat(300))),
            ..Default::default()
        };
        assert!(matches!(
            o.encode(),
            Err(OptionError::TooLong { code: 10, .. })
        ));
    }

    #[test]
    fn ipxe_no_pxedhcp_vector() {
        assert_eq!(
            IpxeOptions { no_pxedhcp: true }.encode(),
            Ok(vec![176, 1, 1])
        );
        assert_eq!(IpxeOptions::default().encode(), Ok(vec![]));
    }

    #[test]
    fn suboptions_overflow() {
        assert_eq!(
            parse_suboptions(&[6, 5, 1]),
            Err(OptionError::Overflow { code: 6 })
        );
        assert_eq!(
            parse_suboptions(&[6]),
            Err(OptionError::Overflow { code: 6 })
        );
    }
}
