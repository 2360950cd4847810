//! In-memory lease state (pure; the shell persists it).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use crate::mac::Mac;

/// How long an address a client declined (found in use) is withheld, seconds.
pub const DECLINE_HOLD_SECS: u64 = 600;

/// One lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Lease {
    pub mac: Mac,
    pub address: Ipv4Addr,
    /// Unix seconds.
    pub expires: u64,
}

/// A change to the lease state decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEffect {
    /// ACK: the client holds `lease`.
    Bind(Lease),
    /// RELEASE: the client gave the address back.
    Release { mac: Mac, address: Ipv4Addr },
    /// DECLINE: the address is in use by someone else.
    Decline { mac: Mac, address: Ipv4Addr },
}

/// All leases of one Subnet, plus declined addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Leases {
    by_mac: BTreeMap<Mac, Lease>,
    declined: BTreeMap<Ipv4Addr, u64>,
}

impl Leases {
    /// From persisted leases (later duplicates for one MAC win).
    pub fn from_leases(iter: impl IntoIterator<Item = Lease>) -> Self {
        Leases {
            by_mac: iter.into_iter().map(|l| (l.mac, l)).collect(),
            declined: BTreeMap::new(),
        }
    }

    /// The lease of `mac`, expired or not.
    pub fn get(&self, mac: &Mac) -> Option<&Lease> {
        self.by_mac.get(mac)
    }

    /// Which MAC holds `addr` with an unexpired lease.
    pub fn holder(&self, addr: Ipv4Addr, now: u64) -> Option<Mac> {
        self.by_mac
            .values()
            .find(|l| l.address == addr && l.expires > now)
            .map(|l| l.mac)
    }

    /// True while a DECLINE withholds `addr`.
    pub fn is_declined(&self, addr: Ipv4Addr, now: u64) -> bool {
        self.declined.get(&addr).is_some_and(|&until| until > now)
    }

    /// Applies one effect.
    pub fn apply(&mut self, effect: LeaseEffect, now: u64) {
        match effect {
            LeaseEffect::Bind(l) => {
                self.by_mac.insert(l.mac, l);
            }
            LeaseEffect::Release { mac, address } => {
                if self.by_mac.get(&mac).is_some_and(|l| l.address == address) {
                    self.by_mac.remove(&mac);
                }
            }
            LeaseEffect::Decline { mac, address } => {
                if self.by_mac.get(&mac).is_some_and(|l| l.address == address) {
                    self.by_mac.remove(&mac);
                }
                self.declined.insert(address, now + DECLINE_HOLD_SECS);
            }
        }
        self.declined.retain(|_, until| *until > now);
    }

    /// Removes a MAC's lease (active release); returns it.
    pub fn remove(&mut self, mac: &Mac) -> Option<Lease> {
        self.by_mac.remove(mac)
    }

    /// Keeps only leases for which `keep` holds; returns the removed ones.
    pub fn retain(&mut self, mut keep: impl FnMut(&Lease) -> bool) -> Vec<Lease> {
        let mut gone = Vec::new();
        self.by_mac.retain(|_, l| {
            let k = keep(l);
            if !k {
                gone.push(*l);
            }
            k
        });
        gone
    }

    /// Number of unexpired leases.
    pub fn active(&self, now: u64) -> usize {
        self.by_mac.values().filter(|l| l.expires > now).count()
    }

    /// All leases, by MAC.
    pub fn iter(&self) -> impl Iterator<Item = &Lease> {
        self.by_mac.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_release_decline() {
        let a = Mac([2, 0, 0, 0, 0, 1]);
        let ip = Ipv4Addr::new(10, 0, 0, 5);
        let mut l = Leases::default();
        l.apply(
            LeaseEffect::Bind(Lease {
                mac: a,
                address: ip,
                expires: 100,
            }),
            0,
        );
        assert_eq!(l.holder(ip, 50), Some(a));
        assert_eq!(l.holder(ip, 100), None);
        assert_eq!(l.active(50), 1);
        // release for another address is ignored
        l.apply(
            LeaseEffect::Release {
                mac: a,
                address: Ipv4Addr::new(10, 0, 0, 6),
            },
            1,
        );
        assert!(l.get(&a).is_some());
        l.apply(
            LeaseEffect::Decline {
                mac: a,
                address: ip,
            },
            10,
        );
        assert!(l.get(&a).is_none());
        assert!(l.is_declined(ip, 10 + DECLINE_HOLD_SECS - 1));
        assert!(!l.is_declined(ip, 10 + DECLINE_HOLD_SECS));
    }
}
