//! Ethernet MAC addresses: one type for the agent, bootd and the manager.
//!
//! Parsed from six hex octets separated by `:` or `-` (any case, the forms
//! the kernel, iPXE and users write); printed and serialized as the
//! canonical lowercase colon form `aa:bb:cc:dd:ee:ff` that docs/api.md uses.

use std::fmt;
use std::str::FromStr;

/// A 48-bit Ethernet address.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Mac(pub [u8; 6]);

/// A MAC address string that is not six two-digit hex octets separated by
/// `:` or `-`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid MAC address {input:?}: expected six hex octets like aa:bb:cc:dd:ee:ff")]
pub struct MacParseError {
    input: String,
}

impl Mac {
    /// The `01-aa-bb-cc-dd-ee-ff` form of the kernel's `BOOTIF=` (ARP
    /// hardware type 1, Ethernet, then the address).
    pub fn bootif(&self) -> String {
        format!("01-{}", self.dashed())
    }

    /// `aa-bb-cc-dd-ee-ff`, safe in URL paths and file names.
    pub fn dashed(&self) -> String {
        let [a, b, c, d, e, f] = self.0;
        format!("{a:02x}-{b:02x}-{c:02x}-{d:02x}-{e:02x}-{f:02x}")
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl fmt::Debug for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Mac({self})")
    }
}

impl FromStr for Mac {
    type Err = MacParseError;

    /// Accepts `:` or `-` separated two-digit hex octets, any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || MacParseError {
            input: s.to_owned(),
        };
        let mut out = [0u8; 6];
        let mut parts = s.split([':', '-']);
        for slot in &mut out {
            let p = parts.next().ok_or_else(err)?;
            // from_str_radix alone would take "+a".
            if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err());
            }
            *slot = u8::from_str_radix(p, 16).map_err(|_| err())?;
        }
        if parts.next().is_some() {
            return Err(err());
        }
        Ok(Mac(out))
    }
}

impl serde::Serialize for Mac {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Mac {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: Mac = Mac([0x52, 0x54, 0x00, 0xab, 0xcd, 0x01]);

    #[test]
    fn parses_colon_and_dash_forms_any_case() {
        for s in [
            "52:54:00:ab:cd:01",
            "52:54:00:AB:cd:01",
            "52-54-00-ab-cd-01",
            "52-54-00-AB-CD-01",
        ] {
            assert_eq!(s.parse::<Mac>(), Ok(M), "{s}");
        }
    }

    #[test]
    fn rejects_what_is_not_six_octets() {
        for s in [
            "",
            "52:54:00:ab:cd",
            "52:54:00:ab:cd:01:02",
            "52:54:00:ab:cd:zz",
            "525:4:00:ab:cd:01",
            "52:54:00:ab:cd:1",
            "52:54:00:ab:cd:+1",
            "52:54:00:ab:cd:01:",
            "52 54 00 ab cd 01",
        ] {
            let err = s.parse::<Mac>().err();
            assert!(err.is_some(), "{s:?} parsed");
            if let Some(e) = err {
                assert!(e.to_string().contains(&format!("{s:?}")), "{e}");
            }
        }
    }

    #[test]
    fn prints_canonical_forms() {
        assert_eq!(M.to_string(), "52:54:00:ab:cd:01");
        assert_eq!(format!("{M:?}"), "Mac(52:54:00:ab:cd:01)");
        assert_eq!(M.dashed(), "52-54-00-ab-cd-01");
        assert_eq!(M.bootif(), "01-52-54-00-ab-cd-01");
        assert_eq!(M.to_string().parse::<Mac>(), Ok(M));
    }

    #[test]
    fn serde_is_the_canonical_string() {
        assert_eq!(
            serde_json::to_string(&M).ok().as_deref(),
            Some("\"52:54:00:ab:cd:01\"")
        );
        assert_eq!(
            serde_json::from_str::<Mac>("\"52-54-00-AB-CD-01\"").ok(),
            Some(M)
        );
        assert!(serde_json::from_str::<Mac>("\"52:54\"").is_err());
        assert!(serde_json::from_str::<Mac>("5").is_err());
    }
}
