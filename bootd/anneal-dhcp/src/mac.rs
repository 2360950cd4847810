//! Ethernet MAC addresses.

use std::fmt;
use std::str::FromStr;

/// A 48-bit Ethernet address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Mac(pub [u8; 6]);

/// A MAC address string that is not six hex octets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid mac address {input:?}")]
pub struct MacParseError {
    input: String,
}

impl Mac {
    /// The `01-aa-bb-cc-dd-ee-ff` form the kernel's `BOOTIF=` expects.
    pub fn bootif(&self) -> String {
        let [a, b, c, d, e, f] = self.0;
        format!("01-{a:02x}-{b:02x}-{c:02x}-{d:02x}-{e:02x}-{f:02x}")
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

impl FromStr for Mac {
    type Err = MacParseError;

    /// Accepts `:` or `-` separated hex octets, any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || MacParseError {
            input: s.to_owned(),
        };
        let mut out = [0u8; 6];
        let mut parts = s.split([':', '-']);
        for slot in &mut out {
            let p = parts.next().ok_or_else(err)?;
            if p.len() != 2 {
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

    #[test]
    fn parses_and_prints() {
        let m: Mac = "52:54:00:AB:cd:01".parse().unwrap_or_default();
        assert_eq!(m.to_string(), "52:54:00:ab:cd:01");
        assert_eq!(m.bootif(), "01-52-54-00-ab-cd-01");
        assert_eq!("52-54-00-ab-cd-01".parse::<Mac>(), Ok(m));
        assert!("52:54:00:ab:cd".parse::<Mac>().is_err());
        assert!("52:54:00:ab:cd:01:02".parse::<Mac>().is_err());
        assert!("52:54:00:ab:cd:zz".parse::<Mac>().is_err());
        assert!("525:4:00:ab:cd:01".parse::<Mac>().is_err());
    }
}
