//! The boot table: what bootd answers from, fed by the watcher or a YAML file.

use std::collections::BTreeMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use crate::Mac;

/// `Subnet.spec.dhcp.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The segment's DHCP server owns addresses; bootd answers only the PXE part.
    Proxy,
    /// bootd is the lease authority.
    Lease,
}

/// An IPv4 network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

/// A CIDR string that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid ipv4 cidr {input:?}")]
pub struct CidrParseError {
    input: String,
}

impl Cidr {
    /// The netmask.
    pub fn mask(&self) -> Ipv4Addr {
        let bits = if self.prefix == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(self.prefix.min(32)))
        };
        Ipv4Addr::from(bits)
    }

    /// True if `ip` is inside.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        let m = u32::from(self.mask());
        u32::from(ip) & m == u32::from(self.addr) & m
    }

    /// The directed broadcast address.
    pub fn broadcast(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) | !u32::from(self.mask()))
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Cidr {
    type Err = CidrParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || CidrParseError { input: s.into() };
        let (a, p) = s.split_once('/').ok_or_else(err)?;
        let addr: Ipv4Addr = a.parse().map_err(|_| err())?;
        let prefix: u8 = p.parse().map_err(|_| err())?;
        if prefix > 32 {
            return Err(err());
        }
        Ok(Cidr { addr, prefix })
    }
}

impl serde::Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Client system architecture (option 93, RFC 4578 and the IANA registry),
/// as far as boot file selection cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// 0: legacy BIOS (also assumed when option 93 is absent).
    Bios,
    /// 7 or 9: UEFI x86-64.
    UefiX64,
    /// 11: UEFI arm64.
    UefiArm64,
    /// 16: UEFI HTTP boot x86-64.
    HttpX64,
    /// 19: UEFI HTTP boot arm64.
    HttpArm64,
    /// Anything else.
    Other(u16),
}

impl Arch {
    /// From option 93.
    pub fn from_option(code: Option<u16>) -> Arch {
        match code {
            None | Some(0) => Arch::Bios,
            Some(7 | 9) => Arch::UefiX64,
            Some(11) => Arch::UefiArm64,
            Some(16) => Arch::HttpX64,
            Some(19) => Arch::HttpArm64,
            Some(n) => Arch::Other(n),
        }
    }

    /// A fixed label for logs and metrics.
    pub fn label(self) -> &'static str {
        match self {
            Arch::Bios => "bios",
            Arch::UefiX64 => "uefi_x64",
            Arch::UefiArm64 => "uefi_arm64",
            Arch::HttpX64 => "http_x64",
            Arch::HttpArm64 => "http_arm64",
            Arch::Other(_) => "other",
        }
    }
}

/// First-stage file names per architecture (configurable per Subnet).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct BootFiles {
    pub bios: String,
    pub uefi_x64: String,
    pub uefi_arm64: String,
    /// The signed shim for machines whose loader is [`Loader::Shim`] (it
    /// loads `grubx64.efi` from the same directory).
    pub uefi_x64_shim: String,
    /// See [`BootFiles::uefi_x64_shim`] (it loads `grubaa64.efi`).
    pub uefi_arm64_shim: String,
}

impl Default for BootFiles {
    fn default() -> Self {
        BootFiles {
            bios: "undionly.kpxe".into(),
            uefi_x64: "snponly.efi".into(),
            uefi_arm64: "snponly-arm64.efi".into(),
            uefi_x64_shim: "shimx64.efi".into(),
            uefi_arm64_shim: "shimaa64.efi".into(),
        }
    }
}

/// The boot chain of one machine (Machine `spec.bootLoader`): `Shim` means
/// a signed shim, network GRUB, then the signed kernel (Secure Boot with the
/// Microsoft UEFI CA); UEFI only, BIOS clients still get iPXE.
pub use anneal_api::boot::BootLoader as Loader;

/// One enrolled machine of this Subnet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineEntry {
    /// `namespace/name`.
    pub name: String,
    /// Reserved address (lease mode; from `status.dhcp.reservations`).
    pub address: Option<Ipv4Addr>,
    pub loader: Loader,
}

/// Everything one Subnet's DHCP answers depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootTable {
    pub mode: Mode,
    /// bootd's own address on the segment: server identifier, next-server.
    pub server_ip: Ipv4Addr,
    pub cidr: Cidr,
    /// Router option: `Some` only when the gateway is an address (the
    /// tri-state's absent and `""` both mean no router option).
    pub router: Option<Ipv4Addr>,
    pub dns: Vec<Ipv4Addr>,
    /// Seconds.
    pub lease_time: u32,
    /// Dynamic range for `answer_all` in lease mode (inclusive).
    pub lease_range: Option<(Ipv4Addr, Ipv4Addr)>,
    /// Disables the MAC gate.
    pub answer_all: bool,
    pub boot_files: BootFiles,
    /// Base URL of bootd's HTTP server, e.g. `http://10.77.0.2:8080`.
    pub http_base: String,
    /// Enrolled machines by boot MAC.
    pub machines: BTreeMap<Mac, MachineEntry>,
    /// `status.dhcp.revision` this table was built from.
    pub revision: String,
}

impl BootTable {
    /// The per-machine iPXE script URL.
    pub fn script_url(&self, mac: Mac) -> String {
        format!(
            "{}/ipxe/{}",
            self.http_base.trim_end_matches('/'),
            mac.dashed()
        )
    }

    /// URL of a first-stage file for UEFI HTTP boot.
    pub fn file_url(&self, name: &str) -> String {
        format!("{}/files/{}", self.http_base.trim_end_matches('/'), name)
    }

    /// True if the address is one bootd must never hand to a client.
    pub fn is_reserved_infra(&self, ip: Ipv4Addr) -> bool {
        ip == self.server_ip
            || Some(ip) == self.router
            || ip == self.cidr.broadcast()
            || u32::from(ip) == u32::from(self.cidr.addr) & u32::from(self.cidr.mask())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_math() {
        let c: Cidr = "10.77.0.0/24".parse().unwrap_or(Cidr {
            addr: Ipv4Addr::UNSPECIFIED,
            prefix: 0,
        });
        assert_eq!(c.mask(), Ipv4Addr::new(255, 255, 255, 0));
        assert!(c.contains(Ipv4Addr::new(10, 77, 0, 200)));
        assert!(!c.contains(Ipv4Addr::new(10, 78, 0, 1)));
        assert_eq!(c.broadcast(), Ipv4Addr::new(10, 77, 0, 255));
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("10.0.0.0".parse::<Cidr>().is_err());
    }

    #[test]
    fn arch_mapping() {
        assert_eq!(Arch::from_option(None), Arch::Bios);
        assert_eq!(Arch::from_option(Some(7)), Arch::UefiX64);
        assert_eq!(Arch::from_option(Some(9)), Arch::UefiX64);
        assert_eq!(Arch::from_option(Some(11)), Arch::UefiArm64);
        assert_eq!(Arch::from_option(Some(16)), Arch::HttpX64);
        assert_eq!(Arch::from_option(Some(19)), Arch::HttpArm64);
        assert_eq!(Arch::from_option(Some(6)), Arch::Other(6));
    }
}
